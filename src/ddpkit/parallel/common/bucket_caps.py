"""How large gradient buckets may grow: torch's defaults and the one rule for a cap (torch-free).

Kept free of torch so that the command line (``ddpkit bench --bucket-cap-mb``)
checks a cap with the same rule as ``DistributedDataParallel`` and
``DistributedOptimizer`` without importing torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["DEFAULT_BUCKET_CAP_MB", "FIRST_BUCKET_MB", "bucket_limits", "check_bucket_cap"]

DEFAULT_BUCKET_CAP_MB = 25.0
"""torch's default bucket cap in MiB."""
FIRST_BUCKET_MB = 1.0
"""Cap of the first bucket (per dtype and device) in MiB when the cap is left at its default (torch's)."""
_MIB = 1024 * 1024


def check_bucket_cap(value: Any, name: str = "bucket_cap_mb") -> None:
    """Raise unless ``value`` is ``None`` or a number of MiB >= 0 (torch's rule: 0 gives a bucket per parameter).

    Raises:
        ValueError: naming ``name`` and the value.
    """
    if value is None:
        return
    if not (isinstance(value, (int, float)) and value >= 0):
        raise ValueError(f"{name}={value!r} must be a number of MiB >= 0 (0: a bucket per parameter): "
                         f"the default is {DEFAULT_BUCKET_CAP_MB:g}")


def bucket_limits(bucket_cap_mb: float | None, bucket_cap_mb_list: Sequence[float] | None = None) -> list[int]:
    """Bucket size limits in bytes, in the order buckets close.

    Args:
        bucket_cap_mb: the cap in MiB; ``None``: torch's default, 25 MiB with a
            first bucket of :data:`FIRST_BUCKET_MB` (a value given caps the
            first bucket too, torch's rule).
        bucket_cap_mb_list: one cap per bucket, the last for every bucket
            after (torch's argument of that name); replaces ``bucket_cap_mb``.
    """
    if bucket_cap_mb_list:
        return [int(c * _MIB) for c in bucket_cap_mb_list]
    cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * _MIB)
    first = int(FIRST_BUCKET_MB * _MIB) if bucket_cap_mb is None else cap
    return [first, cap] if first < cap else [cap]

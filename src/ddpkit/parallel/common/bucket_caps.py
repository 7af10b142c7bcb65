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


def bucket_limits(cap_mb: float | None, caps_mb: Sequence[float] | None = None) -> list[int]:
    """Bucket size limits in bytes, in the order buckets close.

    Args:
        cap_mb: the cap in MiB; ``None``: torch's default, 25 MiB with a first
            bucket of :data:`FIRST_BUCKET_MB` (a value given caps the first
            bucket too, torch's rule).
        caps_mb: one cap per bucket, the last for every bucket after (torch's
            ``bucket_cap_mb_list``); replaces ``cap_mb``.
    """
    if caps_mb:
        return [int(c * _MIB) for c in caps_mb]
    cap = int((DEFAULT_BUCKET_CAP_MB if cap_mb is None else cap_mb) * _MIB)
    first = int(FIRST_BUCKET_MB * _MIB) if cap_mb is None else cap
    return [first, cap] if first < cap else [cap]

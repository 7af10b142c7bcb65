"""The reductions ``comm=`` names: ``none`` (the exact all-reduce), ``fp16``, ``bf16`` and ``powersgd:R``, as a
:class:`Scheme`; the value of ``comm=`` (a scheme pinned, or ``auto``'s candidates); and a pinned scheme's hook.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpkit.comm import bucket_hooks, powersgd

__all__ = ["CANDIDATE_SPECS", "SCHEMES", "Scheme", "parse_comm", "parse_scheme", "pinned"]

SCHEMES = ("none", "fp16", "bf16", "powersgd")
"""The reductions a spec names (``powersgd:R`` with its rank)."""
CANDIDATE_SPECS = ("fp16", "bf16", "powersgd:16", "powersgd:32")
"""What ``comm="auto"`` considers beside the exact all-reduce. PowerSGD's ranks below 16 only when listed
(``auto:powersgd:4,powersgd:8,...``): a comm hook cannot see the loss, and on the GPT of ``ddpkit train`` (0.8 M,
AdamW, 2 ranks, 512 steps) rank 8 ended 4.1 % above the exact all-reduce's validation loss where rank 16 ended
0.35 % and fp16 0.27 % above it (the cost of ranks 4 and 8 was 1.2 % and 0.8 % after 128 steps: it grows as the
loss falls; ranks 1 and 2 cost 7-11 % there). docs/comm-auto.md has the runs."""


@dataclass(frozen=True)
class Scheme:
    """One way of reducing a bucket: ``none`` (the exact all-reduce), ``fp16``, ``bf16`` or ``powersgd`` at
    ``rank``."""

    name: str
    rank: int = 0

    @property
    def spec(self) -> str:
        """What pins it: ``comm=`` takes this string."""
        return f"powersgd:{self.rank}" if self.name == "powersgd" else self.name

    @property
    def lossiness(self) -> tuple[int, int]:
        """Order of preference among near-equals: exact; half precision, bf16 before fp16 (bf16 keeps float32's
        range, fp16 turns a gradient beyond 65,504 into inf); then PowerSGD by falling rank."""
        return {"none": (0, 0), "bf16": (1, 0), "fp16": (1, 1)}.get(self.name, (2, -self.rank))

    def check(self) -> None:
        """Raise ``ValueError`` unless this is a reduction :func:`parse_scheme` could give."""
        if self.name not in SCHEMES:
            raise ValueError(f"Scheme({self.name!r}): not a reduction: use none, fp16, bf16 or powersgd")
        ok = (isinstance(self.rank, int) and not isinstance(self.rank, bool)
              and (self.rank >= 1 if self.name == "powersgd" else self.rank == 0))
        if not ok:
            raise ValueError(f"Scheme({self.name!r}, {self.rank!r}): " + (
                "PowerSGD needs a whole rank of at least 1" if self.name == "powersgd" else "only powersgd has a rank"))


def parse_scheme(spec: str) -> Scheme:
    """``none``, ``fp16``, ``bf16`` or ``powersgd:R`` as a :class:`Scheme` (``ValueError`` naming the fix)."""
    name, colon, rank = spec.strip().partition(":")
    if name not in SCHEMES:
        raise ValueError(f"comm={spec!r}: {name!r} is not a reduction: use none, fp16, bf16 or powersgd:R (or auto, "
                         "alone or with a list of these)")
    if name != "powersgd":
        if colon:
            raise ValueError(f"comm={spec!r}: {name} takes no ':{rank}' (only powersgd:R has a rank)")
        return Scheme(name)
    if not (rank.isascii() and rank.isdigit()) or int(rank) < 1:
        raise ValueError(f"comm={spec!r}: PowerSGD needs its rank as a whole number of at least 1, e.g. powersgd:4")
    return Scheme(name, int(rank))


def parse_comm(spec: str) -> tuple[Scheme, ...] | Scheme:
    """``comm=``'s value: a :class:`Scheme` (pinned), or the candidates of ``auto`` (``auto`` alone: all of
    :data:`CANDIDATE_SPECS`; ``auto:bf16,powersgd:4``: those, the exact all-reduce always among them)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"comm={spec!r}: give 'auto', or a reduction to pin: none, fp16, bf16 or powersgd:R")
    head, colon, rest = spec.strip().partition(":")
    if head != "auto":
        return parse_scheme(spec)
    names = [s for s in rest.split(",") if s.strip()] if colon else list(CANDIDATE_SPECS)
    if not names:
        raise ValueError(f"comm={spec!r}: list the candidates after 'auto:' (e.g. auto:bf16,powersgd:4) or give "
                         "'auto' alone")
    if any(n.strip().partition(":")[0] == "auto" for n in names):
        raise ValueError(f"comm={spec!r}: after 'auto:' list reductions (fp16, bf16, powersgd:R), not 'auto'")
    schemes = tuple(dict.fromkeys(s for s in (parse_scheme(n) for n in names) if s.name != "none"))
    if not schemes:
        raise ValueError(f"comm={spec!r} leaves nothing to choose (the exact all-reduce is always a candidate): pin it "
                         "with comm='none', or list fp16, bf16 or powersgd:R after 'auto:'")
    return schemes


def pinned(scheme: Scheme, process_group: Any = None,
           powersgd_start: int = 10) -> tuple[Any, Callable[..., Any]] | None:
    """``(state, hook)`` that reduce with ``scheme`` from the first step (``comm="fp16"`` and the like; PowerSGD
    after ``powersgd_start`` exact steps), or None for ``none``: DDP without a hook."""
    if scheme.name == "none":
        return None
    if scheme.name == "powersgd":
        return (powersgd.PowerSGDState(process_group, matrix_approximation_rank=scheme.rank,
                                       start_powerSGD_iter=powersgd_start), powersgd.powersgd_hook)
    return process_group, {"fp16": bucket_hooks.fp16_compress_hook, "bf16": bucket_hooks.bf16_compress_hook}[
        scheme.name]

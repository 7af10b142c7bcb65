"""Every rank must hold the same model: the check DDP and DistributedOptimizer make before they broadcast.

A model built with different arguments, or with other ``requires_grad`` flags,
on one rank would silently average unrelated tensors (or hang, when the
bucket sizes differ). The check costs a digest from each rank; only when the
digests differ are the parameter lists gathered, to name the first difference.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.runtime import events

__all__ = ["DDPConfigError", "verify_same_parameters"]


class DDPConfigError(ValueError, RuntimeError):
    """The model cannot be wrapped as given (nothing to train, ranks that differ).

    A ``RuntimeError``, as torch raises for these mistakes, and a ``ValueError``
    as earlier ddpkit versions did: either ``except`` catches it.
    """


def verify_same_parameters(
    named: Sequence[tuple[str, torch.Tensor]], group: dist.ProcessGroup, owner: str = "DistributedDataParallel"
) -> None:
    """Raise on every rank if the ranks' parameters differ, naming the first difference (``owner`` says who checks)."""
    # The strides too (torch's DDP checks them): the buckets copy each gradient in its memory order, so a
    # channels_last weight on one rank would be averaged element by element with another layout's. Those of
    # trainable parameters' dimensions longer than 1 only: a frozen one is in no bucket, and a dimension of 1 has
    # any stride without changing where an element lies.
    mine = [(n, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad,
             tuple(st for size, st in zip(p.shape, p.stride()) if size > 1) if p.requires_grad else ())
            for n, p in named]
    world = dist.get_world_size(group)
    # A digest first (a few bytes from each rank); the lists themselves only to name a difference.
    digests: list[Any] = [None] * world
    events.collective("{} construction: compare parameter shapes", owner)
    dist.all_gather_object(digests, hashlib.sha256(repr(mine).encode()).hexdigest(), group=group)
    if len(set(digests)) == 1:
        return
    everyone: list[Any] = [None] * world
    events.collective("{} construction: gather the parameter lists to name the difference", owner)
    dist.all_gather_object(everyone, mine, group=group)
    longest = max(len(e) for e in everyone)
    for k in range(longest):
        entries = [e[k] if k < len(e) else None for e in everyone]
        if any(x != entries[0] for x in entries):
            name = next(x[0] for x in entries if x is not None)

            def describe(x: Any) -> str:
                if x is None:
                    return "no such parameter"
                strides = f" strides {list(x[4])}" if len({e[4] for e in entries if e is not None}) > 1 else ""
                return f"{x[0]!r} shape {list(x[1])}{strides} {x[2]}" + ("" if x[3] else " (frozen)")

            what = "; ".join(f"rank {r} has {describe(x)}" for r, x in enumerate(entries))
            counts = ", ".join(f"rank {r}: {len(e)}" for r, e in enumerate(everyone))
            raise DDPConfigError(
                f"{owner}: the ranks hold different parameters (counts {counts}); "
                f"first difference at parameter #{k} {name!r}: {what}. Build the same model with "
                "the same arguments, the same requires_grad flags and the same memory format on every rank "
                "before wrapping it"
            )

"""Collect and share values across ranks for your own loop: objects, tensors, metrics, scalars.

Every function here is a collective: every rank of the group calls it, in the
same order. In a world of one (or before any process group exists) each
returns what a world of one would: the value itself, or a list of it.

Example, exact evaluation over a sharded test set::

    sampler = ddpkit.DistributedSampler(test_set, shuffle=False)
    preds = torch.cat([model(x).argmax(1) for x, _ in DataLoader(test_set, sampler=sampler, batch_size=64)])
    preds = ddpkit.gather_for_metrics(preds, sampler=sampler)   # len(test_set) rows, in dataset order
    ddpkit.print0("mean loss", ddpkit.reduce_value(loss.item()))
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.runtime import events
from ddpkit.runtime.devices import comm_device, comm_tensor

__all__ = ["all_gather_object", "broadcast_object", "gather", "gather_for_metrics", "reduce_value"]

_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def _world(group: dist.ProcessGroup | None) -> int:
    """The group's size; a rank outside ``group`` is refused (torch's collectives return there with a warning, and
    these helpers would hand back this rank's own value, or nothing, as the group's)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"this rank ({dist.get_rank()}) is not in the group it was given: call only on its members")
    return dist.get_world_size(group)


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj`` (anything picklable), as a list indexed by rank.

    Warning:
        Objects travel pickled: only gather from ranks you trust.
    """
    world = _world(group)
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    events.collective("all_gather_object")
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any = None, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Rank ``src``'s ``obj`` on every rank (the others' ``obj`` is ignored)."""
    if _world(group) == 1:
        return obj
    box = [obj]
    events.collective("broadcast_object from rank {}", src)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _map(fn: Any, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return type(value)((k, _map(fn, v)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map(fn, v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map(fn, v) for v in value)
    raise TypeError(
        f"cannot gather a {type(value).__name__}: pass tensors, or dicts/lists/tuples of them "
        "(use all_gather_object for other objects)"
    )


_MAX_DIMS = 32
"""The most dimensions a gathered tensor may have (what one row of the shapes' all-gather holds)."""


def _structure(value: Any) -> int:
    """A digest of ``value``'s nesting (types, keys in their order, positions): the same on every rank, or the
    leaves of two ranks would be joined by position (a dict's keys in another order)."""
    def walk(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return "T"
        if isinstance(v, Mapping):
            return "{" + ",".join(f"{k!r}:{walk(x)}" for k, x in v.items()) + "}"
        if isinstance(v, (list, tuple)):
            return f"{type(v).__name__}[" + ",".join(walk(x) for x in v) + "]"
        return type(v).__name__

    return zlib.crc32(walk(value).encode())


def _gather_parts(t: torch.Tensor, group: dist.ProcessGroup | None, structure: int) -> list[torch.Tensor]:
    """Each rank's ``t``; the first dimension may differ between ranks, nothing else (nor the structure ``t`` is a
    leaf of)."""
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
        raise ValueError(f"gather: a {t.dim()}-dimensional {t.dtype} tensor is not supported (at most {_MAX_DIMS} "
                         "dimensions, a standard dtype)")
    world = _world(group)
    device = comm_device(group)
    # One small all-gather of (rows, structure, dtype, dims, trailing shape) first: the
    # rows may differ between ranks, everything else must not.
    mine = torch.tensor([t.shape[0], structure, _DTYPES.index(t.dtype), t.dim(), *t.shape[1:]], dtype=torch.int64)
    row = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64)
    row[: len(mine)] = mine
    rows = [torch.zeros_like(row, device=device) for _ in range(world)]
    events.collective("gather (tensors)", nbytes=row.numel() * row.element_size())
    dist.all_gather(rows, row.to(device), group=group)
    meta = torch.stack([r.cpu() for r in rows])
    for r in range(world):
        if meta[r, 1] != structure:
            raise ValueError(f"gather: rank {r}'s value is nested otherwise than this rank's (other keys, or keys "
                             "in another order, or other lengths): every rank must pass the same structure")
        if meta[r, 2:].tolist() != row[2:].tolist():
            raise ValueError(
                f"gather: rank {r} has a tensor of other rank, trailing shape or dtype than this rank's "
                f"{tuple(t.shape)} {t.dtype}: only the first dimension may differ between ranks"
            )
    lengths = meta[:, 0].tolist()
    longest = max(lengths)
    padded = torch.zeros((longest, *t.shape[1:]), dtype=t.dtype, device=device)
    padded[: t.shape[0]] = t.to(device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [p[:n].to(t.device) for p, n in zip(parts, lengths)]


_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]


def gather(value: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Every rank's tensors concatenated along the first dimension, rank 0's first.

    ``value`` is a tensor or a dict/list/tuple of tensors (the same structure
    on every rank); ranks may hold different numbers of rows (the last batch
    of an epoch). A 0-dimensional tensor counts as one row.

    Raises:
        ValueError: ranks' tensors differ in anything but the first dimension.
        TypeError: ``value`` holds something that is not a tensor.
    """
    if _world(group) == 1:
        return _map(lambda t: t.reshape(1) if t.dim() == 0 else t, value)
    structure = _structure(value)
    return _map(lambda t: torch.cat(_gather_parts(t, group, structure)), value)


def gather_for_metrics(value: Any, sampler: Any = None, group: dist.ProcessGroup | None = None) -> Any:
    """:func:`gather`, then drop the samples the sampler added to even out the shards.

    With ``sampler`` (a :class:`ddpkit.DistributedSampler` or torch's, over
    the whole epoch, or the ``DataLoader`` that holds it) the rows come back in
    the sampler's order over the dataset, each sample exactly once:
    ``len(dataset)`` rows (fewer with ``drop_last``). Without it, this is
    :func:`gather`.

    Raises:
        ValueError: a rank's row count does not match its shard of the sampler
            (the epoch was not run to its end).
        TypeError: ``sampler`` is not a distributed sampler (nor a loader with one).
    """
    if sampler is None:
        return gather(value, group)
    if not hasattr(sampler, "num_samples") and hasattr(getattr(sampler, "sampler", None), "num_samples"):
        sampler = sampler.sampler  # a DataLoader: its sampler
    if not (hasattr(sampler, "num_samples") and hasattr(sampler, "dataset")):
        raise TypeError(f"gather_for_metrics(sampler={type(sampler).__name__}): pass the epoch's DistributedSampler "
                        "(ddpkit's or torch's), or the DataLoader that holds it")
    world = _world(group)
    n = len(sampler.dataset)
    drop_last = getattr(sampler, "drop_last", False)
    padded = getattr(sampler, "pad", True)

    structure = _structure(value)

    def order(t: torch.Tensor) -> torch.Tensor:
        parts = _gather_parts(t, group, structure) if world > 1 else [t.reshape(1) if t.dim() == 0 else t]
        shard = [len(range(r, n, world)) for r in range(world)] if not padded else [sampler.num_samples] * world
        got = [len(p) for p in parts]
        if got != shard:
            raise ValueError(
                f"gather_for_metrics: the ranks hold {got} rows, their shards of the sampler have {shard}: "
                "run the whole epoch before gathering (or call gather() for partial results)"
            )
        # Rank r's i-th row is position i * world + r of the epoch's order.
        rows = torch.stack([p[: min(got)] for p in parts], dim=1).reshape(-1, *t.shape[1:]) if parts else t
        extra = [p[min(got):] for p in parts if len(p) > min(got)]
        merged = torch.cat([rows, *extra]) if extra else rows
        keep = merged.shape[0] if drop_last else min(n, merged.shape[0])
        return merged[:keep]

    return _map(order, value)


def reduce_value(value: float | int | torch.Tensor, op: str = "mean", group: dist.ProcessGroup | None = None) -> Any:
    """A scalar (or tensor) reduced over the ranks, for logging: ``op`` in mean, sum, min, max.

    Reduced in float64 (complex128 for a complex value); a Python number comes
    back as a ``float`` (a ``complex``), a tensor as a tensor of its own dtype
    and device.

    Raises:
        ValueError: ``op`` is not one of mean, sum, min, max; min or max of a
            complex value (complex numbers have no order); the mean of an
            integer or bool tensor (it would be truncated to that dtype).
    """
    if op not in _OPS:
        raise ValueError(f"reduce_value(op={op!r}): choose one of {', '.join(_OPS)}")
    is_tensor = isinstance(value, torch.Tensor)
    complex_ = value.is_complex() if is_tensor else isinstance(value, complex)
    if is_tensor and op == "mean" and not (value.is_floating_point() or complex_):
        raise ValueError(f"reduce_value(op='mean') of a {value.dtype} tensor: the mean would be truncated to its "
                         "dtype; pass a floating-point tensor (or a Python number), or use op='sum' and divide")
    if complex_ and op in ("min", "max"):
        raise ValueError(f"reduce_value(op={op!r}) of a complex value: complex numbers have no order; reduce its "
                         "abs() (or its real part), or use op='sum' or 'mean'")
    wide = torch.complex128 if complex_ else torch.float64
    world = _world(group)
    # (a complex value cast to float64 would lose its imaginary part, with only a warning)
    t = value.detach().to(wide) if is_tensor else torch.tensor(complex(value) if complex_ else float(value), dtype=wide)
    if world > 1:
        t = comm_tensor(t, group=group)
        events.collective("reduce_value (op {})", op, nbytes=t.numel() * t.element_size())
        dist.all_reduce(t, op=_OPS[op], group=group)
        if op == "mean":
            t /= world
    if is_tensor:
        return t.to(dtype=value.dtype, device=value.device)
    return t.item()

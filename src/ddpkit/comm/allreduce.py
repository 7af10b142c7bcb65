"""All-reduce and its building blocks, built from point-to-point messages so the algorithms are visible.

``algorithm``:

* ``native``: the backend's own collective (gloo, NCCL).
* ``naive``: every rank sends its tensor to rank 0, which reduces them in rank
  order and sends the result back: 2(p-1) full-size messages through one rank.
* ``ring``: reduce-scatter then all-gather around a ring, the tensor cut into
  p chunks: each rank sends 2(p-1)/p of the data, whatever p (bandwidth-optimal).
* ``tree``: binomial-tree reduce to rank 0 then binomial-tree broadcast:
  2 log2(p) steps of full-size messages (latency-optimal for small tensors).
* ``hierarchical``: reduce inside each node to its first rank (tree), ring
  all-reduce among those node leaders, broadcast inside the node (tree). The
  node layout is ``local_size`` consecutive ranks: the runtime's
  ``LOCAL_WORLD_SIZE`` unless given.

Every rank of the group calls each function with a tensor of the same shape
and dtype (checked first, with one small all-gather, unless ``check=False``):
a mismatch raises on every rank instead of hanging or mixing garbage.
Arguments that are wrong on their own (an op, a dtype, a layout) raise on
every rank before any message goes out, so no rank is left waiting.
Tensors are reduced in place outside autograd (a leaf that requires grad
included, as with torch.distributed), non-contiguous ones too. Integer tensors
are exact; floating sums depend on the order of additions, which differs
between algorithms (a few ulps).

``async_op=True`` (every function, as in torch.distributed) returns a
:class:`Handle` (``wait()``, ``get_future()``), so a DDP comm hook can use any
algorithm. The point-to-point algorithms run to completion before returning
(their handle is already done); ``native`` is asynchronous as the backend
makes it, and the tensor (the output, for ``reduce_scatter`` and
``all_gather``) holds the result once the handle is waited for.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ddpkit.comm.algorithms import (
    exchange,
    hierarchical_all_reduce,
    naive_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    tree_broadcast,
    tree_reduce,
)
from ddpkit.runtime import events
from ddpkit.runtime.devices import comm_device

__all__ = ["ALGORITHMS", "OPS", "Handle", "all_gather", "all_reduce", "broadcast", "reduce", "reduce_scatter"]

ALGORITHMS = ("native", "naive", "ring", "tree", "hierarchical")
OPS = ("sum", "avg", "prod", "min", "max", "band", "bor", "bxor")
_BITWISE = ("band", "bor", "bxor")
_NATIVE_OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
               "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.SUM, "band": dist.ReduceOp.BAND,
               "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}


class Handle:
    """The result of ``async_op=True``: ``wait()`` blocks until done; ``get_future()`` yields the tensor."""

    def __init__(self, tensor: torch.Tensor, work: dist.Work | None = None, after: Callable[[], object] | None = None):
        self._tensor, self._work, self._after = tensor, work, after
        self._done = work is None
        self._finishing = threading.Lock()
        """``after`` runs once: from ``wait()`` or from a future's callback (the backend's thread), whichever
        comes first, and the other waits for it (an average divided twice otherwise)."""

    @torch.no_grad()
    def _finish(self) -> None:
        with self._finishing:
            after, self._after = self._after, None
            if after is not None:
                after()
            self._done = True

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until done (``timeout``: as torch's ``Work.wait``, the longest wait; a ``RuntimeError`` after it)."""
        if not self._done:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
            self._finish()
        return True

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        if self._done:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result([self._tensor])
            return fut

        def finish(f: torch.futures.Future) -> list[torch.Tensor]:
            f.wait()
            self._finish()
            return [self._tensor]

        return self._work.get_future().then(finish)


# ---------------------------------------------------------------- checks


_FROM_REDUCE_OP = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "prod",
                   dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max", dist.ReduceOp.BAND: "band",
                   dist.ReduceOp.BOR: "bor", dist.ReduceOp.BXOR: "bxor"}


def _check(op: str | dist.ReduceOp, algorithm: str, tensor: torch.Tensor) -> str:
    """Everything that can be wrong with the arguments on their own, before any message is sent: every rank
    given the same arguments raises the same error, none is left waiting. Returns the op's name."""
    if isinstance(op, dist.ReduceOp.RedOpType) or type(op) is dist.ReduceOp:
        if op not in _FROM_REDUCE_OP:
            raise ValueError(f"op={op!r} is not supported: use {', '.join(OPS)}")
        op = _FROM_REDUCE_OP[op]
    if op not in OPS:
        raise ValueError(f"op={op!r} is not a reduction: choose one of {', '.join(OPS)} (or a dist.ReduceOp)")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not known: choose one of {', '.join(ALGORITHMS)}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"a {tensor.layout} tensor is not supported by ddpkit.collectives: pass a dense tensor "
                         "(t.to_dense()), or use torch.distributed's own collective")
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"op='avg' on a {tensor.dtype} tensor cannot hold the mean in place: use a floating dtype")
    if op in _BITWISE and (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"op={op!r} (bitwise) of a {tensor.dtype} tensor: bitwise ops take integer or bool tensors, "
                         "as in torch.distributed")
    if tensor.is_complex() and op in ("min", "max", "prod"):
        raise ValueError(f"op={op!r} is not defined for complex tensors ({tensor.dtype}), as in torch.distributed: "
                         "use sum or avg")
    return op


def _root(group: dist.ProcessGroup, rank: int | None, group_rank: int | None, what: str) -> int:
    """The group rank of a broadcast's source or a reduction's destination: ``rank`` is a global rank
    (torch.distributed's ``src``/``dst``), ``group_rank`` one within ``group`` (its ``group_src``/``group_dst``);
    neither: the group's first."""
    if rank is not None and group_rank is not None:
        raise ValueError(f"give {what}= (a global rank) or group_{what}= (a rank within the group), not both")
    size = dist.get_world_size(group)
    if group_rank is not None:
        if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < size:
            raise ValueError(f"group_{what}={group_rank!r} is not a rank within the group (0 to {size - 1})")
        return group_rank
    if rank is None:
        return 0
    members = dist.get_process_group_ranks(group)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank not in members:
        raise ValueError(f"{what}={rank!r} is not a rank of the group (its global ranks: {members}): {what} is a "
                         f"global rank, as in torch.distributed; group_{what}= takes a rank within the group")
    return members.index(rank)


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ddpkit.collectives need a process group: call ddpkit.init() first")
    group = group if group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError(f"this rank ({dist.get_rank()}) is not in the group it was given: call only on its members")
    return group


def _same_everywhere(tensor: torch.Tensor, group: dist.ProcessGroup, what: str) -> None:
    """One small all-gather of (numel, dtype, shape): every rank raises on a mismatch."""
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"{what}: dtype {tensor.dtype} is not supported")
    shape = list(tensor.shape[:5]) + [0] * (5 - min(5, tensor.dim()))
    meta = torch.tensor([tensor.numel(), _DTYPES.index(tensor.dtype), tensor.dim(), *shape], dtype=torch.int64)
    device = comm_device(group, like=tensor)
    parts = [torch.empty_like(meta, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, meta.to(device), group=group)
    for r, p in enumerate(parts):
        theirs = p.cpu()
        if not torch.equal(theirs, meta):
            raise ValueError(
                f"{what}: group rank {r} passed {theirs[0].item()} elements of {_DTYPES[int(theirs[1])]}, "
                f"this rank {tensor.numel()} of {tensor.dtype} (shape {tuple(tensor.shape)}): every rank "
                "must pass the same shape and dtype"
            )


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


def _local_size(local_size: int | None) -> int:
    if local_size is not None:
        return local_size
    from ddpkit.runtime.group import context

    ctx = context()
    if ctx is not None:
        return ctx.local_world_size
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


# ---------------------------------------------------------------- public API


def _done(result: torch.Tensor, async_op: bool) -> Handle | None:
    """What a collective that has finished returns: a finished :class:`Handle` of ``result`` under ``async_op``."""
    return Handle(result) if async_op else None


def _native(result: torch.Tensor, work: dist.Work, finish: Callable[[], object], async_op: bool) -> Handle | None:
    """What a collective of the backend's returns: ``finish`` (copies back, an average's division) runs once the
    backend's ``work`` is done, at once without ``async_op``, else from the :class:`Handle`."""
    if async_op:
        return Handle(result, work, finish)
    work.wait()
    finish()
    return None


def _copy_back(flat: torch.Tensor, tensor: torch.Tensor) -> None:
    """The result into ``tensor`` where the collective ran on a contiguous copy of it."""
    if flat is not tensor:
        tensor.copy_(flat)


def _in_place(tensor: torch.Tensor, run: Callable[[torch.Tensor], None]) -> None:
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    run(flat)
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))


@torch.no_grad()
def all_reduce(tensor: torch.Tensor, op: str = "sum", algorithm: str = "native",
               group: dist.ProcessGroup | None = None, async_op: bool = False, *,
               local_size: int | None = None, check: bool = True) -> Handle | None:
    """Reduce ``tensor`` in place over the group, every rank getting the result.

    Args:
        tensor: the same shape and dtype on every rank; any layout.
        op: ``sum``, ``avg`` (floating dtypes), ``prod``, ``min``, ``max``, or ``band``, ``bor``, ``bxor``
            (integer and bool dtypes).
        algorithm: ``native``, ``naive``, ``ring``, ``tree`` or ``hierarchical``.
        group: the process group (default: the world).
        async_op: return a :class:`Handle` instead of ``None``.
        local_size: ranks per node for ``hierarchical`` (default: the runtime's).
        check: verify first that every rank passes the same shape and dtype.

    Raises:
        ValueError: unknown op or algorithm, ``avg`` of integers, ranks that
            disagree on the tensor, a rank outside ``group``.
        RuntimeError: no process group.
    """
    op = _check(op, algorithm, tensor)
    group = _group(group)
    world = dist.get_world_size(group)
    if world > 1:
        events.collective("collectives.all_reduce (op {}, {} algorithm)", op, algorithm,
                          nbytes=tensor.numel() * tensor.element_size())
    if check and world > 1:
        _same_everywhere(tensor, group, "all_reduce")
    if world == 1:
        return Handle(tensor) if async_op else None

    def average() -> None:
        if op == "avg":
            tensor.div_(world)

    if algorithm == "native":
        flat = tensor if tensor.is_contiguous() else tensor.contiguous()
        work = dist.all_reduce(flat, op=_NATIVE_OPS[op], group=group, async_op=True)
        return _native(tensor, work, lambda: (_copy_back(flat, tensor), average()), async_op)
    members, me = list(range(world)), dist.get_rank(group)
    run = {
        "naive": lambda f: naive_all_reduce(f, members, me, op, group),
        "ring": lambda f: ring_all_reduce(f, members, me, op, group),
        "tree": lambda f: (tree_reduce(f, members, me, op, group), tree_broadcast(f, members, me, group)),
        "hierarchical": lambda f: hierarchical_all_reduce(f, members, me, op, group, _local_size(local_size)),
    }[algorithm]
    _in_place(tensor, run)
    average()
    return Handle(tensor) if async_op else None


@torch.no_grad()
def broadcast(tensor: torch.Tensor, src: int | None = None, algorithm: str = "native",
              group: dist.ProcessGroup | None = None, async_op: bool = False, *, group_src: int | None = None,
              check: bool = True) -> Handle | None:
    """Overwrite ``tensor`` with rank ``src``'s in place; ``tree`` or ``native``/``naive``.

    ``src`` is a global rank and ``group_src`` a rank within ``group``, as in ``torch.distributed.broadcast``
    (neither: the group's first rank). ``async_op``: return a :class:`Handle` instead of ``None``.
    """
    _check("sum", algorithm, tensor)
    group = _group(group)
    src = _root(group, src, group_src, "src")
    world = dist.get_world_size(group)
    if world > 1:
        events.collective("collectives.broadcast (from group rank {}, {} algorithm)", src, algorithm,
                          nbytes=tensor.numel() * tensor.element_size())
    if check and world > 1:
        _same_everywhere(tensor, group, "broadcast")
    if world == 1:
        return _done(tensor, async_op)
    if algorithm == "native":
        flat = tensor if tensor.is_contiguous() else tensor.contiguous()
        work = dist.broadcast(flat, src=dist.get_global_rank(group, src), group=group, async_op=True)
        return _native(tensor, work, lambda: _copy_back(flat, tensor), async_op)
    members = [src] + [r for r in range(world) if r != src]
    me = dist.get_rank(group)
    if algorithm == "naive":
        _in_place(tensor, lambda f: [exchange(f, m, None, 0, group) for m in members[1:]] if me == src
                  else exchange(None, 0, f, src, group))
    else:
        _in_place(tensor, lambda f: tree_broadcast(f, members, me, group))
    return _done(tensor, async_op)


@torch.no_grad()
def reduce(tensor: torch.Tensor, dst: int | None = None, op: str = "sum", algorithm: str = "native",
           group: dist.ProcessGroup | None = None, async_op: bool = False, *, group_dst: int | None = None,
           check: bool = True) -> Handle | None:
    """Reduce onto rank ``dst`` in place; the others' tensors are left as scratch.

    ``dst`` is a global rank and ``group_dst`` a rank within ``group``, as in ``torch.distributed.reduce``
    (neither: the group's first rank). ``async_op``: return a :class:`Handle` instead of ``None``.
    """
    op = _check(op, algorithm, tensor)
    group = _group(group)
    dst = _root(group, dst, group_dst, "dst")
    world = dist.get_world_size(group)
    if world > 1:
        events.collective("collectives.reduce (op {}, to group rank {}, {} algorithm)", op, dst, algorithm,
                          nbytes=tensor.numel() * tensor.element_size())
    if check and world > 1:
        _same_everywhere(tensor, group, "reduce")
    mine = dist.get_rank(group) == dst

    def average() -> None:
        if op == "avg" and mine:
            tensor.div_(world)

    if world > 1 and algorithm == "native":
        flat = tensor if tensor.is_contiguous() else tensor.contiguous()
        work = dist.reduce(flat, dst=dist.get_global_rank(group, dst), op=_NATIVE_OPS[op], group=group,
                           async_op=True)
        return _native(tensor, work, lambda: (_copy_back(flat, tensor), average()), async_op)
    if world > 1:
        members = [dst] + [r for r in range(world) if r != dst]
        _in_place(tensor, lambda f: tree_reduce(f, members, dist.get_rank(group), op, group))
    average()
    return _done(tensor, async_op)


@torch.no_grad()
def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, op: str = "sum", algorithm: str = "ring",
                   group: dist.ProcessGroup | None = None, async_op: bool = False, *,
                   check: bool = True) -> Handle | None:
    """``output`` gets this rank's part of the reduction of ``tensor`` (its ``tensor_split`` chunk).

    ``tensor`` (same on every rank) is consumed as scratch. ``ring`` is the
    point-to-point algorithm; ``native`` reduces all and keeps the chunk.
    ``async_op``: return a :class:`Handle` (of ``output``) instead of ``None``.
    """
    op = _check(op, algorithm, tensor)
    group = _group(group)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if world > 1:
        events.collective("collectives.reduce_scatter (op {}, {} algorithm)", op, algorithm,
                          nbytes=tensor.numel() * tensor.element_size())
    if check and world > 1:
        _same_everywhere(tensor, group, "reduce_scatter")
    flat = tensor.contiguous().view(-1)
    chunks = list(flat.tensor_split(world))
    if output.numel() != chunks[me].numel():
        raise ValueError(
            f"reduce_scatter: output has {output.numel()} elements, this rank's part of {flat.numel()} "
            f"over {world} ranks has {chunks[me].numel()}"
        )

    def finish() -> None:
        output.copy_(chunks[me].view(output.shape))
        if op == "avg":
            output.div_(world)

    if world > 1 and algorithm == "native":
        work = dist.all_reduce(flat, op=_NATIVE_OPS[op], group=group, async_op=True)
        return _native(output, work, finish, async_op)
    if world > 1:
        if algorithm == "ring":
            # The ring leaves member i owning chunk i + 1: shift the ring by one
            # so that each rank ends with its own chunk.
            members = [(r + 1) % world for r in range(world)]
            ring_reduce_scatter(chunks, members, me, op, group)
        else:
            all_reduce(flat, "sum" if op == "avg" else op, algorithm, group, check=False)
    finish()
    return _done(output, async_op)


@torch.no_grad()
def all_gather(output: torch.Tensor, tensor: torch.Tensor, algorithm: str = "ring",
               group: dist.ProcessGroup | None = None, async_op: bool = False, *,
               check: bool = True) -> Handle | None:
    """``output`` (``world`` times ``tensor``'s elements) gets every rank's ``tensor``, in rank order.

    ``async_op``: return a :class:`Handle` (of ``output``) instead of ``None``.
    """
    _check("sum", algorithm, tensor)
    group = _group(group)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if output.numel() != world * tensor.numel():
        raise ValueError(
            f"all_gather: output has {output.numel()} elements, {world} ranks x {tensor.numel()} are needed"
        )
    if world > 1:
        events.collective("collectives.all_gather ({} algorithm)", algorithm,
                          nbytes=tensor.numel() * tensor.element_size())
    if check and world > 1:
        _same_everywhere(tensor, group, "all_gather")
    flat = output.view(-1) if output.is_contiguous() else output.contiguous().view(-1)
    chunks = list(flat.chunk(world)) if tensor.numel() else [flat[:0]] * world
    chunks[me].copy_(tensor.reshape(-1))

    def finish() -> None:
        if flat.data_ptr() != output.data_ptr() or not output.is_contiguous():
            output.copy_(flat.view(output.shape))

    if world > 1 and algorithm == "native":
        work = dist.all_gather(chunks, tensor.contiguous().view(-1), group=group, async_op=True)
        return _native(output, work, finish, async_op)
    if world > 1:
        ring_all_gather(chunks, list(range(world)), me, group, owned=me)
    finish()
    return _done(output, async_op)

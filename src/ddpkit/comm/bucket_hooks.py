"""Comm hooks: what the reduction of one gradient bucket does.

A hook is ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``. It is
called once per bucket and iteration, in bucket order, as soon as the bucket's
gradients are ready; the future's value is the bucket's averaged flat tensor.
``state`` is whatever was passed to ``register_comm_hook``; for the hooks here
it is the process group to reduce over, or ``None`` for the world.

``bucket`` offers ``buffer()``, ``set_buffer()``, ``gradients()``,
``parameters()``, ``index()`` and ``is_last()`` (see
:class:`ddpkit.comm.bucket.GradBucket`), the same as torch's ``GradBucket``, so
hooks written for torch's DDP run here unchanged.

Example::

    model = ddpkit.DDP(net)
    model.register_comm_hook(None, ddpkit.hooks.fp16_compress_hook)
"""

# No ``from __future__ import annotations``: torch's DDP compares a hook's
# annotations with ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]``
# at ``register_comm_hook`` and refuses strings, so the public hooks carry
# those very objects (ddpkit's own bucket has the same methods) and run on
# torch's DDP as well as on ddpkit's.

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddpkit.comm.bucket import GradBucket
from ddpkit.comm.allreduce import ALGORITHMS, all_reduce
from ddpkit.runtime import events

__all__ = ["AllReduceState", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook", "noop_hook"]


@dataclass
class AllReduceState:
    """State for :func:`allreduce_hook` choosing the all-reduce algorithm.

    Example::

        model.register_comm_hook(ddpkit.hooks.AllReduceState(algorithm="ring"), ddpkit.hooks.allreduce_hook)
    """

    algorithm: str = "native"
    """One of :data:`ddpkit.collectives.ALGORITHMS`."""
    group: dist.ProcessGroup | None = None
    local_size: int | None = None
    """Ranks per node for ``hierarchical`` (default: the runtime's)."""

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={self.algorithm!r} is not known: choose one of {', '.join(ALGORITHMS)}")


def _group(state: dist.ProcessGroup | AllReduceState | None) -> dist.ProcessGroup:
    if isinstance(state, AllReduceState):
        state = state.group
    return state if state is not None else dist.group.WORLD


def average(group: dist.ProcessGroup, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Divide ``tensor`` by the group's size, then sum it over the group, in place (a future of it)."""
    tensor.div_(dist.get_world_size(group))
    events.collective("comm hook: all-reduce the bucket", nbytes=tensor.numel() * tensor.element_size())
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def allreduce_hook(
    state: dist.ProcessGroup | AllReduceState | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group, dividing each rank's part by the world size before the sum (torch's
    ``allreduce_hook``; DDP without a hook multiplies by ``1 / world`` instead, which rounds apart where the world
    size is not a power of two).

    ``state`` is a process group (or None: the world), or an
    :class:`AllReduceState` naming the algorithm. Divides before summing so
    low-precision buckets do not overflow.
    """
    group = _group(state)
    buffer = bucket.buffer()
    if isinstance(state, AllReduceState) and state.algorithm != "native":
        buffer.div_(dist.get_world_size(group))
        handle = all_reduce(buffer, "sum", state.algorithm, group, async_op=True, local_size=state.local_size,
                            check=False)
        return handle.get_future().then(lambda f: f.value()[0])
    return average(group, buffer)


def _compress_hook(
    dtype: torch.dtype, state: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    group = _group(state)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size(group))
    events.collective("comm hook: all-reduce the bucket in {}", str(dtype).removeprefix("torch."),
                      nbytes=compressed.numel() * compressed.element_size())
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        # Back into the bucket's own memory: no second full-precision buffer.
        buffer.copy_(f.value()[0])
        return buffer

    return fut.then(decompress)


def fp16_compress_hook(state: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average in float16: half the bytes on the wire, ~3 decimal digits kept.

    Warning:
        Gradients beyond float16's range (about 6.5e4) become inf.
    """
    return _compress_hook(torch.float16, state, bucket)


def bf16_compress_hook(state: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average in bfloat16: half the bytes, float32's range, ~2 decimal digits kept."""
    return _compress_hook(torch.bfloat16, state, bucket)


def noop_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce nothing: the bucket comes back as it went in (torch's ``debugging_hooks.noop_hook``).

    For measuring an engine's own cost: with this hook on both, ddpkit's DDP
    and torch's do all their bookkeeping and no communication, so a step-time
    difference is the engines' alone (``ddpkit bench`` uses it).

    Warning:
        The replicas' gradients are not averaged: they drift apart. Never train with it.
    """
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut

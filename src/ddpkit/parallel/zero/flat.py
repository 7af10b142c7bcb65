"""The two collectives of the ZeRO engines on flat buffers: all-gather the ranks' shards, reduce-scatter a sum.

NCCL's own; on gloo, direct messages (:mod:`ddpkit.comm.direct`: gloo's all-gather and reduce-scatter are slow
on the CPU), through the CPU for CUDA tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddpkit.comm.direct import direct_all_gather, direct_reduce_scatter
from ddpkit.runtime.compat import all_gather_tensor, reduce_scatter_tensor
from ddpkit.runtime.devices import comm_device

__all__ = ["Done", "all_gather_flat", "reduce_scatter_flat"]


class Done:
    """A finished collective, for a caller that waits on what it was given (or on its future)."""

    def wait(self) -> bool:
        return True

    @staticmethod
    def get_future() -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future


def _staged(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether ``tensor`` goes through the CPU for ``group``: gloo with CUDA tensors (its CUDA paths are not
    every collective's, and ddpkit's stage 2 met "Bad address" there)."""
    return tensor.is_cuda and dist.get_backend(group) == "gloo"


def all_gather_flat(out: torch.Tensor, src: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> Any:
    """``out`` (flat, ``W`` times ``src``) made of every rank's ``src`` in rank order; a work to wait on when
    ``async_op``."""
    if _staged(src, group):
        staged = torch.empty(out.shape, dtype=out.dtype, device=comm_device(group))  # gloo's: the CPU
        direct_all_gather(staged, src.to(comm_device(group)), group).wait()
        out.copy_(staged)
        return Done() if async_op else None
    if dist.get_backend(group) == "gloo":
        work = direct_all_gather(out, src, group)
    else:
        work = all_gather_tensor(out, src, group=group, async_op=True)
    if async_op:
        return work
    work.wait()
    return None


def reduce_scatter_flat(out: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup) -> Any:
    """Start summing ``flat`` over the ranks into ``out``, this rank's chunk of the sum; a work to wait on."""
    if _staged(flat, group):
        staged = torch.empty(out.shape, dtype=out.dtype, device=comm_device(group))
        direct_reduce_scatter(staged, flat.to(comm_device(group)), group).wait()
        out.copy_(staged)
        return Done()
    if dist.get_backend(group) == "gloo":
        return direct_reduce_scatter(out, flat, group)
    return reduce_scatter_tensor(out, flat, group=group, async_op=True)

"""Where a collective takes its tensors: the one rule for every tensor the package makes for one.

NCCL moves CUDA tensors only (a CPU tensor fails with "No backend type
associated with device type cpu"); gloo and MPI move CPU tensors (gloo also
CUDA ones, through the CPU). So a scalar, a flag or a metric the package
reduces, gathers or broadcasts is made on :func:`comm_device` of its group,
never with ``torch.tensor(...)`` alone: on the CPU-only machines that write
and test most of this code both spellings work, and only a GPU job tells
them apart. ``tests/test_device_discipline.py`` reads the package for
tensors handed to a collective without it.

Example::

    totals = comm_tensor([loss_sum, correct, n], torch.float64)
    dist.all_reduce(totals)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["comm_device", "comm_tensor"]


def comm_device(group: dist.ProcessGroup | None = None, like: torch.Tensor | None = None) -> torch.device:
    """The device a collective of ``group`` (default: the world) takes its tensors on.

    The current CUDA device under NCCL (``like``'s, when ``like`` is a CUDA
    tensor: the device the rest of that collective's data lives on), else
    the CPU, also with no process group at all.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    if like is not None and like.is_cuda:
        return like.device
    return torch.device("cuda", torch.cuda.current_device())


def comm_tensor(data: float | Sequence | torch.Tensor, dtype: torch.dtype | None = None,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on :func:`comm_device` of ``group``, ready for its collectives."""
    if isinstance(data, torch.Tensor):
        return data.detach().to(device=comm_device(group, like=data), dtype=dtype or data.dtype, copy=True)
    return torch.tensor(data, dtype=dtype, device=comm_device(group))

"""Where ZeRO stage 3's shards live: each parameter of a unit as this rank's rows of it, held as a ``DTensor``.

The layout (which rows a rank holds, where they lie in the unit's part) is :mod:`ddpkit.parallel.zero.units`'s;
this module places them. The model's parameter becomes a ``DTensor`` (``Shard(0)``; ``Replicate()`` for a
parameter with no dimension) on the one-dimensional device mesh of the engine's group, whose local tensor is a
view of the unit's part buffer (:func:`home`), so it keeps its true shape and ``dim()`` for the code that reads
them (initialisers, "decay what has ``dim() >= 2``") and torch's own tools (``clip_grad_norm_``, ``GradScaler``)
see the whole model. Without a process group (a world of one) the parameters stay plain tensors. A parameter
replaced after wrapping (``load_state_dict(assign=True)``, ``to_empty``) has memory of its own, which
:func:`in_part` notices.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.parallel.zero.units import Unit, UnitParam

__all__ = ["SHARD_MARK", "home", "in_part", "like_param", "local_of", "make_mesh", "shard_tensor", "shard_whole"]

SHARD_MARK = "_ddpkit_zero3_shard"
"""The attribute set on the parameters this engine makes (a module wrapped twice is refused by it)."""

def local_of(param: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of a stage-3 parameter (a DTensor's local rows; a plain tensor itself)."""
    to_local = getattr(param, "to_local", None)
    if to_local is None:
        return param
    with torch.no_grad():
        return to_local()


def like_param(local: torch.Tensor, q: UnitParam, mesh: Any) -> torch.Tensor:
    """``local`` (this rank's rows of a tensor shaped as ``q``) laid out as parameter ``q`` is: a DTensor of its
    placement (``q`` itself without a mesh)."""
    if mesh is None:
        return local.view(q.shape)
    from torch.distributed.tensor import DTensor

    p = q.param
    return DTensor.from_local(local, mesh, p.placements, run_check=False, shape=q.shape, stride=p.stride())


def make_mesh(group: dist.ProcessGroup | None, device_type: str) -> Any:
    """The one-dimensional device mesh of ``group`` the DTensor parameters live on (``None`` without a group)."""
    if group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type)


def shard_tensor(whole: torch.Tensor, q: UnitParam, mesh: Any, rank: int) -> torch.Tensor:
    """This rank's rows of ``whole`` (shaped as ``q``; copied, so that ``whole`` may go), held as the model's
    parameter ``q`` is held: a DTensor (a plain tensor without a mesh)."""
    if mesh is None:
        return whole.detach()
    with torch.no_grad():
        if q.replicated:
            local = whole.detach().clone()
        else:
            a, b = q.local_rows(rank)
            local = whole.detach()[a:b].clone()
        return _dtensor(local, q, mesh)


@torch.no_grad()
def home(u: Unit, wholes: list[torch.Tensor], mesh: Any, rank: int) -> None:
    """Make the unit's parameters of ``wholes`` (one whole tensor per parameter, in order): this rank's rows of
    each, copied into a new part buffer, the parameters views of it, registered in every module that uses them."""
    first = wholes[0]
    u.dtype, u.device = first.dtype, first.device
    u.part = torch.zeros(u.part_numel, dtype=first.dtype, device=first.device)
    for q, whole in zip(u.params, wholes):
        shape = q.local_shape(rank)
        local = u.part[q.offset: q.offset + shape.numel()].view(shape)
        if q.replicated:
            local.copy_(whole.detach())
        else:
            a, b = q.local_rows(rank)
            local.copy_(whole.detach()[a:b])
        param = nn.Parameter(local if mesh is None else _dtensor(local, q, mesh), requires_grad=whole.requires_grad)
        setattr(param, SHARD_MARK, True)
        for m, attr in q.owners:
            m._parameters[attr] = param
    u.homed = []


def in_part(u: Unit, rank: int) -> bool:
    """Whether every parameter's local tensor is still its view of :attr:`Unit.part` (nothing replaced it)."""
    if u.part is None:
        return False
    current = [q.param for q in u.params]
    if len(current) == len(u.homed) and all(a is b for a, b in zip(current, u.homed)):
        return True  # the objects :func:`home` made (a DTensor's local tensor cannot be swapped under it)
    base, size = u.part.data_ptr(), u.part.element_size()
    for q, p in zip(u.params, current):
        local = local_of(p)
        if local.dtype != u.part.dtype or local.device != u.part.device or (
                local.numel() and local.data_ptr() != base + q.offset * size):
            u.part = None  # a parameter has memory of its own now: copy every time, keep no second copy
            u.homed = []
            return False
    u.homed = current
    return True


def _dtensor(local: torch.Tensor, q: UnitParam, mesh: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    stride = torch.empty(q.shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Replicate() if q.replicated else Shard(0)], run_check=False,
                              shape=q.shape, stride=stride)


def shard_whole(whole: torch.Tensor, q: UnitParam, mesh: Any, rank: int, requires_grad: bool) -> nn.Parameter:
    """The parameter ``q`` made of ``whole``: :func:`shard_tensor` as an ``nn.Parameter``, marked as a shard."""
    param = nn.Parameter(shard_tensor(whole, q, mesh, rank), requires_grad=requires_grad)
    setattr(param, SHARD_MARK, True)
    return param

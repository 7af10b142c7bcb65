"""The norm of gradients whose pieces are spread over the ranks, and torch's clipping by it (ZeRO stage 2's
gradient shards; stage 3's parameters are DTensors, whose norm torch's own ``clip_grad_norm_`` takes)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from ddpkit.runtime.devices import comm_tensor

__all__ = ["clip_grad_norm", "grad_norm"]


def grad_norm(grads: Iterable[torch.Tensor], norm_type: float, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The ``norm_type``-norm of the gradients whose pieces ``grads`` are spread over the ranks of ``group``.

    Each rank passes its own pieces (disjoint across ranks); the result is the
    norm of their union, the same on every rank (a collective).
    """
    grads = [g for g in grads if g is not None and g.numel()]
    inf = math.isinf(norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    if inf:
        local = max((g.detach().abs().max().float() for g in grads), default=torch.zeros((), device=device))
    else:
        local = sum((g.detach().float().norm(norm_type) ** norm_type for g in grads),
                    torch.zeros((), device=device))
    if group is not None and dist.get_world_size(group) > 1:
        total = comm_tensor([float(local)], torch.float64, group)
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        local = total[0].to(device=device, dtype=torch.float32)
    return local if inf else local ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm(grads: list[torch.Tensor], max_norm: float, norm_type: float,
                   group: dist.ProcessGroup | None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over gradients whose pieces are spread over ``group``'s ranks.

    Each rank passes its own pieces (disjoint across ranks); the norm is the whole model's (a collective: call
    it on every rank), and every piece is scaled by torch's rule, ``max_norm / (norm + 1e-6)`` when that is
    below 1. Returns the norm.
    """
    norm = grad_norm(grads, float(norm_type), group)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return norm

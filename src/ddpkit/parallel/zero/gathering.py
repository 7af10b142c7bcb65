"""A stage-3 unit's parameters whole for a while: all-gathered from the shards, shown to its modules, freed.

The unit's gathered buffer (``Unit.full``) keeps its tensor for the engine's
life and only its storage comes and goes (``resize_``), so the views
autograd saved in the forward read the buffer again once the backward has
gathered it anew. The modules see the parameters through instance attributes
(views of the buffer) that shadow the registered parameters, which stay the
1-D views of this rank's shard the optimizer steps on; unbound, the modules
see those again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ddpkit.parallel.zero.units import Unit, all_gather_flat
from ddpkit.runtime import events

__all__ = ["Gathering"]


class Gathering:
    """Gathers, binds and frees the units of one engine.

    Args:
        group: the engine's process group (``None``: a world of one).
        world_size: its size.
        owner: who drives the engine, as the stall inspector names it.
        on_grad: called as ``on_grad(unit, i, leaf)`` once autograd has accumulated the gradient of the unit's
            ``i``-th parameter into a counted leaf (see :meth:`bind`).
    """

    def __init__(self, group: dist.ProcessGroup | None, world_size: int, owner: str,
                 on_grad: Callable[[Unit, int, torch.Tensor], None]) -> None:
        self.group, self.world_size, self.owner, self.on_grad = group, world_size, owner, on_grad

    def gather(self, u: Unit, wait: bool) -> None:
        """Start the unit's all-gather unless it is gathered (or on its way); with ``wait``, wait for it."""
        if not u.gathered:
            u.full.untyped_storage().resize_(u.nbytes)
            out = u.full.data  # a new version counter: autograd's saved views of the buffer stay valid
            src = u.shard if u.shard.dtype == out.dtype else u.shard.to(out.dtype)
            if self.world_size == 1:
                out.copy_(src)
            else:
                events.collective("{} zero-3 unit {} all-gather of the parameters", self.owner, u.index,
                                  nbytes=src.numel() * src.element_size())
                u.work = all_gather_flat(out, src, self.group, async_op=True)
            u.gathered = True
        if wait and u.work is not None:
            u.work.wait()
            u.work = None

    @staticmethod
    def free(u: Unit) -> None:
        """Give the gathered buffer's memory back (after its all-gather, if one is in flight)."""
        if u.work is not None:
            u.work.wait()
            u.work = None
        u.full.untyped_storage().resize_(0)
        u.gathered = False

    def bind(self, u: Unit, counted: bool = True) -> None:
        """Let the unit's modules see its parameters as views of the gathered buffer. With grad enabled each view
        is a leaf; ``counted``: one whose gradient goes to ``on_grad`` (else a recomputation's, whose graph no
        gradient goes through, but which must save what the first forward saved)."""
        sizes = [q.numel for q in u.params]
        pad = u.full.numel() - sum(sizes)
        pieces = u.full.split(sizes + [pad] if pad else sizes)
        grad = torch.is_grad_enabled() and u.requires_grad
        if grad and counted and not u.grads:
            u.grads = [None] * len(u.params)
        for i, (q, piece) in enumerate(zip(u.params, pieces)):
            view = piece.view(q.shape)
            trained = grad and q.param.requires_grad  # a frozen parameter's view gets no gradient, as itself
            if trained:
                view.requires_grad_(True)
            if trained and counted:
                view.register_post_accumulate_grad_hook(lambda t, u=u, i=i: self.on_grad(u, i, t))
                u.expected += 1
            for m, attr in q.owners:
                m.__dict__[attr] = view

    @staticmethod
    def unbind(u: Unit) -> None:
        """Let the unit's modules see the registered parameters (the shard views) again."""
        for q in u.params:
            for m, attr in q.owners:
                m.__dict__.pop(attr, None)

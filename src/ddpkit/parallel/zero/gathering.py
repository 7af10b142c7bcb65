"""A stage-3 unit's parameters whole for a while: all-gathered from the ranks' shards, shown to its modules, freed.

The gathered buffer (``Unit.full``) keeps its tensor for the engine's life and
only its storage comes and goes (``resize_``). Each parameter's whole tensor
is a view of it made once, the *leaf* autograd computes with and accumulates
the gradient into, whichever forward, backward or recomputation uses it: so
a gradient from several forwards, or from a second backward, adds up in one
place as a plain module's does, and the views autograd saved in a forward read
the buffer again once the backward has gathered it anew. The modules see the
leaves through instance attributes that shadow their registered parameters
(the shards the optimizer steps on); unbound, they see the shards again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from ddpkit.parallel.zero.flat import all_gather_flat
from ddpkit.parallel.zero.placement import in_part, local_of
from ddpkit.parallel.zero.units import Residency, Unit
from ddpkit.runtime import events

__all__ = ["Gathering", "pack_part"]


@torch.no_grad()
def pack_part(u: Unit, rank: int, dtype: torch.dtype, tensors: list[torch.Tensor] | None = None) -> torch.Tensor:
    """This rank's part of the unit (see :mod:`ddpkit.parallel.zero.units`) in ``dtype``: its local rows of
    each parameter (or of ``tensors``, one per parameter, shaped as the locals), padded with zeros. The
    parameters' own part buffer itself when they live in it (no copy)."""
    if tensors is None and in_part(u, rank):
        return u.part if u.part.dtype == dtype else u.part.to(dtype)
    pieces: list[torch.Tensor] = []
    for i, q in sorted(enumerate(u.params), key=lambda iq: iq[1].offset):
        local = local_of(q.param) if tensors is None else tensors[i]
        flat = local.reshape(-1).to(dtype)
        pieces.append(flat)
        if flat.numel() < q.piece:
            pieces.append(flat.new_zeros(q.piece - flat.numel()))
    if u.part_numel > sum(q.piece for q in u.params):
        pieces.append(pieces[0].new_zeros(u.part_numel - sum(q.piece for q in u.params)))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()


def _hook(gathering: Gathering, unit: int, i: int) -> Callable[[torch.Tensor], None]:
    """A leaf's gradient hook. It holds nothing that leads back to the leaf (the engine weakly, the unit by its
    index): autograd keeps a tensor's hooks from C++, where Python's collector cannot see a cycle leaf -> hook
    -> unit -> leaf, and a dropped model would live on."""
    ref = weakref.ref(gathering)

    def hook(leaf: torch.Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner.on_grad(unit, i)

    return hook


class Gathering:
    """Gathers, binds and frees the units of one engine.

    Args:
        group: the engine's process group (``None``: a world of one).
        world_size: its size.
        rank: this rank in it.
        owner: who drives the engine, as the stall inspector names it.
        on_grad: called as ``on_grad(unit index, i)`` once autograd has accumulated a gradient into the unit's
            ``i``-th leaf.
    """

    def __init__(self, group: dist.ProcessGroup | None, world_size: int, rank: int, owner: str,
                 on_grad: Callable[[int, int], None]) -> None:
        self.group, self.world_size, self.rank, self.owner, self.on_grad = group, world_size, rank, owner, on_grad

    def gather(self, u: Unit, wait: bool) -> None:
        """Start the unit's all-gathers unless it is gathered (or on its way); with ``wait``, wait for them."""
        if u.residency is Residency.FREED:
            u.full.untyped_storage().resize_(u.nbytes)
            full = u.full.data  # a new version counter: the views autograd saved stay valid
            if self.world_size == 1:
                with torch.no_grad():
                    for q in u.params:
                        u.whole_view(q, full).copy_(local_of(q.param).reshape(q.shape))
                u.become(Residency.GATHERED)
            else:
                part = pack_part(u, self.rank, full.dtype)
                events.collective("{} zero-3 unit {} all-gather of the parameters", self.owner, u.index,
                                  nbytes=part.numel() * part.element_size())
                w, works = self.world_size, []
                if u.small:  # the small parameters together, laid out whole from a staging buffer when it lands
                    u.staged = full.new_empty(w * u.small)
                    works.append(all_gather_flat(u.staged, part[: u.small], self.group, async_op=True))
                for q in u.params:
                    if q.separate:  # the ranks' rows in rank order are the parameter: it lands in its place
                        works.append(all_gather_flat(full[w * q.offset: w * (q.offset + q.piece)],
                                                     part[q.offset: q.offset + q.piece], self.group, async_op=True))
                u.work = works
                u.become(Residency.GATHERING)
        if wait and u.residency is Residency.GATHERING:
            self._land(u)

    def _land(self, u: Unit) -> None:
        """Wait for the unit's all-gathers and lay its small parameters out whole (each contiguous)."""
        for work in u.work:
            work.wait()
        if u.staged is not None:
            staged, u.staged = u.staged, None
            full = u.full.data
            w = self.world_size
            small = [q for _, q in u.small_params]
            with torch.no_grad():
                torch.split_with_sizes_copy(staged.view(w, u.small), [q.piece for q in small], dim=1,
                                            out=[full[w * q.offset: w * (q.offset + q.piece)].view(w, q.piece)
                                                 for q in small])
        u.work = None
        u.become(Residency.GATHERED)

    def free(self, u: Unit) -> None:
        """Give the gathered buffer's memory back (after its all-gather, if one is in flight), and show the
        modules their shards."""
        if u.residency is Residency.GATHERING:
            for work in u.work:
                work.wait()
            u.work, u.staged = None, None
        self.unbind(u)
        u.full.untyped_storage().resize_(0)
        u.become(Residency.FREED)

    def bind(self, u: Unit) -> None:
        """Let the unit's modules compute with its leaves (made the first time; their ``requires_grad`` follows
        each parameter's now)."""
        for i, q in enumerate(u.params):
            if q.leaf is None:
                q.leaf = u.whole_view(q)
            trained = q.param.requires_grad
            if q.leaf.requires_grad != trained:
                q.leaf.requires_grad_(trained)
                if trained and i not in u.hooked:  # a hook needs a tensor that requires grad
                    q.leaf.register_post_accumulate_grad_hook(_hook(self, u.index, i))
                    u.hooked.add(i)
            for m, attr in q.owners:
                m.__dict__[attr] = q.leaf

    @staticmethod
    def unbind(u: Unit) -> None:
        """Let the unit's modules see the registered parameters (the shards) again."""
        for q in u.params:
            for m, attr in q.owners:
                m.__dict__.pop(attr, None)

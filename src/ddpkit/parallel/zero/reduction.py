"""ZeRO stage 3's reductions: a unit's gradients averaged over the ranks, and each rank's rows of the average
delivered to its parameters' ``.grad``.

The small parameters of a unit go out in one reduce-scatter (their gradients
laid out rank by rank in one flat input), each large one
(:data:`ddpkit.parallel.zero.units.SEPARATE_BYTES`) in its own, read from
its gradient as it is. Averaged by pre-scaling, as DDP's gradients are; in
flight while backward goes on; waited for (their inputs let go) when the next
unit goes out, so that at most one unit's gradient is whole at a time; at the
end of backward each parameter's ``.grad`` gets this rank's rows of the
average (a DTensor laid out as the parameter), added to what it held.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddpkit.parallel.common.observer import Observers
from ddpkit.parallel.zero.flat import reduce_scatter_flat
from ddpkit.parallel.zero.placement import like_param, local_of
from ddpkit.parallel.zero.units import Launched, Unit
from ddpkit.runtime import events
from ddpkit.runtime.devices import comm_tensor

__all__ = ["Reductions"]


class Reductions:
    """The reductions of one engine's units.

    Args:
        group: the engine's process group (``None``: a world of one).
        world_size, rank: the group's size and this rank in it.
        owner: who drives the engine, as the stall inspector names it.
        reduce_dtype: the dtype gradients are averaged in (``None``: the gathered units').
        observers: the engine's observers (each unit's reduction is a bucket's).
        mesh: the device mesh the parameters (and so their gradients) are DTensors of (``None``: plain).
    """

    def __init__(self, group: dist.ProcessGroup | None, world_size: int, rank: int, owner: str,
                 reduce_dtype: torch.dtype | None, observers: Observers, mesh: Any) -> None:
        self.group, self.world_size, self.rank, self.owner, self.mesh = group, world_size, rank, owner, mesh
        self.reduce_dtype = reduce_dtype
        self.observers = observers
        self.units: list[Unit] = []
        """The engine's units (the reductions before one that goes out are waited for)."""

    @torch.no_grad()
    def launch(self, u: Unit, div_factor: int | None, step: int) -> None:
        """Average the unit's gradients over the ranks, asynchronously (zeros for a parameter without one): the
        small parameters in one reduce-scatter, each large one in its own, read from its gradient as it is."""
        dtype = self.reduce_dtype or u.full.dtype
        w = self.world_size
        scale = None if div_factor in (None, 1) else 1.0 / div_factor
        grads, had = [], []
        for q in u.params:
            grad = q.leaf.grad if q.leaf is not None else None
            if q.accumulated is not None:  # the backwards before that did not reduce, in the reduce dtype
                if grad is not None:
                    q.accumulated.add_(grad)
                grad, q.accumulated = q.accumulated, None
            if not q.param.requires_grad:
                grad = None
            had.append(grad is not None)
            if q.leaf is not None:
                q.leaf.grad = None  # the engine's now: scaled in place, reduced, let go
            grads.append(grad)
        u.arrived.clear()  # a unit reduced twice in one backward (reentrant checkpointing) counts afresh
        u.no_sync_sums = False
        # The reductions before this one have had a unit's backward to finish: their inputs go now, so that at most
        # one unit's gradient is whole at a time (as FSDP2 waits for the last reduce-scatter).
        for before in self.units:
            self.wait(before)
        inputs: list[tuple[list[int], torch.Tensor]] = []  # (the parameters it carries, the flat input)
        small = [i for i, _ in u.small_params]
        if small:
            inputs.append((small, self._small_input(u, small, grads, dtype)))
        for i, q in enumerate(u.params):
            if q.separate:
                flat = grads[i].reshape(-1) if grads[i] is not None else None
                if flat is None:
                    flat = torch.zeros(w * q.piece, dtype=dtype, device=u.full.device)
                elif flat.dtype != dtype or flat.numel() < w * q.piece:
                    flat = torch.cat([flat.to(dtype), flat.new_zeros(w * q.piece - flat.numel(), dtype=dtype)])
                inputs.append(([i], flat))
        del grads
        nbytes = sum(flat.numel() * flat.element_size() for _, flat in inputs)
        if self.observers.ready:
            self.observers.bucket_ready(u.index, nbytes, step)
        if w > 1:
            events.collective("{} zero-3 unit {} reduce-scatter", self.owner, u.index, step=step, nbytes=nbytes)
        outs: list[torch.Tensor | None] = [None] * len(u.params)
        works = []
        for members, flat in inputs:
            if scale is not None:
                flat.mul_(scale)  # DDP's averaging by pre-scaling: the same products
            out = flat if w == 1 else flat.new_empty(flat.numel() // w)
            if w > 1:
                works.append(reduce_scatter_flat(out, flat, self.group))
            base = u.params[members[0]].offset
            for i in members:
                q = u.params[i]
                outs[i] = out[q.offset - base: q.offset - base + q.piece]
        u.pending.append((outs, works, had))
        if self.observers.launch or self.observers.done:
            # The unit stands for a bucket: its index, and the reductions the done event waits for.
            future = torch.futures.collect_all([work.get_future() for work in works]) if works else None
            self.observers.launched(Launched(u.index, None, future), nbytes, step)

    @staticmethod
    def _small_input(u: Unit, small: list[int], grads: list[torch.Tensor | None], dtype: torch.dtype,
                     ) -> torch.Tensor:
        """The small parameters' gradients as one flat input: each rank's rows of each, in rank order."""
        w = u.full.numel() // u.part_numel
        pieces = []
        for i in small:
            q, grad = u.params[i], grads[i]
            if grad is None:
                pieces.append(torch.zeros((), dtype=dtype, device=u.full.device).expand(w, q.piece))
            elif q.replicated:  # every rank's part holds it: each gets the sum
                pieces.append(grad.reshape(1, 1).to(dtype).expand(w, 1))
            else:
                flat = grad.reshape(-1).to(dtype)
                if flat.numel() < w * q.piece:
                    flat = torch.cat([flat, flat.new_zeros(w * q.piece - flat.numel())])
                pieces.append(flat.view(w, q.piece))
        flat = torch.empty(w * u.small, dtype=dtype, device=u.full.device)
        torch.cat(pieces, dim=1, out=flat.view(w, u.small))
        return flat

    @staticmethod
    def wait(u: Unit) -> None:
        for outs, works, _ in u.pending:
            for work in works:
                work.wait()
            works.clear()

    def used_everywhere(self, units: list[Unit], step: int) -> dict[int, bool]:
        """Which trained parameters some rank has a gradient for (a collective: one all-reduce), by id of the
        :class:`UnitParam`."""
        entries = [(u, i, q) for u in units for i, q in enumerate(u.params) if q.param.requires_grad]
        mine = [float(any(had[i] for _, _, had in u.pending)) for u, i, _ in entries]
        flags = comm_tensor(mine, torch.float32, self.group)
        if self.world_size > 1 and flags.numel():
            events.collective("{} zero-3 all-reduce of the used-parameter map", self.owner, step=step,
                              nbytes=flags.numel() * 4)
            dist.all_reduce(flags, group=self.group)
        return {id(q): bool(f) for (_, _, q), f in zip(entries, flags.tolist())}

    @torch.no_grad()
    def deliver(self, u: Unit, used: dict[int, bool] | None) -> None:
        """Add this rank's rows of the unit's averaged gradients into its parameters' ``.grad``."""
        self.wait(u)
        for outs, _, _ in u.pending:
            for q, out in zip(u.params, outs):
                p = q.param
                if not p.requires_grad or (used is not None and not used.get(id(q), False)):
                    continue  # frozen, or used by no rank: its .grad stays as it is, as under DDP
                shape = q.local_shape(self.rank)
                grad = out[: shape.numel()].view(shape)
                if grad.dtype != p.dtype:
                    grad = grad.to(p.dtype)
                if p.grad is None:
                    p.grad = like_param(grad, q, self.mesh)
                else:
                    local_of(p.grad).add_(grad)
        u.pending = []

"""DDP's side of ``Join`` (:mod:`ddpkit.parallel.common.join_context`): training on uneven inputs with
:meth:`DistributedDataParallel.join`.

Each step the ranks still training take, a joined rank learns whether it
synchronises gradients and whether its forward has grad enabled (it may
rebuild the buckets), takes part in the buffer broadcast, and runs
:func:`shadow_backward`: the same collectives, in the same order, as a
training rank's backward, with zeros, leaving its own gradients alone. When
all have joined, every rank takes the parameters (and synced buffers) of the
last rank to finish (the highest, on a tie).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddpkit.parallel.common.broadcast import broadcast_once
from ddpkit.parallel.common.buckets import sparse_zeros
from ddpkit.parallel.common.join_context import DISABLED, Join, JoinConfig
from ddpkit.parallel.common.unused import all_reduce_used_map
from ddpkit.runtime import events
from ddpkit.runtime.devices import comm_device

__all__ = ["DDPJoinHook", "DDPJoinable", "shadow_backward"]


def shadow_backward(reducer: Any) -> None:
    """A joined rank's side of a synchronised backward that the other ranks run.

    Issues the same collectives in the same order as the reducer of a rank
    that trains (its buckets, then the used-parameter map where one is
    searched for), contributing zeros (``Join``'s contract), and leaves this
    rank's gradients alone. ``reducer``: a :class:`ddpkit.parallel.common.reducer.Reducer`.
    """
    reducer.begin_shadow()
    for bucket in reducer.buckets:
        zeros = sparse_zeros(bucket.params[0]) if bucket.sparse else torch.zeros_like(bucket.flat)
        bucket.target = zeros
        bucket.set_buffer(zeros)
        reducer.launch(bucket)
    if reducer.searches_unused() and reducer.world_size > 1:
        # torch's joined rank sends the used-map of its own last backward.
        flags = reducer.last_used_flags
        if flags is None:
            flags = torch.zeros(len(reducer.params), dtype=torch.int32,
                                device=comm_device(reducer.group, like=reducer.params[0]))
        all_reduce_used_map(flags, reducer.group, reducer.step)
    reducer.end_shadow()


class DDPJoinHook:
    """DDP's side of ``Join``: shadow the others' steps, then agree on one model (see the module notes).

    ``ddp``: a :class:`ddpkit.DistributedDataParallel`.
    """

    def __init__(self, ddp: Any) -> None:
        self.ddp = ddp
        ddp._logging.uneven_input_join()  # torch's logging data records that join() was used

    def main_hook(self) -> None:
        """One step of the ranks still training: the same collectives as their forward and backward."""
        ddp = self.ddp
        flags = torch.zeros(2, device=ddp.join_device)
        events.collective("DDP join: does this step reduce gradients", nbytes=flags.numel() * flags.element_size())
        dist.all_reduce(flags, group=ddp.process_group)
        should_sync, grad = (bool(f) for f in flags.tolist())
        if ddp.will_sync_module_buffers():
            ddp.sync_module_buffers(ddp.join_source_rank(False))
        if grad:
            ddp.reducer.rebuild_if_due()
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            shadow_backward(ddp.reducer)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the last rank to finish (the highest, on a tie)."""
        ddp = self.ddp
        src = ddp.join_source_rank(is_last_joiner)
        tensors = [p.detach() for n, p in ddp.module.named_parameters() if n not in ddp.parameters_to_ignore]
        if ddp.forward_sync_buffers:
            tensors += ddp.modules_buffers
        broadcast_once(tensors, ddp.process_group, "join: the last joiner's model", src)


class DDPJoinable:
    """DDP's side of the join protocol (see the module notes); a part of :class:`ddpkit.DistributedDataParallel`.

    Reads the wrapper's ``module``, ``process_group``, ``world_size`` and ``reducer``.
    """

    module: Any
    process_group: Any
    world_size: int
    zero_stage: int
    skip_all_reduce_unused_params: bool
    reducer: Any

    def _init_join(self) -> None:
        self._join_config: JoinConfig = DISABLED
        self._divide_by_initial_world_size = True

    def _join_step(self, sync: bool, grad: bool) -> int:
        """At the start of a forward under ``join()``: say this rank still trains, tell the joined ranks what
        this step does; returns what gradients are averaged over."""
        div_factor = self.world_size
        notified = Join.notify_join_context(self)
        if notified is not None and not self._divide_by_initial_world_size:
            work, still_training = notified
            work.wait()
            div_factor = int(still_training.item())
        outside = getattr(self.reducer, "outside", [])  # waited for before a sparse reduction (stage 0's reducer)
        outside[:] = [work for work in outside if not work.is_completed()]  # forwards without backward add up
        if notified is not None and self._divide_by_initial_world_size:
            outside.append(notified[0])
        # Whether this step reduces gradients, and whether its forward has grad enabled (it may rebuild buckets).
        flags = torch.tensor([float(sync), float(grad)], device=self.join_device)
        events.collective("DDP join: does this step reduce gradients", nbytes=flags.numel() * flags.element_size())
        outside.append(dist.all_reduce(flags, group=self.process_group, async_op=True))
        return div_factor

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """Context manager for ranks with different numbers of batches.

        A rank that leaves the block early takes part, with zero gradients,
        in the collectives of every step the others still run, so nothing
        hangs; when all have left, every rank takes the parameters (and
        buffers, with ``broadcast_buffers``) of the last rank to finish, so the
        replicas end identical.

        Args:
            divide_by_initial_world_size: average over the full world size
                (default: a joined rank counts as a zero gradient); ``False``
                averages over the ranks still training.
            enable: ``False`` for inputs known to be even (no extra cost).
            throw_on_early_termination: raise ``RuntimeError`` on every rank
                as soon as one runs out of inputs, instead.

        Example::

            with model.join():
                for x, y in loader:            # a different length on each rank
                    loss_fn(model(x), y).backward()
                    opt.step(); opt.zero_grad()
        """
        if enable and self.zero_stage:
            raise RuntimeError(f"join() is not supported with zero_stage={self.zero_stage}: give every rank the "
                               "same number of batches (DistributedSampler(drop_last=True)), or use zero_stage=0")
        if enable and self.skip_all_reduce_unused_params:
            raise RuntimeError("join() with skip_all_reduce_unused_params=True: a joined rank cannot tell which "
                               "buckets the others leave unreduced, so their collectives would stop matching; drop "
                               "one of them")
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, divide_by_initial_world_size: bool = True, **kwargs: Any) -> DDPJoinHook:
        """The hook a ``Join`` context runs on this rank once it has joined."""
        # Other keywords belong to the other joinables of the same Join (torch's Join passes them to all).
        del kwargs
        self._divide_by_initial_world_size = divide_by_initial_world_size
        return DDPJoinHook(self)

    @property
    def joining(self) -> bool:
        """Whether a :meth:`join` has enabled the join's collective at each forward: from the first ``join()`` on,
        the block's end included (torch's DDP keeps its ``_join_config`` too)."""
        return self._join_config.enable

    @property
    def join_device(self) -> torch.device:
        """Where the join context's bookkeeping tensors live (the module's device)."""
        return next(self.module.parameters()).device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def join_source_rank(self, candidate: bool) -> int:
        """Under ``join()``: the highest group rank among those where ``candidate`` holds (a collective)."""
        rank = dist.get_rank(self.process_group)
        t = torch.tensor([rank if candidate else -1], device=self.join_device)
        events.collective("DDP join: choose the source rank", nbytes=t.numel() * t.element_size())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        if t.item() < 0:
            raise RuntimeError("join: no rank qualifies as the source of the model (internal error)")
        return int(t.item())

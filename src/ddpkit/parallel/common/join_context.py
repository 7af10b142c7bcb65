"""``Join``: training on uneven inputs, the context any joinable takes part in (DDP's, ZeRO's optimizer).

Each rank trains on its own shard; when the shards differ in length, a rank
that runs out of batches leaves its training loop while the others still
issue collectives every step. Inside ``with model.join():`` that rank, on
leaving the block, *shadows* the others: once per step they still take, it
runs each joinable's ``main_hook`` (DDP: the same collectives, with zeros),
until every rank has left; then each joinable's ``post_hook`` runs on every
rank (DDP: every rank takes the model of the last rank to finish).

The protocol is the one torch's own ``Join`` context uses: a joinable
offers ``join_hook(**kwargs)``, ``join_device``, ``join_process_group`` and
reads its ``_join_config``; ddpkit's DDP also works under torch's ``Join``.

Every step a rank that has not joined all-reduces a one (see
:meth:`Join.notify_join_context`) and a joined rank a zero, so the sum is the
number of ranks still training.

DDP's side is :mod:`ddpkit.parallel.ddp.join`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from types import TracebackType
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from ddpkit.runtime import events

__all__ = ["DISABLED", "Join", "JoinConfig", "JoinHook"]

SKEW_WARNING = 1000
"""Steps a joined rank shadows before warning that the inputs are badly skewed."""


class JoinConfig(NamedTuple):
    """What a joinable reads each step (the fields of torch's ``_JoinConfig``)."""

    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool


DISABLED = JoinConfig(enable=False, throw_on_early_termination=False, is_first_joinable=False)


class JoinHook(Protocol):
    """A joinable's side of the protocol."""

    def main_hook(self) -> None:
        """Shadow one step of the ranks still training."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Run on every rank once all have joined."""


class Join:
    """Context manager for training on uneven inputs; see the module notes.

    Args:
        joinables: objects with ``join_hook``, ``join_device``,
            ``join_process_group`` (ddpkit's DDP); the first one does the
            per-step communication.
        enable: ``False`` makes the context do nothing (even inputs).
        throw_on_early_termination: raise ``RuntimeError`` on every rank as
            soon as one rank runs out of inputs, instead of shadowing it.
        **kwargs: passed to every ``join_hook``.

    Raises:
        ValueError: no joinables, or joinables on different process groups.
        RuntimeError: with ``throw_on_early_termination=True``, when a rank
            runs out of inputs.
    """

    def __init__(
        self, joinables: Sequence[Any], enable: bool = True, throw_on_early_termination: bool = False, **kwargs: Any
    ) -> None:
        if len(joinables) == 0:
            raise ValueError("Join() needs at least one joinable, e.g. Join([model])")
        self._joinables = list(joinables)
        self._hooks = [j.join_hook(**kwargs) for j in self._joinables]
        self._enable = enable
        self._throw = throw_on_early_termination
        for k, j in enumerate(self._joinables):
            j._join_config = JoinConfig(enable, throw_on_early_termination, is_first_joinable=k == 0)
        groups = {id(j.join_process_group) for j in self._joinables}
        if len(groups) > 1:
            raise ValueError("Join(): the joinables use different process groups; use one group for all of them")
        self._group = self._joinables[0].join_process_group
        self._device = self._joinables[0].join_device
        self._rank = dist.get_rank(self._group)

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._enable or exc_type is not None:
            return  # an exception in the block goes straight to the caller
        is_last_joiner = True
        rounds = 0
        while self._count_training() > 0:
            if self._throw:
                self._tell_others_to_stop()
            if rounds == SKEW_WARNING:
                warnings.warn(
                    f"rank {self._rank} has shadowed {SKEW_WARNING} steps of the other ranks: its input "
                    "has at least that many fewer batches, and the job runs at the pace of the longest "
                    "shard; balance the shards (DistributedSampler) to avoid idle ranks",
                    stacklevel=2,
                )
            for hook in self._hooks:
                hook.main_hook()
            is_last_joiner = False
            rounds += 1
        for hook in self._hooks:
            hook.post_hook(is_last_joiner)

    def _count_training(self) -> int:
        """How many ranks have not joined (this one contributes a zero)."""
        count = torch.zeros(1, device=self._device)
        events.collective("join: count the ranks still training", nbytes=4)
        dist.all_reduce(count, group=self._group)
        return int(count.item())

    def _tell_others_to_stop(self) -> None:
        ones = torch.ones(1, device=self._device)
        events.collective("join: count the ranks still training", nbytes=4)
        dist.all_reduce(ones, group=self._group)
        raise RuntimeError(f"Rank {self._rank} exhausted all inputs.")

    @staticmethod
    def notify_join_context(joinable: Any) -> tuple[Any, torch.Tensor] | None:
        """Tell the ranks that have joined that this one still trains; call before each step's collectives.

        Only the first joinable of a context communicates. With
        ``throw_on_early_termination`` it also learns whether some rank has
        run out of inputs, and raises then.

        Returns:
            ``(work, tensor)`` of the asynchronous all-reduce whose result is
            the number of ranks still training, or ``None``.
        """
        config = getattr(joinable, "_join_config", DISABLED)
        if not config.is_first_joinable or not config.enable:
            return None
        device, group = joinable.join_device, joinable.join_process_group
        ones = torch.ones(1, device=device)
        events.collective("join: count the ranks still training", nbytes=4)
        work = dist.all_reduce(ones, group=group, async_op=True)
        if config.throw_on_early_termination:
            zeros = torch.zeros(1, device=device)
            events.collective("join: count the ranks still training", nbytes=4)
            dist.all_reduce(zeros, group=group)
            if zeros.item():
                raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing across all ranks.")
        return work, ones

"""Stale-synchronous training without a server: :func:`StaleSynchronousOptimizer`.

The seed's consistency model (d). Every step a worker starts an all-reduce
of its gradient (divided by the number of workers, as DDP divides) and does
not wait for it: it steps at once with its own share plus the other workers'
shares of every earlier step whose all-reduce has completed. The all-reduce
of step ``t - S`` must have completed before step ``t``'s update, and it
cannot complete before every worker has started it, so no worker runs more
than ``S`` steps ahead of the slowest (the stale-synchronous bound of Ho et
al. 2013, decentralised: the all-reduce is the clock). Each worker's update
therefore contains every gradient of the job, its own at once and the
others' at most ``S`` steps late: the replicas differ by at most the last
``S`` steps of the others' gradients. ``S = 0`` waits for every all-reduce
and steps with the plain average: DDP's update (with the same optimizer).

:meth:`synchronize` (before an evaluation or a checkpoint, every worker)
waits for the all-reduces still in flight, applies what they bring in one
more optimizer step, and averages the parameters and the optimizer's
floating-point state, so that every worker holds one model.

Example::

    opt = ddpkit.StaleSynchronousOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), staleness=2)
    ddpkit.broadcast_parameters(model.state_dict(), root_rank=0)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()          # waits only for the all-reduce of S steps ago
    opt.synchronize()       # one model again
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.parallel.common.broadcast import world_group
from ddpkit.parallel.local_sgd import average_parameters
from ddpkit.runtime import events

__all__ = ["StaleSynchronousOptimizer"]


@dataclass
class _InFlight:
    step: int
    own: torch.Tensor
    """This worker's share (its gradient / N)."""
    total: torch.Tensor
    """Becomes the sum of every worker's share when ``work`` completes."""
    work: Any


class _StaleSynchronous(torch.optim.Optimizer):
    """The methods :func:`StaleSynchronousOptimizer` adds to the wrapped optimizer's class."""

    def _setup(self, staleness: int, group: dist.ProcessGroup | None) -> None:
        self.staleness = staleness
        self.process_group = group
        self.world = 1 if group is None else dist.get_world_size(group)
        self.in_flight: collections.deque[_InFlight] = collections.deque()
        self.clock = 0
        self.ages: collections.Counter[int] = collections.Counter()
        """Other workers' gradients by the number of steps they arrived late (0: the step they belong to)."""
        self.wait_s = 0.0
        """Seconds this worker waited for all-reduces (for the slowest worker, in effect)."""

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _flat_grads(self) -> torch.Tensor:
        params = self._params()
        return torch.cat([(p.grad.detach() if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params])

    def _set_grads(self, flat: torch.Tensor) -> None:
        at = 0
        for p in self._params():
            g = flat[at : at + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            at += p.numel()

    def _arrive(self, item: _InFlight) -> None:
        start = time.perf_counter()
        item.work.wait()
        self.wait_s += time.perf_counter() - start

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.world == 1:
            return super().step()
        own = self._flat_grads().div_(self.world)
        total = own.clone()
        events.collective("StaleSynchronousOptimizer: all-reduce step {}'s gradients", self.clock,
                          nbytes=total.numel() * total.element_size())
        work = dist.all_reduce(total, group=self.process_group, async_op=True)
        self.in_flight.append(_InFlight(self.clock, own, total, work))
        if self.staleness == 0:
            item = self.in_flight.popleft()
            self._arrive(item)
            self.ages[0] += 1
            combined = item.total  # the plain average: DDP's update
        else:
            combined = own.clone()
            while self.in_flight and (self.in_flight[0].step <= self.clock - self.staleness
                                      or self.in_flight[0].work.is_completed()):
                item = self.in_flight.popleft()
                self._arrive(item)
                combined += item.total - item.own
                self.ages[self.clock - item.step] += 1
        self._set_grads(combined)
        self.clock += 1
        super().step()
        return loss

    @torch.no_grad()
    def synchronize(self) -> None:
        """Every worker: wait for the all-reduces in flight, step with what they bring, average the replicas."""
        if self.world == 1:
            return
        if self.in_flight:
            combined = torch.zeros_like(self.in_flight[0].own)
            while self.in_flight:
                item = self.in_flight.popleft()
                self._arrive(item)
                combined += item.total - item.own
                self.ages[self.clock - item.step] += 1
            self._set_grads(combined)
            # The last gradients of the others, in one more step of the same optimizer: not a training step,
            # so without the step hooks (a TrainState would count it).
            base_step = super().step
            getattr(base_step, "__wrapped__", base_step).__get__(self)()
        params = self._params()
        tensors = params + [v for p in params for k, v in self.state.get(p, {}).items()
                            if torch.is_tensor(v) and v.is_floating_point() and k != "step"]
        average_parameters(tensors, self.process_group)  # type: ignore[arg-type]

    def stats(self) -> dict[str, Any]:
        """Ages of the other workers' gradients when applied, and the time waited."""
        n = sum(self.ages.values())
        return {"staleness_mean": sum(k * v for k, v in self.ages.items()) / n if n else 0.0,
                "staleness_max": max(self.ages, default=0),
                "staleness_histogram": {str(k): v for k, v in sorted(self.ages.items())},
                "wait_s": round(self.wait_s, 4)}


def StaleSynchronousOptimizer(
    optimizer: torch.optim.Optimizer, staleness: int = 2, process_group: dist.ProcessGroup | None = None,
) -> torch.optim.Optimizer:
    """``optimizer`` made stale-synchronous over ``process_group`` (see the module notes).

    Args:
        optimizer: a local optimizer of the model's parameters (all of one dtype and device); the result
            shares its class, groups and state, so checkpoints are the plain optimizer's.
        staleness: ``S``, a whole number >= 0: no worker more than ``S`` steps ahead of the slowest.
        process_group: the workers; default the world.

    Raises:
        TypeError: not an optimizer.
        ValueError: a bad ``staleness``, parameters of several dtypes or devices.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"StaleSynchronousOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if isinstance(optimizer, _StaleSynchronous):
        raise ValueError("this optimizer is already stale-synchronous: wrap it once")
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness={staleness!r} must be a whole number >= 0 (0: synchronous, every step)")
    kinds = {(p.dtype, p.device) for g in optimizer.param_groups for p in g["params"]}
    if len(kinds) > 1:
        raise ValueError(f"StaleSynchronousOptimizer: the parameters are of several dtypes or devices "
                         f"({sorted(str(k) for k in kinds)}): convert the model to one")
    base = type(optimizer)
    cls = type(base.__name__, (_StaleSynchronous, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # the same param groups, state and hooks
    # Not patched for step hooks: the wrapped class's own step (which ours calls) runs them, once per step.
    wrapped._setup(staleness, world_group(process_group))
    return wrapped

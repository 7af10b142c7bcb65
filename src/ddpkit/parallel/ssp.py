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
from ddpkit.runtime import events, membership

__all__ = ["StaleSynchronousOptimizer"]


@dataclass
class _InFlight:
    step: int
    own: torch.Tensor
    """This worker's share (its gradient / N)."""
    total: torch.Tensor
    """Becomes the sum of every worker's share when ``work`` completes."""
    work: Any
    merged: bool = False
    """A step done again after a membership change: ``total`` is ``[h, h x the total, the shares]`` (see
    :meth:`_StaleSynchronous._reconcile`)."""
    had: bool = False
    """This worker applied the step's total before the change: it takes part for the others only."""

    def result(self) -> torch.Tensor:
        """The step's total, once ``work`` completed."""
        if not self.merged:
            return self.total
        n = self.own.numel()
        holders = float(self.total[0])
        return self.total[1 : 1 + n] / holders if holders else self.total[1 + n :]


class _StaleSynchronous(torch.optim.Optimizer):
    """The methods :func:`StaleSynchronousOptimizer` adds to the wrapped optimizer's class."""

    def _setup(self, staleness: int, group: dist.ProcessGroup | None) -> None:
        self.staleness = staleness
        self.membership = membership.current() if group is None else None
        """Under ``ddpkit launch --on-failure continue``: the job's membership, whose groups change at deaths."""
        self.view = None
        if self.membership is not None:
            group = self._join_view()
        self.process_group = group
        self.world = 1 if group is None else dist.get_world_size(group)
        self.recent: dict[int, torch.Tensor] = {}
        """Under the membership: the totals of the last steps applied (a survivor that missed one gets it)."""
        self.carry: torch.Tensor | None = None
        """Under the membership: totals that came during a change, applied with the next step."""
        self.merged_until = 0
        """Steps before this one are all-reduced in the merged form (a change is being made good)."""
        self.posted_step = -1
        """The last step whose all-reduce this worker started."""
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

    def _arrive(self, item: _InFlight) -> bool:
        """Wait for ``item``; False when the membership changed meanwhile (the steps in flight were made good)."""
        start = time.perf_counter()
        try:
            if self.membership is None:
                item.work.wait()
            else:
                self.membership.wait(item.work, self.view)
        except membership.MembershipChanged:
            self._reconcile()
            return False
        finally:
            self.wait_s += time.perf_counter() - start
        return True

    def _applied(self, item: _InFlight, whole: bool = False) -> torch.Tensor:
        """What ``item`` adds to this worker's update (nothing for a step it had applied; ``whole``: its own share
        too), remembered."""
        total = item.result()
        if self.membership is not None:
            self.recent[item.step] = total
            for old in [s for s in self.recent if s < item.step - 2 * self.staleness - 2]:
                del self.recent[old]
        if item.had:
            return torch.zeros_like(item.own)
        return total if whole else total - item.own

    def _join_view(self) -> dist.ProcessGroup:
        assert self.membership is not None
        while True:
            self.view = self.membership.latest()
            if self.membership.member not in self.view.members:
                raise RuntimeError(f"member {self.membership.member} joins a running job (a replacement, or a spare "
                                   "node's worker): a stale-synchronous job takes none (nothing hands it the "
                                   "training state); run it without --max-restarts and without spare nodes")
            try:
                return self.membership.group(self.view)
            except membership.MembershipChanged:
                continue

    def _post(self, step: int, own: torch.Tensor, total: torch.Tensor | None = None, had: bool = False) -> None:
        """Start the all-reduce of ``step``: ``own``, or, in the merged form, ``total`` where this worker has it."""
        merged = step < self.merged_until
        if merged:
            n = own.numel()
            payload = torch.zeros(1 + 2 * n, dtype=own.dtype, device=own.device)
            if total is not None:
                payload[0], payload[1 : 1 + n] = 1, total
            else:
                payload[1 + n :] = own
        else:
            payload = own.clone()
        events.collective("StaleSynchronousOptimizer: all-reduce step {}'s gradients", step,
                          nbytes=payload.numel() * payload.element_size())
        work = dist.all_reduce(payload, group=self.process_group, async_op=True)
        self.in_flight.append(_InFlight(step, own, payload, work, merged, had))
        self.posted_step = max(self.posted_step, step)

    def _reconcile(self) -> None:
        """After a membership change: every survivor ends with the same steps applied, the dead's in-flight share
        whole or not at all.

        The all-reduces in flight are abandoned. The survivors build the new view's group, agree on the first step
        one of them lacks (``L``) and the last one started (``R``), and do steps ``L..R-1`` again, each once, in
        order, in a merged form ``[has, its total, its share]``: a step whose old all-reduce completed on some
        survivor comes out as that total (the dead's share in it) for everyone; one that completed nowhere as the
        survivors' shares (the dead's dropped). A survivor applies what it lacked; the steps it has not started
        yet it posts in the merged form when it gets to them.

        Raises:
            RuntimeError: a member joined: a stale-synchronous job takes no replacement (it would start from
                scratch).
        """
        assert self.membership is not None and self.view is not None
        before = set(self.view.members)
        while True:
            lacking: list[_InFlight] = []
            for item in self.in_flight:
                done = item.work.is_completed() and not _failed(item.work)
                if done and item.step not in self.recent and not item.had:
                    extra = self._applied(item)  # it came meanwhile: its total is the one every survivor takes
                    self.carry = extra if self.carry is None else self.carry + extra
                elif not done and not item.had:
                    lacking.append(item)
            self.in_flight = collections.deque(lacking)  # abandoned works: looked at again if this fails
            group = self._join_view()
            if joined := set(self.view.members) - before:
                raise RuntimeError(f"member(s) {sorted(joined)} joined a stale-synchronous job: a replacement would "
                                   "train from scratch; run StaleSynchronousOptimizer without --max-restarts")
            self.process_group, self.world = group, self.view.size
            posted = self.clock + (self.posted_step == self.clock)  # this step's own may be posted already
            first = min([i.step for i in lacking], default=posted)
            bounds = torch.tensor([-first, posted], dtype=torch.int64)
            try:
                work = dist.all_reduce(bounds, dist.ReduceOp.MAX, group=group, async_op=True)  # cpu group: gloo's
                self.membership.wait(work, self.view)
            except membership.MembershipChanged:
                continue
            low, self.merged_until = -int(bounds[0]), int(bounds[1])
            own = {i.step: i.own for i in lacking}
            self.in_flight.clear()
            for step in range(low, posted):
                self._post(step, own.get(step, self._zeros()), self.recent.get(step), had=step not in own)
            return

    def _zeros(self) -> torch.Tensor:
        params = self._params()
        return torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.world == 1 and self.membership is None:
            return super().step()
        own = self._flat_grads().div_(self.world)
        self._post(self.clock, own)
        # S = 0 waits for this step's all-reduce and steps with the plain average (DDP's update); S > 0 steps
        # with its own share and whatever of the others' has come.
        combined = torch.zeros_like(own) if self.staleness == 0 else own.clone()
        while self.in_flight and (self.in_flight[0].step <= self.clock - self.staleness
                                  or self.in_flight[0].work.is_completed()):
            item = self.in_flight[0]
            if not self._arrive(item):
                continue  # the membership changed: the steps in flight were posted again
            self.in_flight.popleft()
            combined += self._applied(item, whole=self.staleness == 0 and item.step == self.clock)
            self.ages[self.clock - item.step] += 1
        if self.carry is not None:
            combined += self.carry
            self.carry = None
        self._set_grads(combined)
        self.clock += 1
        super().step()
        return loss

    @torch.no_grad()
    def synchronize(self) -> None:
        """Every worker: wait for the all-reduces in flight, step with what they bring, average the replicas."""
        if self.world == 1 and self.membership is None:
            return
        combined = None
        while self.in_flight:
            item = self.in_flight[0]
            if not self._arrive(item):
                continue
            self.in_flight.popleft()
            extra = self._applied(item)
            combined = extra if combined is None else combined + extra
            self.ages[self.clock - item.step] += 1
        if self.carry is not None:
            combined = self.carry if combined is None else combined + self.carry
            self.carry = None
        if combined is not None:
            self._set_grads(combined)
            # The last gradients of the others, in one more step of the same optimizer: not a training step,
            # so without the step hooks (a TrainState would count it).
            base_step = super().step
            getattr(base_step, "__wrapped__", base_step).__get__(self)()
        params = self._params()
        tensors = params + [v for p in params for k, v in self.state.get(p, {}).items()
                            if torch.is_tensor(v) and v.is_floating_point() and k != "step"]
        if self.membership is None:
            average_parameters(tensors, self.process_group)  # type: ignore[arg-type]
        elif not self._average(tensors):
            self.synchronize()  # a member died meanwhile: the steps it left in flight first

    def _average(self, tensors: list[torch.Tensor]) -> bool:
        """Under the membership: ``tensors`` replaced by their mean over the view; False if it changed first."""
        assert self.membership is not None
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]) / self.world
        try:
            self.membership.wait(dist.all_reduce(flat, group=self.process_group, async_op=True), self.view)
        except membership.MembershipChanged:
            self._reconcile()
            return False
        at = 0
        for t in tensors:
            t.copy_(flat[at : at + t.numel()].view_as(t))
            at += t.numel()
        return True

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


def _failed(work: Any) -> bool:
    """Whether a completed ``work`` ended in an error (a peer died in the middle of it)."""
    try:
        work.get_future().value()
    except Exception:  # noqa: BLE001 - any error: its result is not a total
        return True
    return False

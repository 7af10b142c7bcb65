"""One key range of the parameter servers: its parameters, their optimizer, and the updates applied to it.

The workers' parameters are cut into K key ranges (whole tensors, see
:func:`ddpkit.parallel.ps.optimizer.partition`), one per server. With
replication R, range ``k`` lives on the servers of its chain ``k, k+1, ...,
k+R-1`` (mod K). The first live server of the chain, the head, takes the
workers' requests; every update it makes it first hands down the chain
(:class:`Update`) and only then applies and answers, so an update a worker
was answered for is on every live server of the chain (the Parameter Server
paper's chain replication). A replica applies what it is handed in the
order the head made it, with the same arithmetic, so the copies stay equal
bit for bit.

Updates carry their origin, ``(worker, clock)`` (a synchronous step:
worker -1 and the step), and a range remembers how far each worker's
updates were applied: an update is applied once, whether it reaches a
server from a worker that sends it again to a new head after the old one
died, or from the old head's last message down the chain.

Consistency (chosen by the workers' :class:`ddpkit.ParameterServerOptimizer`):

``sync``
    a step waits for every worker's gradient; the head adds them in worker
    order, each divided by the number of workers first (as DDP divides before
    its all-reduce), steps its optimizer once, and every worker gets the
    same new parameters. One version per step.
``async``
    each gradient is applied as it arrives, divided by the number of workers
    (its share of a synchronous average, so learning rates and checkpoints
    are those of ``sync``), and the worker gets whatever parameters are
    current. With a staleness bound ``S`` (stale-synchronous parallel, Ho et
    al. 2013) the reply to a worker that has pushed ``c`` gradients waits
    until every other worker has pushed at least ``c - S``: no worker
    computes more than ``S`` steps ahead of the slowest (``S = 0``: every
    step waits for all). A worker that stopped (or died) no longer holds the
    others back.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["KeyRange", "Update", "optimizer_class"]

SYNC_STEP = -1
"""The worker of a synchronous step's update (every worker's gradient at once)."""


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The optimizer class named ``module.QualName`` (what the workers send).

    Raises:
        ValueError: the name does not lead to an optimizer class.
    """
    module, _, qual = name.rpartition(".")
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError):
        obj = None
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise ValueError(f"optimizer class {name!r} cannot be imported by the parameter servers: use a class "
                         "defined at the top level of an importable module (torch.optim.SGD, ...)")
    return obj


@dataclass(frozen=True)
class Update:
    """One change of a key range, as the head made it and hands it down the chain."""

    kind: str
    """``apply`` (a gradient step), ``settings`` (the groups' hyperparameters) or ``load`` (an optimizer state)."""
    worker: int = SYNC_STEP
    """The worker whose gradient it is (``apply``; :data:`SYNC_STEP` for a synchronous step)."""
    clock: int = 0
    """That worker's step (``apply``)."""
    grad: torch.Tensor | None = None
    """The gradient to step with, already divided by the number of workers (``apply``)."""
    have: torch.Tensor | None = None
    """uint8 per parameter: 1 where some worker had a gradient (``apply``)."""
    blob: Any = None
    """The settings or the state (``settings``, ``load``)."""


class KeyRange:
    """Key range ``index`` on one server: set up from worker 0's blob (see the module notes).

    ``forward(update)`` hands an update down the chain (the server's; it returns once the rest of the chain
    has it). Every method that changes the range holds :attr:`lock`.
    """

    def __init__(self, index: int, blob: dict[str, Any], workers: int,
                 forward: Callable[[KeyRange, Update], None]) -> None:
        self.index, self.workers, self.forward = index, workers, forward
        self.lock = threading.Condition()
        self.failure: BaseException | None = None
        """Set by the server when another of its threads failed: waits here stop."""
        self.version = 0
        self.clocks = [0] * workers
        """Per worker: how many of its steps were applied here (its next clock)."""
        self.stopped = [False] * workers
        self.arrived: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """The synchronous step being gathered: worker -> (mask, gradients)."""
        self.loads: dict[int, Any] = {}
        """The LOAD being gathered: worker -> its blob (worker 0's is the state)."""
        self.generation = 0
        """Bumped by every update and every LOAD: a gathering worker sees its round done."""
        self.mode, self.staleness = blob["mode"], blob["staleness"]
        self.indices: list[int] = list(blob["indices"])
        self.flat = blob["values"].clone()
        self.params: list[torch.Tensor] = []
        at = 0
        for shape in blob["shapes"]:
            n = int(torch.Size(shape).numel())
            self.params.append(self.flat[at : at + n].view(shape))
            at += n
        local = {g: i for i, g in enumerate(self.indices)}
        groups, self.group_of = [], []
        for gi, group in enumerate(blob["groups"]):
            mine = [self.params[local[g]] for g in group["params"] if g in local]
            if mine:
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": mine})
                self.group_of.append(gi)
        self.optimizer = optimizer_class(blob["optimizer"])(groups) if groups else None
        if blob.get("state") and self.optimizer is not None:
            self._load_state(blob["state"])

    # -- state ---------------------------------------------------------------------------------------------------

    def _load_state(self, state: dict[int, Any]) -> None:
        """Optimizer state keyed by the workers' parameter indices (this range's share of them)."""
        assert self.optimizer is not None
        local = {g: i for i, g in enumerate(self.indices)}
        self.optimizer.load_state_dict({
            "state": {local[g]: s for g, s in state.items() if g in local},
            "param_groups": self.optimizer.state_dict()["param_groups"],
        })

    def state(self) -> dict[int, Any]:
        """This range's optimizer state keyed by the workers' parameter indices."""
        if self.optimizer is None:
            return {}
        # The local state dict numbers the parameters group by group, in the order the groups hold them.
        order = [id(p) for g in self.optimizer.param_groups for p in g["params"]]
        position = {id(p): self.indices[i] for i, p in enumerate(self.params)}
        local = self.optimizer.state_dict()["state"]
        return {position[order[i]]: s for i, s in local.items()}

    def _settings(self, groups: list[dict[str, Any]]) -> None:
        if self.optimizer is None:
            return
        for mine, gi in zip(self.optimizer.param_groups, self.group_of):
            mine.update({k: v for k, v in groups[gi].items() if k != "params"})

    # -- updates -------------------------------------------------------------------------------------------------

    def _combine(self, pushes: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients added in the order given, each divided by the number of workers; the union of masks."""
        grad = torch.zeros_like(self.flat)
        have = torch.zeros(len(self.params), dtype=torch.uint8)
        for mask, grads in pushes:
            grad += grads / self.workers
            have |= mask
        return grad, have

    def _make(self, update: Update) -> None:
        """Hand ``update`` down the chain, then make it here (the lock held)."""
        self.forward(self, update)
        if update.kind == "apply":
            self._step(update)
        elif update.kind == "settings":
            self._settings(update.blob)
        else:
            self._settings(update.blob["settings"])
            if self.optimizer is not None:
                self._load_state(update.blob["state"])
        self.generation += 1
        self.lock.notify_all()

    def _step(self, update: Update) -> None:
        assert update.grad is not None and update.have is not None
        self.version += 1
        if update.worker == SYNC_STEP:
            self.clocks = [update.clock + 1] * self.workers
            self.arrived = {}
        else:
            self.clocks[update.worker] = update.clock + 1
        if self.optimizer is None:
            return  # more servers than tensors: this range holds none
        offsets = [0]
        for p in self.params:
            offsets.append(offsets[-1] + p.numel())
        for p, at, h in zip(self.params, offsets, update.have.tolist()):
            p.grad = update.grad[at : at + p.numel()].view_as(p) if h else None
        self.optimizer.step()
        for p in self.params:
            p.grad = None

    def applied(self, update: Update) -> bool:
        """Whether ``update`` (an ``apply``) was made here already."""
        if update.worker == SYNC_STEP:
            return update.clock < max(self.clocks)
        return update.clock < self.clocks[update.worker]

    def take(self, update: Update) -> None:
        """An update handed down by the head: made here (and handed on) unless it was made already."""
        with self.lock:
            if update.kind != "apply" or not self.applied(update):
                self._make(update)

    def settings(self, groups: list[dict[str, Any]]) -> None:
        """A worker's SETTINGS (a scheduler changed the groups' hyperparameters)."""
        with self.lock:
            self._make(Update("settings", blob=groups))

    def _lead(self, w: int) -> int:
        running = [c for c, s in zip(self.clocks, self.stopped) if not s]
        return self.clocks[w] - min(running) if running else 0

    def push(self, w: int, clock: int, computed_on: int, mask: torch.Tensor,
             grads: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Worker ``w``'s gradient of its step ``clock``; the reply's fields (version, lag, lead, microseconds
        held back) and the parameters to send. A step applied here already is answered, not applied again."""
        with self.lock:
            lag = self.version - computed_on
            if self.mode == "sync":
                if clock >= self.clocks[w]:
                    self._gather(w, clock, (mask, grads))
            elif clock >= self.clocks[w]:
                grad, have = self._combine([(mask, grads)])
                self._make(Update("apply", w, clock, grad, have))
            waited = 0.0  # held back by the bound only: a reply the bound did not hold says 0
            if self.mode == "async" and self.staleness is not None and self._lead(w) > self.staleness:
                start = time.perf_counter()
                while self._lead(w) > self.staleness and self.failure is None:
                    self.lock.wait(timeout=1.0)
                waited = time.perf_counter() - start
            lead = self._lead(w) if self.mode == "async" else 0  # sync: every worker is at the same step
            return [self.version, lag, lead, int(waited * 1e6)], self.flat.clone()

    def _gather(self, w: int, clock: int, item: tuple[torch.Tensor, torch.Tensor]) -> None:
        """A synchronous step: wait until every worker brought its gradient; the last one makes the update (or
        the step arrives made, from the head before this one, while the workers wait here)."""
        self.arrived[w] = item
        if len(self.arrived) == self.workers:
            got = self.arrived
            grad, have = self._combine([got[i] for i in range(self.workers)])
            self._make(Update("apply", SYNC_STEP, clock, grad, have))
            return
        self._wait_round(w, lambda: self.clocks[w] > clock, self.arrived)

    def load(self, w: int, blob: Any) -> None:
        """A LOAD (every worker; worker 0 brings the state): made once all arrived."""
        with self.lock:
            generation = self.generation
            self.loads[w] = blob
            if len(self.loads) == self.workers:
                got, self.loads = self.loads, {}
                self._make(Update("load", blob=got[0]))
                return
            self._wait_round(w, lambda: self.generation != generation, self.loads)

    def _wait_round(self, w: int, done: Callable[[], bool], arrived: dict[int, Any]) -> None:
        while not done() and self.failure is None:
            if gone := [v for v in range(self.workers) if self.stopped[v] and v not in arrived]:
                raise RuntimeError(
                    f"worker {gone[0]} left (it closed its ParameterServerOptimizer or exited) while worker {w} "
                    "waits for it in a synchronous request: every worker must take the same steps (or use "
                    "mode='async')"
                )
            self.lock.wait(timeout=1.0)
        if self.failure is not None:
            raise RuntimeError("another thread of this parameter server failed") from self.failure

    def stop(self, w: int) -> None:
        """Worker ``w`` is done (or gone): it no longer holds the others back."""
        with self.lock:
            self.stopped[w] = True
            self.lock.notify_all()

    def fail(self, failure: BaseException) -> None:
        with self.lock:
            self.failure = self.failure or failure
            self.lock.notify_all()

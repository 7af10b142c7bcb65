"""Parameter servers from the workers' side: :class:`ParameterServerOptimizer`.

The seed's consistency models (a) and (c): servers hold the parameters and
the optimizer state, sharded by parameter over the job's K servers (whole
tensors, each to the server with the fewest elements so far: MXNet's kvstore
and BytePS's layout). A worker's ``step()`` pushes its gradients to the
servers that own them and pulls the new parameters back, so the worker holds
no optimizer state at all. ``mode="sync"`` is mathematically DDP's update
with the same optimizer; ``mode="async"`` applies each worker's gradient as
it arrives, with an optional staleness bound (see
:mod:`ddpkit.parallel.ps.server` for both, and for why the channel is a Gloo
process group).

The job's servers are processes of their own, started by ``ddpkit train
--strategy ps-sync|ps-async`` or ``ddpkit launch --num-servers K``; the
workers keep their ordinary process group (the servers are not in it).
One ParameterServerOptimizer per job.

Example (under ``ddpkit launch --nproc-per-node 2 --num-servers 1 train.py``)::

    ctx = ddpkit.init()
    model = Net()
    opt = ddpkit.ParameterServerOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9,
                                          mode="async", staleness=2)
    for x, y in loader:                       # every worker starts from worker 0's parameters
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()                            # push the gradients, pull the parameters
    ddpkit.barrier(); opt.pull()              # every worker holds the servers' parameters
    opt.close()                               # the servers exit once every worker closed
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ddpkit.parallel.ps.channel import HEADER, TAG_HEADER, TAG_TO_WORKER, Op, from_bytes, request, to_bytes
from ddpkit.parallel.ps.keyrange import optimizer_class as importable_optimizer
from ddpkit.parallel.ps.routes import Routes
from ddpkit.runtime import events

__all__ = ["PSStats", "ParameterServerOptimizer", "partition"]

MODES = ("sync", "async")

def partition(numels: list[int], servers: int) -> list[int]:
    """The server of each parameter: in order, to the server holding the fewest elements so far (ties: lowest)."""
    load = [0] * servers
    owner = []
    for n in numels:
        k = min(range(servers), key=lambda s: (load[s], s))
        owner.append(k)
        load[k] += n
    return owner


class PSStats:
    """What one worker saw of the servers: its gradients' staleness, its lead, and its time waiting."""

    def __init__(self) -> None:
        self.steps = 0
        self.staleness: collections.Counter[int] = collections.Counter()
        """Gradients by staleness: versions the server applied between the parameters a gradient was computed
        on and the gradient itself (the largest over the servers)."""
        self.max_lead = 0
        """The most steps this worker was ahead of the slowest running worker when it got parameters."""
        self.wait_s = 0.0
        """Seconds in ``step()``'s exchange with the servers (sending, the servers' work, waiting, receiving)."""
        self.bound_wait_s = 0.0
        """Of which the servers held the reply back for the staleness bound (the largest over the servers)."""

    def as_dict(self) -> dict[str, Any]:
        n = sum(self.staleness.values())
        return {
            "steps": self.steps, "staleness_mean": sum(k * v for k, v in self.staleness.items()) / n if n else 0.0,
            "staleness_max": max(self.staleness, default=0),
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
            "max_lead": self.max_lead, "wait_s": round(self.wait_s, 4), "bound_wait_s": round(self.bound_wait_s, 4),
        }


class ParameterServerOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` run by the job's parameter servers (see the module notes).

    Args:
        params: the parameters (or groups), as for ``optimizer_class``; all of one floating dtype.
        optimizer_class: a ``torch.optim.Optimizer`` class the servers can import (module-level).
        mode: ``sync`` (every step waits for all workers) or ``async``.
        staleness: ``async`` only: at most this many steps ahead of the slowest worker (None: no bound).
        **defaults: ``optimizer_class``'s settings (``lr=...``).

    Every worker constructs it (worker 0 sends the servers its parameters and the optimizer's settings, and
    every worker starts from worker 0's parameters). ``load_state_dict`` and ``close`` are called by every
    worker; ``state_dict`` fetches the servers' state on the worker that calls it.

    Raises:
        TypeError: ``optimizer_class`` is not an optimizer class.
        ValueError: a bad ``mode`` or ``staleness``, mixed or non-floating dtypes, an optimizer class the
            servers cannot import, a state dict that does not fit.
        RuntimeError: the job has no parameter servers, or this process is one.
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer], *, mode: str = "sync",
                 staleness: int | None = None, **defaults: Any) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not a parameter server mode: choose sync or async")
        if staleness is not None:
            if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
                raise ValueError(f"staleness={staleness!r} must be a whole number >= 0, or None (no bound)")
            if mode == "sync":
                raise ValueError(f"staleness={staleness} bounds mode='async'; mode='sync' is staleness 0 already")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class={optimizer_class!r} is not a torch.optim.Optimizer class")
        self.optimizer_name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
        try:
            found = importable_optimizer(self.optimizer_name)
        except ValueError as e:
            raise ValueError(f"ParameterServerOptimizer: {e}") from None
        if found is not optimizer_class:
            raise ValueError(f"optimizer_class {self.optimizer_name} imports as another class on the servers: "
                             "define it at the top level of a module")
        local = optimizer_class(params, **defaults)  # torch's own checks of the settings, and every default
        super().__init__([dict(g) for g in local.param_groups], local.defaults)
        self.optimizer_class = optimizer_class
        self.mode, self.staleness = mode, staleness
        self._setup(getattr(self, "_pending_state", None))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "place"):  # the constructor adds the first groups through here
            raise RuntimeError("ParameterServerOptimizer: add_param_group() after construction is not supported "
                               "(the servers hold the parameters they were given): pass every group at once")
        super().add_param_group(param_group)

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, *, mode: str = "sync",
                       staleness: int | None = None) -> ParameterServerOptimizer:
        """The same optimizer (class, groups, settings and state) on the servers."""
        state = optimizer.state_dict()
        groups = [dict(g) for g in optimizer.param_groups]
        out = cls.__new__(cls)
        out._pending_state = state if state["state"] else None
        cls.__init__(out, groups, type(optimizer), mode=mode, staleness=staleness)
        return out

    # -- set-up --------------------------------------------------------------------------------------------------

    def _all(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _setup(self, state: dict[str, Any] | None) -> None:
        params = self._all()
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(f"ParameterServerOptimizer: the parameters are of dtypes {sorted(map(str, dtypes))}: "
                             "the servers keep one floating dtype; convert the model (model.float())")
        self.routes = Routes(next(iter(dtypes)))
        self.place = self.routes.place
        self.servers = self.place.servers
        self.owner = partition([p.numel() for p in params], self.servers)
        self.shares = [[i for i, k in enumerate(self.owner) if k == s] for s in range(self.servers)]
        """The parameters of each key range."""
        self.numels = [sum(params[i].numel() for i in share) for share in self.shares]
        self.routes.numels = self.numels
        self.dtype = next(iter(dtypes))
        self.versions = [0] * self.servers
        self.clock = 0
        self.stats = PSStats()
        self.closed = False
        self._settings = self._current_settings()
        self._consolidated: dict[str, Any] | None = None
        if self.place.index == 0:
            for k in range(self.servers):
                blob = self._setup_blob(k, state)
                for s in self.place.chain(k):
                    self.routes.send_blob(s, k, Op.SETUP, blob)
        self.pull()

    def _setup_blob(self, k: int, state: dict[str, Any] | None) -> dict[str, Any]:
        params = self._all()
        share = self.shares[k]
        values = torch.cat([params[i].detach().reshape(-1).cpu() for i in share]) if share \
            else torch.zeros(0, dtype=self.dtype)
        mine = set(share)
        return {
            "range": k, "optimizer": self.optimizer_name, "mode": self.mode, "staleness": self.staleness,
            "indices": share, "shapes": [list(params[i].shape) for i in share], "values": values,
            "groups": self._indexed_groups(),
            "state": {i: s for i, s in state["state"].items() if i in mine} if state else None,
        }

    def _current_settings(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def _indexed_groups(self) -> list[dict[str, Any]]:
        """The groups as a state dict numbers them: the settings, and each parameter's index over all groups."""
        groups, at = [], 0
        for settings, g in zip(self._current_settings(), self.param_groups):
            groups.append({**settings, "params": list(range(at, at + len(g["params"])))})
            at += len(g["params"])
        return groups

    # -- messages ------------------------------------------------------------------------------------------------

    def _receive_parameters(self, replies: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        params = self._all()
        with torch.no_grad():
            for k, (_, flat) in replies.items():
                at = 0
                for i in self.shares[k]:
                    p = params[i]
                    p.copy_(flat[at : at + p.numel()].view_as(p))
                    at += p.numel()

    # -- the optimizer -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Push every gradient to its server, then pull the new parameters (a parameter without ``.grad`` on
        every worker is not stepped, as a local optimizer skips it)."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if (now := self._current_settings()) != self._settings:
            # A scheduler (or the user) changed a setting: the servers step with the new one from now on.
            self._settings = now
            for k in range(self.servers):
                self._tell_settings(k)
        params = self._all()
        requests = {}
        for k, share in enumerate(self.shares):
            mask = torch.tensor([params[i].grad is not None for i in share], dtype=torch.uint8)
            grads = torch.cat([
                (params[i].grad.detach().reshape(-1).to("cpu", self.dtype) if params[i].grad is not None
                 else torch.zeros(params[i].numel(), dtype=self.dtype)) for i in share
            ]) if share else torch.zeros(0, dtype=self.dtype)
            requests[k] = [request(Op.PUSH, k, self.clock, self.versions[k], 1), mask, grads]
        events.collective("parameter servers: push gradients, pull parameters",
                          nbytes=4 * sum(self.numels) + len(params))
        start = time.perf_counter()
        replies = self.routes.exchange(requests, self._settings)
        self.stats.wait_s += time.perf_counter() - start
        self._receive_parameters(replies)
        lag = lead = bound = 0
        for k, (head, _) in replies.items():
            self.versions[k] = int(head[1])
            lag, lead, bound = max(lag, int(head[2])), max(lead, int(head[3])), max(bound, int(head[4]))
        self.clock += 1
        self.stats.steps += 1
        self.stats.staleness[lag] += 1
        self.stats.max_lead = max(self.stats.max_lead, lead)
        self.stats.bound_wait_s += bound / 1e6
        self._consolidated = None
        return loss

    def _tell_settings(self, k: int) -> None:
        """The current settings to key range ``k``'s head (it hands them down its chain)."""
        self.routes.on_head(k, lambda s: self.routes.send_blob(s, k, Op.SETTINGS, self._settings))

    def pull(self) -> None:
        """Copy the servers' current parameters into this worker's (for an evaluation or a checkpoint in async
        mode, after the workers met: ``ddpkit.barrier()``; in sync mode they are current after every step)."""
        self._check_open()
        replies = self.routes.exchange({k: [request(Op.PULL, k)] for k in range(self.servers)}, self._settings)
        self._receive_parameters(replies)
        for k, (head, _) in replies.items():
            self.versions[k] = int(head[1])

    def _fetch_state(self) -> dict[str, Any]:
        self._check_open()
        routes = self.routes

        def fetch(s: int, k: int) -> dict[int, Any]:
            src = self.place.server_rank(s)
            routes.wait(routes.pg.send([request(Op.STATE, k)], src, TAG_HEADER), s)
            head = torch.zeros(HEADER, dtype=torch.int64)
            routes.wait(routes.pg.recv([head], src, TAG_TO_WORKER), s)
            blob = torch.empty(int(head[1]), dtype=torch.uint8)
            if blob.numel():
                routes.wait(routes.pg.recv([blob], src, TAG_TO_WORKER), s)
            return from_bytes(blob)

        merged: dict[int, Any] = {}
        for k in range(self.servers):
            merged.update(routes.on_head(k, lambda s, k=k: fetch(s, k)))
        return {"state": {i: merged[i] for i in sorted(merged)}, "param_groups": self._indexed_groups()}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Fetch the servers' optimizer state on worker ``to`` (the others do nothing: not a collective)."""
        if self.place.index == to:
            self._consolidated = self._fetch_state()

    def state_dict(self) -> dict[str, Any]:
        """``optimizer_class``'s state dict of all the parameters, as a local optimizer would return it."""
        return self._consolidated if self._consolidated is not None else self._fetch_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace the servers' optimizer state and the groups' settings (every worker calls it)."""
        self._check_open()
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError("loaded state dict does not fit this optimizer: its parameter groups differ in number "
                             "or size")
        for mine, saved in zip(self.param_groups, groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        self._settings = self._current_settings()
        state = state_dict.get("state", {})
        requests = {}
        for k in range(self.servers):
            mine = set(self.shares[k])
            blob = to_bytes({"state": {i: s for i, s in state.items() if i in mine}, "settings": self._settings}) \
                if self.place.index == 0 else torch.zeros(0, dtype=torch.uint8)
            requests[k] = [request(Op.LOAD, k, blob.numel()), blob]
        # The LOAD is made on every server of a chain once every worker sent it (the replies say so).
        self.routes.exchange(requests, self._settings, parameters=False)
        self._consolidated = None

    def close(self) -> None:
        """Tell the servers this worker is done (they exit once every worker closed). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.routes.stop()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this ParameterServerOptimizer was closed: the servers may have exited")


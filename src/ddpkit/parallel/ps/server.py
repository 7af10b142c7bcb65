"""A parameter server: its share of the parameters and their optimizer, updated by the workers' gradients.

A server knows nothing of the model until worker 0 sends it its share (the
parameters' indices, shapes and values, the optimizer class, its groups'
settings and, when resuming, their state): servers are generic processes,
started by ``ddpkit train`` or ``ddpkit launch --num-servers K`` as
``python -m ddpkit.parallel.ps.server``. One thread per worker receives its
requests (:class:`ddpkit.parallel.ps.channel.Op`).

Consistency (chosen by the workers' :class:`ddpkit.ParameterServerOptimizer`):

``sync``
    a step waits for every worker's gradient; the server adds them in worker
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
    step waits for all). A worker that said STOP no longer holds the others back.

Every reply to a push carries the version of the parameters sent, the
gradient's staleness (versions applied between the parameters it was
computed on and itself), the worker's lead over the slowest worker, and the
microseconds the reply waited for the bound.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.parallel.ps.channel import (
    HEADER,
    TAG_HEADER,
    TAG_TO_SERVER,
    TAG_TO_WORKER,
    Op,
    PSPlace,
    connect,
    from_bytes,
    header,
    ps_place,
    recv_blob,
    to_bytes,
)
from ddpkit.runtime.process import exit_now, set_process_name

__all__ = ["ParameterServer", "main", "optimizer_class"]


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


class _Round:
    """Workers meeting for one collective request (a sync step, a LOAD): the last to arrive acts for all."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.arrived: dict[int, Any] = {}
        self.generation = 0


class ParameterServer:
    """Server ``place.index`` of the job: serves until every worker has said STOP (see the module notes)."""

    def __init__(self, pg: dist.ProcessGroup, place: PSPlace) -> None:
        self.pg, self.place = pg, place
        self.workers = place.workers
        self.lock = threading.Condition()
        self.ready = threading.Event()
        self.version = 0
        self.clocks = [0] * self.workers
        self.stopped = [False] * self.workers
        self.rounds: dict[int, _Round] = {Op.PUSH: _Round(self.workers), Op.LOAD: _Round(self.workers)}
        self.failure: BaseException | None = None
        self.mode = "sync"
        self.staleness: int | None = None
        self.indices: list[int] = []
        self.flat = torch.zeros(0)
        self.grad_flat = torch.zeros(0)
        self.params: list[torch.Tensor] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.group_of: list[int] = []
        """The workers' group index of each of this server's groups."""

    # -- set-up and state ------------------------------------------------------------------------------------

    def setup(self, blob: dict[str, Any]) -> None:
        self.mode, self.staleness = blob["mode"], blob["staleness"]
        self.indices = list(blob["indices"])
        self.flat = blob["values"].clone()
        self.grad_flat = torch.zeros_like(self.flat)
        self.params, self.grads = [], []
        at = 0
        for shape in blob["shapes"]:
            n = int(torch.Size(shape).numel())
            self.params.append(self.flat[at : at + n].view(shape))
            self.grads.append(self.grad_flat[at : at + n].view(shape))
            at += n
        local = {g: i for i, g in enumerate(self.indices)}
        groups, self.group_of = [], []
        for gi, group in enumerate(blob["groups"]):
            mine = [self.params[local[g]] for g in group["params"] if g in local]
            if mine:
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": mine})
                self.group_of.append(gi)
        cls = optimizer_class(blob["optimizer"])
        self.optimizer = cls(groups) if groups else None
        if blob.get("state") and self.optimizer is not None:
            self._load(blob["state"])

    def _local_groups(self) -> list[dict[str, Any]]:
        assert self.optimizer is not None
        return self.optimizer.state_dict()["param_groups"]

    def _load(self, state: dict[int, Any]) -> None:
        """Optimizer state keyed by the workers' parameter indices (this server's share of them)."""
        assert self.optimizer is not None
        local = {g: i for i, g in enumerate(self.indices)}
        self.optimizer.load_state_dict({
            "state": {local[g]: s for g, s in state.items() if g in local},
            "param_groups": self._local_groups(),
        })

    def state(self) -> dict[int, Any]:
        """This server's optimizer state keyed by the workers' parameter indices."""
        if self.optimizer is None:
            return {}
        # The local state dict numbers the parameters group by group, in the order the groups hold them.
        order = [id(p) for g in self.optimizer.param_groups for p in g["params"]]
        position = {id(p): self.indices[i] for i, p in enumerate(self.params)}
        local = self.optimizer.state_dict()["state"]
        return {position[order[i]]: s for i, s in local.items()}

    def restore(self, blob: dict[str, Any]) -> None:
        """Worker 0's LOAD: the groups' settings and the optimizer state."""
        self.settings(blob["settings"])
        if self.optimizer is not None:
            self._load(blob["state"])

    def settings(self, groups: list[dict[str, Any]]) -> None:
        if self.optimizer is None:
            return
        for mine, gi in zip(self.optimizer.param_groups, self.group_of):
            mine.update({k: v for k, v in groups[gi].items() if k != "params"})

    # -- the step ---------------------------------------------------------------------------------------------

    def _apply(self, pushes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Gradients (each divided by the number of workers, added in the order given), then one step."""
        self.version += 1
        if self.optimizer is None:
            return  # more servers than tensors: this one holds none
        self.grad_flat.zero_()
        have = torch.zeros(len(self.params), dtype=torch.bool)
        for mask, grads in pushes:
            self.grad_flat += grads / self.workers
            have |= mask.bool()
        for p, g, h in zip(self.params, self.grads, have.tolist()):
            p.grad = g if h else None
        self.optimizer.step()
        for p in self.params:
            p.grad = None

    def _lead(self, w: int) -> int:
        running = [c for c, s in zip(self.clocks, self.stopped) if not s]
        return self.clocks[w] - min(running) if running else 0

    def push(self, w: int, clock: int, computed_on: int, mask: torch.Tensor,
             grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One gradient of worker ``w``; returns the reply: its header and the parameters to send."""
        with self.lock:
            lag = self.version - computed_on
            if self.mode == "sync":
                self._meet(Op.PUSH, w, (mask, grads), lambda got: self._apply([got[i] for i in range(self.workers)]))
            else:
                self._apply([(mask, grads)])
            self.clocks[w] = clock + 1
            self.lock.notify_all()
            start = time.perf_counter()
            if self.mode == "async" and self.staleness is not None:
                while self._lead(w) > self.staleness and self.failure is None:
                    self.lock.wait(timeout=1.0)
            waited = time.perf_counter() - start
            lead = self._lead(w) if self.mode == "async" else 0  # sync: every worker is at the same step
            return header(Op.PUSH, self.version, lag, lead, int(waited * 1e6)), self.flat.clone()

    def _meet(self, op: int, w: int, item: Any, act: Any) -> None:
        """Wait (holding the lock's condition) until every worker brought its ``item``; the last one calls ``act``."""
        r = self.rounds[op]
        generation = r.generation
        r.arrived[w] = item
        if len(r.arrived) == self.workers:
            got, r.arrived = r.arrived, {}
            act(got)
            r.generation += 1
            self.lock.notify_all()
            return
        while r.generation == generation and self.failure is None:
            if gone := [v for v in range(self.workers) if self.stopped[v] and v not in r.arrived]:
                raise RuntimeError(
                    f"worker {gone[0]} left (it closed its ParameterServerOptimizer or exited) while worker {w} "
                    "waits for it in a synchronous request: every worker must take the same steps (or use "
                    "mode='async')"
                )
            self.lock.wait(timeout=1.0)
        if self.failure is not None:
            raise RuntimeError("another worker's thread of this parameter server failed") from self.failure

    # -- serving ----------------------------------------------------------------------------------------------

    def _send(self, w: int, head: torch.Tensor, payload: torch.Tensor | None = None) -> None:
        self.pg.send([head], w, TAG_TO_WORKER).wait()
        if payload is not None and payload.numel():
            self.pg.send([payload], w, TAG_TO_WORKER).wait()

    def serve_worker(self, w: int) -> None:
        pg = self.pg
        while True:
            h = torch.zeros(HEADER, dtype=torch.int64)
            try:
                pg.recv([h], w, TAG_HEADER).wait()
            except RuntimeError as e:
                if not any(word in str(e).lower() for word in ("closed", "reset by peer")):
                    raise
                # The worker's process ended without a STOP (a script that never closed the optimizer, or a
                # crash, which its supervisor reports): it no longer takes part.
                h = header(Op.STOP)
            op = int(h[0])
            if op == Op.SETUP:
                self.setup(from_bytes(recv_blob(pg, w, TAG_TO_SERVER, int(h[1]))))
                self.ready.set()
                continue
            self.ready.wait()
            if op == Op.PUSH:
                mask = torch.empty(len(self.params), dtype=torch.uint8)
                grads = torch.empty_like(self.flat)
                if mask.numel():
                    pg.recv([mask], w, TAG_TO_SERVER).wait()
                if grads.numel():
                    pg.recv([grads], w, TAG_TO_SERVER).wait()
                self._send(w, *self.push(w, int(h[1]), int(h[2]), mask, grads))
            elif op == Op.PULL:
                with self.lock:
                    out, version = self.flat.clone(), self.version
                self._send(w, header(Op.PULL, version), out)
            elif op == Op.STATE:
                with self.lock:
                    blob = to_bytes(self.state())
                self._send(w, header(Op.STATE, blob.numel()), blob)
            elif op == Op.LOAD:
                data = from_bytes(recv_blob(pg, w, TAG_TO_SERVER, int(h[1]))) if int(h[1]) else None
                with self.lock:
                    self._meet(Op.LOAD, w, data, lambda got: self.restore(got[0]))
                self._send(w, header(Op.LOAD))
            elif op == Op.SETTINGS:
                groups = from_bytes(recv_blob(pg, w, TAG_TO_SERVER, int(h[1])))
                with self.lock:
                    self.settings(groups)
            elif op == Op.STOP:
                with self.lock:
                    self.stopped[w] = True
                    self.lock.notify_all()
                return
            else:
                raise RuntimeError(f"parameter server {self.place.index}: unknown request {op} from worker {w}")

    def serve(self) -> None:
        """Serve every worker until all said STOP; a failure in any worker's thread fails the server."""
        def run(w: int) -> None:
            try:
                self.serve_worker(w)
            except BaseException as e:  # noqa: BLE001 - re-raised by the main thread
                with self.lock:
                    self.failure = self.failure or e
                    self.lock.notify_all()
                self.ready.set()

        threads = [threading.Thread(target=run, args=(w,), name=f"ps-worker{w}", daemon=True)
                   for w in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.5)
                if self.failure is not None:
                    raise RuntimeError(f"parameter server {self.place.index} failed: {self.failure}") from self.failure
        if self.failure is not None:
            raise RuntimeError(f"parameter server {self.place.index} failed: {self.failure}") from self.failure


def main() -> int:
    """A server process: join the channel from the environment, serve until every worker is done (a worker
    whose process ended without closing counts as done; its supervisor reports it if it failed); 0, or 2 for
    a process that is not a server. A failure raises."""
    try:
        place = ps_place(os.environ)
    except ValueError as e:
        print(f"ddpkit parameter server: {e}", file=sys.stderr)
        return 2
    if place is None or place.role != "server":
        print("ddpkit parameter server: not a server process (DDPKIT_ROLE=server and DDPKIT_NUM_SERVERS are set by "
              "ddpkit launch --num-servers K and ddpkit train)", file=sys.stderr)
        return 2
    set_process_name(f"ddpkit-server{place.index}")  # what ps and top show (the tests find it so, too)
    torch.set_num_threads(1)
    ParameterServer(connect(place), place).serve()
    return 0


if __name__ == "__main__":
    # The process ends without the interpreter's teardown: a Gloo group torn down by it would abort the process.
    try:
        code = main()
    except Exception:  # noqa: BLE001 - reported, then the exit code says it
        traceback.print_exc()
        code = 1
    exit_now(code)

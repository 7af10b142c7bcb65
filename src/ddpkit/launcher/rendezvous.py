"""The launchers' rendezvous in a multi-node job: one store, restart rounds, failures, heartbeats.

With ``--nnodes`` above 1, node 0's launcher serves the job's TCP store on
``MASTER_ADDR:MASTER_PORT`` for the whole job (the workers reach it as
torchrun's "agent store", ``TORCHELASTIC_USE_AGENT_STORE=true``) and every
other launcher connects to it. Through it the launchers share:

round
    The attempt every node runs (``TORCHELASTIC_RESTART_COUNT``). After a
    failure every launcher tears its workers down and, with restarts left,
    starts the next round; a launcher started later (a node that came back)
    joins the round in progress.
failure
    The first failure of a round, recorded by the node where it happened:
    node, rank, how it ended and its last error line. Every other launcher
    polls for it (:data:`POLL_S`) and stops its workers at once.
heartbeat
    Every launcher writes one each :data:`BEAT_S`; node 0's launcher declares
    a node failed when its heartbeat is :data:`STALE_S` old (killed, cut off),
    and the others declare node 0 failed when the store stops answering.

Keys live under the job's secret prefix (see :func:`ddpkit.runtime.group.job_keys`).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from ddpkit.runtime.network import BoundedStore, loopback_listener
from ddpkit.runtime.options import ConfigError

POLL_S = 0.5
"""How often a launcher looks for another node's failure."""
BEAT_S = 1.0
"""How often each launcher writes its heartbeat."""
STALE_S = 6.0
"""A node whose launcher has not written a heartbeat for this long has failed."""
OP_TIMEOUT_S = 5.0
"""Longest a store operation may take: over a cut link a request is never answered."""


@dataclass(frozen=True)
class RemoteFailure:
    """The first failure of a round, as every node's launcher learns it."""

    node: int
    rank: int | None
    what: str
    """How it ended (``exit code 1``, ``killed by SIGKILL``, ``stopped answering``...)."""
    detail: str = ""
    """Its last error line, or the stall report's summary."""

    def describe(self) -> str:
        who = f"node {self.node}" + (f", rank {self.rank}," if self.rank is not None else "")
        return f"{who} failed first: {self.what}" + (f"\n  {self.detail}" if self.detail else "")


class NodeRendezvous:
    """This launcher's connection to the job's store (node 0's launcher serves it)."""

    def __init__(self, *, host: str, port: int, node: int, nnodes: int, token: str | None, timeout_s: float) -> None:
        import torch.distributed as dist

        from ddpkit.runtime.rendezvous import job_keys

        self.node, self.nnodes = node, nnodes
        self.serving = node == 0
        try:
            listen = {}
            if self.serving and (fd := loopback_listener(host, port)) is not None:
                listen = {"master_listen_fd": fd}
            raw = dist.TCPStore(host, port, None, self.serving, timeout=timedelta(seconds=timeout_s),
                                wait_for_workers=False, **listen)
        except Exception as e:  # noqa: BLE001 - torch raises several types here
            where = f"{host}:{port}"
            if self.serving:
                raise ConfigError(f"node 0 could not serve the rendezvous on {where} ({e}): choose a free "
                                  "--master-port") from None
            raise ConfigError(f"node {node} could not reach the rendezvous at {where} within {timeout_s:g} s "
                              f"({type(e).__name__}): start node 0's launcher, and give every node the same "
                              "--master-addr/--master-port") from None
        self.raw = raw
        self._store = dist.PrefixStore(f"{job_keys(token)[1]}launch/", raw)
        self.store = BoundedStore(self._store, OP_TIMEOUT_S)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat()
        self._beater = threading.Thread(target=self._beat_loop, name="ddpkit-launch-heartbeat", daemon=True)
        self._beater.start()

    # -- rounds ------------------------------------------------------------

    def current_round(self) -> int:
        """The round in progress (0 for a new job); a node that comes back joins it."""
        with self._lock:
            return int(self.store.get("round")) if self.store.check(["round"]) else 0

    def begin(self, round_: int) -> None:
        """This node starts ``round_``; its heartbeat is judged from now on (a node that
        has not joined a round yet is waited for by its workers' census instead)."""
        self._beat()
        with self._lock:
            self.store.set("round", str(round_))
            self.store.set(f"joined/{round_}/{self.node}", "1")

    # -- failures ----------------------------------------------------------

    def record(self, round_: int, failure: RemoteFailure) -> RemoteFailure:
        """Record ``failure`` unless another node's came first; return the first."""
        with self._lock:
            if self.store.add(f"failed/{round_}/count", 1) == 1:
                self.store.set(f"failed/{round_}", json.dumps(failure.__dict__))
                return failure
        return self.first_failure(round_, wait=True) or failure

    def first_failure(self, round_: int, wait: bool = False) -> RemoteFailure | None:
        """The round's first failure, if any node recorded one (``wait``: it is being written)."""
        deadline = time.monotonic() + (2.0 if wait else 0.0)
        while True:
            with self._lock:
                if self.store.check([f"failed/{round_}"]):
                    return RemoteFailure(**json.loads(self.store.get(f"failed/{round_}")))
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def watch(self, round_: int) -> RemoteFailure | None:
        """One look: another node's failure, a node gone silent (node 0), or node 0 gone (the others)."""
        try:
            if failure := self.first_failure(round_):
                return failure
            if self.serving:
                for node, age in self.silent_nodes(round_):
                    return self.record(round_, RemoteFailure(
                        node, None, f"its launcher stopped answering ({age:.0f} s without a heartbeat)",
                        "the machine is down, the launcher was killed, or the network to it is cut"))
        except Exception as e:  # noqa: BLE001 - the store is gone with node 0
            return RemoteFailure(0, None, f"the rendezvous it serves stopped answering ({type(e).__name__})",
                                 "node 0 is down, its launcher was killed, or the network to it is cut")
        return None

    def silent_nodes(self, round_: int) -> list[tuple[int, float]]:
        """Nodes that joined ``round_`` and have written no heartbeat for :data:`STALE_S`."""
        now = time.time()
        with self._lock:
            joined = [n for n in range(self.nnodes) if n != self.node and self.store.check([f"joined/{round_}/{n}"])]
            keys = [f"alive/{n}" for n in joined]
            present = [k for k in keys if self.store.check([k])]
            beats = self.store.multi_get(present) if present else []
        return [(int(k.split("/")[1]), now - float(b)) for k, b in zip(present, beats) if now - float(b) > STALE_S]

    # -- the end -----------------------------------------------------------

    def finish(self, round_: int, ok: bool, timeout_s: float = 60.0) -> RemoteFailure | None:
        """Say this node is done; node 0 then waits (bounded) for every node, since the store dies with it.

        Returns a failure another node reported meanwhile (node 0 only).
        """
        try:
            with self._lock:
                self.store.set(f"done/{round_}/{self.node}", "ok" if ok else "failed")
            if not self.serving:
                return None
            deadline = time.monotonic() + timeout_s
            keys = [f"done/{round_}/{n}" for n in range(self.nnodes)]
            while time.monotonic() < deadline:
                if failure := self.watch(round_):
                    return failure
                with self._lock:
                    if self.store.check(keys):
                        return None
                time.sleep(POLL_S)
        except Exception:  # noqa: BLE001 - the job is over; the store may be gone
            return None
        return None

    def close(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        with self._lock:
            self.store.set(f"alive/{self.node}", repr(time.time()))

    def _beat_loop(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - node 0 gone: watch() reports it
                return


def rendezvous_timeout() -> float:
    """How long a launcher waits for node 0's store: the workers' rendezvous timeout (``DDPKIT_TIMEOUT``)."""
    from ddpkit.runtime.group import timeouts

    try:
        return timeouts()[0]
    except ValueError as e:
        raise ConfigError(str(e)) from None

"""Dynamic rendezvous (``--rdzv-backend c10d``): nodes agree on their ranks and world size, elastically.

Every node's launcher is started the same way, with no ``--node-rank``:
``--rdzv-endpoint HOST[:PORT] --rdzv-id JOB --nnodes MIN:MAX``. The launcher
whose machine has the endpoint's address serves the store there (the first
to bind it, when several run on one machine; ``is_host`` in ``--rdzv-conf``
overrides); the others connect to it. The job then runs in rounds:

joining
    A launcher takes the next ticket of the round. The holder of ticket 0
    closes the round once ``MIN`` nodes have joined and either ``MAX`` have
    or ``last_call_timeout`` has passed since ``MIN`` was reached; the first
    ``N`` tickets (``N <= MAX``) are its nodes, in ticket order: node rank,
    and the first global rank of each node is the sum of the workers of
    the nodes before it. Fewer than ``MIN`` within ``join_timeout``: the
    launcher fails with a message saying how many came.
running
    As with a static job (:class:`~ddpkit.launcher.node_rendezvous.NodeRendezvous`):
    a failure anywhere stops every node, a node silent for
    ``keep_alive_interval x keep_alive_max_attempt`` seconds has failed.
    A launcher that arrives while a round runs waits; if the round has
    fewer than ``MAX`` nodes, the running nodes stop their workers and
    everyone forms the next round with it (not counted as a restart, as
    torchrun). If the round is full, it waits for the next one.
the next round
    After a failure, the nodes still there form the next round, which counts
    against ``--max-restarts``. Workers of the new round get new ranks and
    a new ``WORLD_SIZE``; ``ddpkit train`` resumes from its newest checkpoint
    at that world size.

The node serving the store cannot leave: when it goes, the job ends (as
with torchrun's c10d backend), and every other launcher says so.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from dataclasses import dataclass

from ddpkit.launcher.plan import NodeSlot
from ddpkit.launcher.node_rendezvous import POLL_S, NodeRendezvous, RemoteFailure
from ddpkit.launcher.settings import LaunchSettings
from ddpkit.runtime.network import is_local
from ddpkit.runtime.options import ConfigError


_TICKETS_READ = 64
"""The waiting nodes' tickets of a round whose marks a launcher reads (a counter a stranger raised to billions
would have it read forever; a round with more waiting nodes than that is no job's)."""


class RendezvousClosed(Exception):
    """The job ended (or cannot go on) while this launcher waited to join a round."""

    def __init__(self, message: str, ok: bool):
        super().__init__(message)
        self.ok = ok


@dataclass(frozen=True)
class Round:
    """One formed round: its number, this node's place, and the restarts used before it."""

    number: int
    slot: NodeSlot
    restarts: int
    nodes: list[dict]


class DynamicRendezvous(NodeRendezvous):
    """This launcher's part in a c10d-style rendezvous: rounds of nodes agreed at the endpoint."""

    def __init__(self, launch: LaunchSettings, token: str | None) -> None:
        host, port = launch.endpoint
        self.launch = launch
        self.conf = launch.conf
        self.node, self.nnodes = -1, launch.max_nodes
        self.node_id = uuid.uuid4().hex[:12]
        self.addr = launch.config.local_addr or socket.getfqdn()
        beat_s, self.stale_s = launch.keep_alive()
        serve = self.conf["is_host"] if self.conf["is_host"] is not None else is_local(host)
        self._connect(host, port, serve=bool(serve), token=token, timeout_s=float(self.conf["read_timeout"]),
                      fall_back=self.conf["is_host"] is None, beat_s=beat_s)
        self._members: dict[int, dict[int, str]] = {}

    def _unreachable(self, serving: bool, error: Exception, timeout_s: float) -> ConfigError:
        if serving:
            return ConfigError(f"could not serve the rendezvous on {self.where} ({error}): the port is busy; "
                               "choose another --rdzv-endpoint port, or drop is_host from --rdzv-conf")
        return ConfigError(f"could not reach the rendezvous at {self.where} within {timeout_s:g} s "
                           f"({type(error).__name__}): start the launcher on the endpoint's machine too, give every "
                           "node the same --rdzv-endpoint, or raise read_timeout in --rdzv-conf")

    @property
    def judges(self) -> bool:
        return True  # every node watches every other node's heartbeat

    def store_lost(self, error: Exception) -> RemoteFailure:
        from ddpkit.runtime.sealed_store import ForgedValue

        if isinstance(error, ForgedValue):  # the store answers, with a value the job's secret did not seal
            return super().store_lost(error)
        return RemoteFailure(-1, None, f"the rendezvous at {self.where} stopped answering ({type(error).__name__})",
                             "the node serving it is down, its launcher was killed, or the network to it is cut; "
                             "the job cannot go on without it")

    # -- forming a round ----------------------------------------------------

    def current_round(self) -> int:
        with self._lock:
            return int(self.store.get("round")) if self.store.check(["round"]) else 0

    def join(self, round_: int) -> Round:
        """Join ``round_`` (or, arriving late, the next round that forms); return it once formed.

        Raises:
            RendezvousClosed: the job ended while this launcher waited, or no
                restart is left for the next round.
            ConfigError: fewer than ``MIN`` nodes within ``join_timeout``.
        """
        while True:
            with self._lock:
                if not self.store.check(["round"]) or int(self.store.get("round")) < round_:
                    self.store.set("round", str(round_))
                late = self.store.check([f"r/{round_}/closed"])
            if late:
                self._wait_for_next(round_)
                round_ += 1
                continue
            with self._lock:
                ticket = self.store.add(f"r/{round_}/count", 1) - 1
                me = {"id": self.node_id, "addr": self.addr, "nproc": self.launch.nproc}
                self.store.set(f"r/{round_}/node/{ticket}", json.dumps(me))
            closed = self._close(round_) if ticket == 0 else self._wait_closed(round_)
            if "over" in closed:
                raise RendezvousClosed(closed["over"], ok=False)
            if ticket < closed["n"]:
                return self._formed(round_, ticket, closed)
            self._wait_for_next(round_)  # the round was full
            round_ += 1

    def _close(self, round_: int) -> dict:
        """Ticket 0: wait for ``MIN`` nodes, then the last call; publish who is in the round."""
        launch, conf = self.launch, self.conf
        deadline = time.monotonic() + float(conf["join_timeout"])
        last_call = None
        while True:
            with self._lock:
                count = int(self.store.add(f"r/{round_}/count", 0))
            if count >= launch.min_nodes and last_call is None:
                last_call = time.monotonic() + float(conf["last_call_timeout"])
            if count >= launch.max_nodes or (last_call is not None and time.monotonic() >= last_call):
                break
            if last_call is None and time.monotonic() >= deadline:
                raise ConfigError(
                    f"rendezvous round {round_}: {count} of the {launch.min_nodes} nodes needed (--nnodes "
                    f"{launch.min_nodes}:{launch.max_nodes}) joined within join_timeout {conf['join_timeout']:g} s: "
                    "start the other nodes' launchers with the same --rdzv-endpoint, --rdzv-id and secret, or raise "
                    "join_timeout in --rdzv-conf")
            time.sleep(0.05)
        restarts = self._restarts_before(round_)
        closed: dict = {"n": min(count, launch.max_nodes), "restarts": restarts}
        if restarts > launch.config.max_restarts:
            closed = {"n": 0, "over": f"the job failed and no restart is left (--max-restarts "
                                      f"{launch.config.max_restarts})"}
        with self._lock:
            self.store.set(f"r/{round_}/closed", json.dumps(closed))
        return closed

    def _restarts_before(self, round_: int) -> int:
        if round_ == 0:
            return 0
        with self._lock:
            if not self.store.check([f"r/{round_ - 1}/closed"]):
                return 0
            before = json.loads(self.store.get(f"r/{round_ - 1}/closed")).get("restarts", 0)
            failed = self.marked(f"failed/{round_ - 1}")
        return int(before) + int(failed)

    def _wait_closed(self, round_: int) -> dict:
        deadline = time.monotonic() + float(self.conf["join_timeout"]) + 5.0
        while time.monotonic() < deadline:
            with self._lock:
                if self.store.check([f"r/{round_}/closed"]):
                    return json.loads(self.store.get(f"r/{round_}/closed"))
            time.sleep(0.05)
        raise ConfigError(f"rendezvous round {round_} did not form within join_timeout {self.conf['join_timeout']:g} s "
                          f"(the node that opened it went away?): start this launcher again")

    def _formed(self, round_: int, ticket: int, closed: dict) -> Round:
        with self._lock:
            nodes = [json.loads(self.store.get(f"r/{round_}/node/{i}")) for i in range(closed["n"])]
        self._members[round_] = {i: node["id"] for i, node in enumerate(nodes)}
        host, port = self.launch.endpoint
        slot = NodeSlot(node_rank=ticket, nnodes=len(nodes), rank_base=sum(n["nproc"] for n in nodes[:ticket]),
                        world_size=sum(n["nproc"] for n in nodes), master_addr=host, master_port=port, round=round_)
        self.node = ticket
        return Round(round_, slot, int(closed["restarts"]), nodes)

    def _wait_for_next(self, round_: int) -> None:
        """Wait (heartbeating) while ``round_`` runs without this node; return when the next round opens."""
        with self._lock:  # a ticket, and under it this node's sealed mark: a stranger's bump of the counter is none
            ticket = self.store.add(f"waiting/{round_}", 1)
            self.store.set(f"waiting/{round_}/{ticket}", self.node_id)
        while True:
            try:
                with self._lock:
                    if int(self.store.get("round")) > round_:
                        return
                    over = self.store.get("over").decode() if self.store.check(["over"]) else None
                over = over or self._round_over(round_)
            except Exception as e:  # noqa: BLE001 - the serving node is gone
                raise RendezvousClosed(self.store_lost(e).describe(), ok=False) from None
            if over is not None:
                raise RendezvousClosed(f"the job ended ({over}) before this node could join it", ok=over == "ok")
            time.sleep(POLL_S)

    def _round_over(self, round_: int) -> str | None:
        """``ok``/``failed`` once every node of ``round_`` has said it is done (the job ended), else None."""
        with self._lock:
            closed = json.loads(self.store.get(f"r/{round_}/closed"))
            ids = [json.loads(self.store.get(f"r/{round_}/node/{i}"))["id"] for i in range(closed.get("n", 0))]
            keys = [f"done/{round_}/{i}" for i in ids]
            if not ids or not self.store.check(keys):
                return None
            ends = [v.decode() for v in self.store.multi_get(keys)]
        return "ok" if all(e == "ok" for e in ends) else "failed"

    # -- while a round runs ---------------------------------------------------

    def members(self, round_: int) -> dict[int, str]:
        return self._members.get(round_, {})

    def finishers(self, round_: int) -> list[str]:
        return list(self.members(round_).values())

    def declared_change(self, round_: int) -> str | None:
        try:
            with self._lock:
                if self.store.check([f"change/{round_}"]):
                    return self.store.get(f"change/{round_}").decode()
        except Exception:  # noqa: BLE001 - the store is gone: no change was declared
            return None
        return None

    def membership_change(self, round_: int) -> str | None:
        """Why ``round_`` should end for a new round (a node waits and there is room), else None."""
        if change := self.declared_change(round_):
            return change
        with self._lock:
            tickets = min(int(self.store.add(f"waiting/{round_}", 0)), _TICKETS_READ)
            waiting = sum(self.marked(f"waiting/{round_}/{t}") for t in range(1, tickets + 1))
            if waiting and len(self.members(round_)) < self.launch.max_nodes:
                why = (f"{waiting} node(s) arrived and the job has room "
                       f"(--nnodes {self.launch.min_nodes}:{self.launch.max_nodes})")
                self.store.set(f"change/{round_}", why)
                return why
        return None

    def finish(self, round_: int, ok: bool, timeout_s: float = 60.0) -> RemoteFailure | None:
        failure = super().finish(round_, ok, timeout_s)
        if self.serving:
            try:
                with self._lock:
                    self.store.set("over", "ok" if ok and failure is None else "failed")
                time.sleep(2 * POLL_S)  # waiting launchers read it before the store goes
            except Exception:  # noqa: BLE001 - the job is over
                pass
        return failure

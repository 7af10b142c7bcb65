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

Keys live under the job's secret prefix (see :func:`ddpkit.runtime.rendezvous.job_keys`).
The serving launcher publishes the job's verifier; a launcher started with
another secret (``DDPKIT_JOB_TOKEN``, ``--job-secret-file``) is refused before it starts any worker, with
one line naming the fix, and the running job only notes it (rank 0 prints a
line) and goes on.
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
_VERIFIER_KEY = "ddpkit/launch-job"
"""Where the serving launcher publishes the job's verifier (outside the job's secret prefix)."""


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
        if self.node < 0:  # the job's store itself
            return f"the rendezvous failed: {self.what}" + (f"\n  {self.detail}" if self.detail else "")
        who = f"node {self.node}" + (f", rank {self.rank}," if self.rank is not None else "")
        return f"{who} failed first: {self.what}" + (f"\n  {self.detail}" if self.detail else "")


class NodeRendezvous:
    """This launcher's connection to the job's store (node 0's launcher serves it)."""

    def __init__(self, *, host: str, port: int, node: int, nnodes: int, token: str | None, timeout_s: float,
                 beat_s: float = BEAT_S, stale_s: float = STALE_S) -> None:
        self.node, self.nnodes = node, nnodes
        self.node_id = str(node)
        """Names this launcher's heartbeat and its done mark (static: the node rank)."""
        self.stale_s = stale_s
        self._connect(host, port, serve=node == 0, token=token, timeout_s=timeout_s, beat_s=beat_s)

    def _connect(self, host: str, port: int, *, serve: bool, token: str | None, timeout_s: float,
                 fall_back: bool = False, beat_s: float = BEAT_S) -> None:
        """Serve (``serve``) or reach the store; ``fall_back``: serving failed, so another launcher serves it."""
        import torch.distributed as dist

        from ddpkit.runtime.rendezvous import job_keys, wait_for_listener

        self.where = f"{host}:{port}"
        self._beats: dict[str, float] = {}
        """Each other node's newest heartbeat this launcher has read (:meth:`silent_nodes`)."""
        for serving in ([serve, False] if serve and fall_back else [serve]):
            try:
                listen = {}
                if serving and (fd := loopback_listener(host, port)) is not None:
                    listen = {"master_listen_fd": fd}
                if not serving and (unreachable := wait_for_listener(host, port, time.monotonic() + timeout_s)):
                    raise unreachable  # (torch's client would log a C++ stack trace at every try)
                raw = dist.TCPStore(host, port, None, serving, timeout=timedelta(seconds=timeout_s),
                                    wait_for_workers=False, **listen)
                break
            except Exception as e:  # noqa: BLE001 - torch raises several types here
                if serving and fall_back:
                    continue
                raise self._unreachable(serving, e, timeout_s) from None
        self.serving = serving
        self.raw = raw
        self._check_secret(raw, token, serving, timeout_s)
        from ddpkit.runtime.sealed_store import seal

        scope = f"{job_keys(token)[1]}launch/"
        self._store = seal(dist.PrefixStore(scope, raw), token, scope)  # (the prefix alone hides nothing)
        self.store = BoundedStore(self._store, OP_TIMEOUT_S)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat_s = beat_s
        self._beat()
        self._beater = threading.Thread(target=self._beat_loop, name="ddpkit-launch-heartbeat", daemon=True)
        self._beater.start()

    def _check_secret(self, raw: object, token: str | None, serving: bool, timeout_s: float) -> None:
        """The serving launcher publishes the job's verifier; every other one must present the same secret."""
        import socket

        from ddpkit.runtime.rendezvous import job_keys
        from ddpkit.runtime.stall import REFUSED_KEY

        verifier = job_keys(token)[0]
        store = BoundedStore(raw, max(OP_TIMEOUT_S, timeout_s))
        if serving:
            store.set(_VERIFIER_KEY, verifier)
            return
        try:
            store.wait([_VERIFIER_KEY])
            theirs = store.get(_VERIFIER_KEY).decode()
        except Exception as e:  # noqa: BLE001 - the store's timeout error type varies by torch version
            raise ConfigError(f"node {self.node} reached the rendezvous at {self.where}, but no job opened there "
                              f"within {timeout_s:g} s ({type(e).__name__}): start the job's first node") from None
        if theirs == verifier:
            return
        n = store.add(REFUSED_KEY, 1)
        store.set(f"{REFUSED_KEY}/{n}", f"a launcher on {socket.gethostname()} joining as node {self.node} "
                                        f"{'without the job' if not token else 'with another job'}'s secret")
        raise ConfigError(
            f"the job at {self.where} refused this node: it was started with another secret (DDPKIT_JOB_TOKEN, "
            f"--job-secret-file){' and this node has none' if not token else ''}: give every node the same, or choose "
            "another --master-port / --rdzv-endpoint for a job of its own"
        )

    def _unreachable(self, serving: bool, error: Exception, timeout_s: float) -> ConfigError:
        if serving:
            return ConfigError(f"node 0 could not serve the rendezvous on {self.where} ({error}): choose a free "
                               "--master-port")
        return ConfigError(f"node {self.node} could not reach the rendezvous at {self.where} within {timeout_s:g} s "
                           f"({type(error).__name__}): start node 0's launcher, and give every node the same "
                           "--master-addr/--master-port")

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
        from ddpkit.runtime.sealed_store import ForgedValue

        mine = json.dumps(failure.__dict__)
        with self._lock:
            try:  # set where absent, in one step: a counter would be any store client's to raise
                first = self.store.compare_set(f"failed/{round_}", "", mine)
            except ForgedValue:  # a process without the secret wrote there first: the real first failure over it
                self.store.set(f"failed/{round_}", mine)
                return failure
        return failure if first.decode() == mine else RemoteFailure(**json.loads(first))

    def marked(self, key: str) -> bool:
        """Whether ``key`` holds a mark a launcher of the job wrote (one a store client forged is none)."""
        from ddpkit.runtime.sealed_store import marked  # (torch's, imported once a launcher needs it)

        return marked(self.store, key)

    def peek(self, key: str) -> bytes | None:
        """``key``'s value, or None where it has none (one look, never a wait; a forged one raises ForgedValue)."""
        from ddpkit.runtime.sealed_store import peek

        return peek(self.store, key)

    def first_failure(self, round_: int) -> RemoteFailure | None:
        """The round's first failure, if any node recorded one."""
        with self._lock:
            if self.store.check([f"failed/{round_}"]):
                return RemoteFailure(**json.loads(self.store.get(f"failed/{round_}")))
        return None

    def watch(self, round_: int) -> RemoteFailure | None:
        """One look: another node's failure, a node gone silent (node 0), or node 0 gone (the others)."""
        try:
            if failure := self.first_failure(round_):
                return failure
            if self.judges:
                for node, age in self.silent_nodes(round_):
                    return self.record(round_, RemoteFailure(
                        node, None, f"its launcher stopped answering ({age:.0f} s without a heartbeat)",
                        "the machine is down, the launcher was killed, or the network to it is cut"))
        except Exception as e:  # noqa: BLE001 - the store is gone with the node serving it
            return self.store_lost(e)
        return None

    def declared_change(self, round_: int) -> str | None:
        """Why another node ended ``round_`` for a new membership (elastic only; static rounds never change)."""
        return None

    def store_lost(self, error: Exception) -> RemoteFailure:
        from ddpkit.runtime.sealed_store import ForgedValue

        if isinstance(error, ForgedValue):  # the store answers, with a value the job's secret did not seal
            return RemoteFailure(0, None, f"its rendezvous store holds a forged value: {error}",
                                 "a process without the job's secret wrote into the store")
        return RemoteFailure(0, None, f"the rendezvous it serves stopped answering ({type(error).__name__})",
                             "node 0 is down, its launcher was killed, or the network to it is cut")

    @property
    def judges(self) -> bool:
        """Whether this launcher declares silent nodes failed (static: node 0; the others watch node 0's store)."""
        return self.serving

    def members(self, round_: int) -> dict[int, str]:
        """Node rank -> node id of the nodes in ``round_`` (static: those that joined it)."""
        with self._lock:
            return {n: str(n) for n in range(self.nnodes) if self.marked(f"joined/{round_}/{n}")}

    def silent_nodes(self, round_: int) -> list[tuple[int, float]]:
        """Nodes of ``round_`` that have written no heartbeat for :attr:`stale_s`."""
        now = time.time()
        others = {n: i for n, i in self.members(round_).items() if i != self.node_id}
        with self._lock:
            # A node whose workers all finished may exit before the others do: done, not silent.
            present = {n: i for n, i in others.items() if not self.marked(f"done/{round_}/{i}")}
            beats = {i: self.peek(f"alive/{i}") for i in present.values()}
        silent = []
        for n, i in present.items():
            # Each node's newest beat seen so far: a store client may delete its heartbeat (which a dead node
            # would not write again) or put back an older one (a seal binds a value to its key, not its moment).
            seen = self._beats.get(i)
            if beats[i] is not None:
                seen = float(beats[i]) if seen is None else max(seen, float(beats[i]))
            self._beats[i] = now if seen is None else seen
            if now - self._beats[i] > self.stale_s:
                silent.append((n, now - self._beats[i]))
        return silent

    # -- the end -----------------------------------------------------------

    def finish(self, round_: int, ok: bool, timeout_s: float = 60.0) -> RemoteFailure | None:
        """Say this node is done; node 0 then waits (bounded) for every node, since the store dies with it.

        Returns a failure another node reported meanwhile (node 0 only).
        """
        try:
            with self._lock:
                self.store.set(f"done/{round_}/{self.node_id}", "ok" if ok else "failed")
        except Exception:  # noqa: BLE001 - the job is over; node 0's store may be gone with it
            return None
        if not self.serving:
            return None
        try:  # (this node's own store: an error here is no end of the job, and the others still use it)
            deadline = time.monotonic() + timeout_s
            keys = [f"done/{round_}/{i}" for i in self.finishers(round_)]
            while time.monotonic() < deadline:
                if failure := self.watch(round_):
                    return failure
                with self._lock:
                    if all(self.marked(key) for key in keys):
                        return None
                time.sleep(POLL_S)
        except Exception as e:  # noqa: BLE001 - a key of the end deleted or forged meanwhile, or the store broken
            return self.store_lost(e)
        return None

    def finishers(self, round_: int) -> list[str]:
        """The nodes whose end the serving launcher waits for (static: every node of the job)."""
        return [str(n) for n in range(self.nnodes)]

    def close(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        with self._lock:
            self.store.set(f"alive/{self.node_id}", repr(time.time()))

    def _beat_loop(self) -> None:
        while not self._stop.wait(self._beat_s):
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

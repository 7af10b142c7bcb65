"""Several nodes under ``--on-failure continue``: the nodes' launchers agree on every membership by majority.

On one node the launcher is the job, and its word is the membership. Across
nodes every launcher (an *agent*) sees only its own workers die, and any
agent, the one serving the job's store included, may die or be cut off. So
the agents hold the job's state together as a log of :class:`Entry` (the
workers' membership generation and members, the voting nodes, the store the
workers build their groups on), and each entry is decided by a majority of
the nodes of the entry before it, Paxos-style: a proposer's ballot is
promised by a majority, a value accepted by a majority is what a later
proposer must carry on, then it is committed to every node. Two majorities
of the same nodes share a node, so no two entries are ever decided for one
place of the log.

Roles:

reports
    Every agent sends each other one a beat every :data:`BEAT_S` carrying its
    report (its workers that died, replacements ready or holding the state,
    whether its workers are done), and at once when the report changes.
leader
    The lowest-numbered node of the last entry that is still heard proposes
    the next entry: it removes the members that died and the nodes not heard
    for ``suspect_s`` (:data:`SUSPECT_S`, 6 s by default, from ``--rdzv-conf``'s
    keep-alive; a killed launcher is noticed a second after its connections
    close, when dialing it again fails), admits replacements, and moves the workers' store to
    the lowest node left (each agent serves one from the start).
spares
    Under ``--nnodes MIN:MAX`` nodes MIN..MAX-1 may come while the job runs.
    A spare's agent dials every seat published in node 0's store, learns the
    newest entry from the first answer, and says in its report that it is a
    *candidate* (asks to vote); the leader's next entry makes it a voting node (decided by the
    majority of the nodes before it, as every entry). Its workers then join
    as replacements do, with the state from a peer.
minority
    An agent that hears fewer than a majority of the last entry's nodes for
    ``suspect_s`` stops its workers: a node cut off never trains alone
    (split brain is refused). With two nodes a node's loss therefore stops
    the job, as no side is a majority.
return
    An agent that an entry leaves out while it still runs (it was paused,
    or its beats were held up, longer than ``suspect_s``: wrongly suspected)
    learns it from the next entry, stops its workers (their members are out
    of the job) and asks to vote again as a spare does, under its own node
    number; the next entry makes it a voting node again and its workers join
    with the state from a peer. Not once training is over: then it ends as a
    node cut off does.

Only the job's launchers take part: each connection proves the job's secret
in a handshake that binds both nonces, both node ids and both roles, and
every later message is sealed with a session key and a sequence number
(:mod:`ddpkit.launcher.council_link`).
"""

from __future__ import annotations

import enum
import hmac
import json
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ddpkit.launcher.council_link import Connection, close_socket, handshake
from ddpkit.runtime.discovery import job_key
from ddpkit.runtime.network import loopback_listener
from ddpkit.runtime.states import check_move

__all__ = ["BEAT_S", "SUSPECT_S", "Council", "Entry", "Report", "Role"]

BEAT_S = 0.1
"""How often an agent sends its report to every other."""
SUSPECT_S = 6.0
"""By default, an agent not heard for this long has failed (the majority removes it; a minority stops itself):
torchrun's keep-alive, ``keep_alive_interval`` (1 s) times ``keep_alive_max_attempt`` (6), which ``--rdzv-conf``
sets for the council too. A pause of a few seconds (a swapping machine, a long GC, a stopped process) is not a
death."""
REDIAL_S = 1.0
"""How long a closed connection is given to be dialed again before its agent counts as gone: a launcher that was
killed does not answer (its node is removed a second after its connections closed), a reset link does."""
_HANDSHAKES = 16
"""Handshakes answered at once (no thread per stranger): a connection beyond them shuts the oldest of those in
progress if it is older than ``_SETTLE_S`` (else the newcomer is closed: a flood), so that strangers holding every
slot with a byte now and then (each for up to ``HANDSHAKE_S``) keep no node out: a genuine handshake takes
milliseconds, theirs are the oldest."""
_SETTLE_S = 0.5
"""How long a handshake in progress keeps its slot against a newcomer."""
ROUND_S = 1.0
"""How long a proposer waits for a majority's answers before it tries again (a refusal ends the wait at once)."""


class Role(enum.Enum):
    """A node's part in the council (the module notes' roles); its moves are :data:`MOVES`."""

    SPARE = "spare"
    """Connected and asking to become a voting node: a spare, or a node left out while it ran (*return*)."""
    VOTING = "voting"
    """A node of the job: it reports, votes, and may lead."""
    STOPPED = "stopped"
    """Cut off (a minority, or left out once training was over): it takes no further part."""


class Quorum(enum.Enum):
    """Whether this node hears a majority of its entry's nodes (it stops after ``suspect_s`` without one)."""

    HEARD = "heard"
    LOST = "lost"
    """Fewer than a majority heard, since :attr:`Council._minority_since`."""


MOVES: dict[Role, frozenset[Role]] = {
    Role.SPARE: frozenset({Role.VOTING, Role.STOPPED}),  # admitted by an entry; or cut off first
    Role.VOTING: frozenset({Role.SPARE, Role.STOPPED}),  # left out while it ran: asks back; or cut off
    Role.STOPPED: frozenset(),
}
"""The moves a node's :class:`Role` may make; any other is a bug (:meth:`Council._become` raises)."""


@dataclass(frozen=True)
class Entry:
    """One decided state of the job."""

    index: int
    """Its place in the log (0: the start)."""
    generation: int
    """The workers' membership generation (it changes only with the members)."""
    members: tuple[int, ...]
    nodes: tuple[int, ...]
    """The nodes that vote on the next entry."""
    store: str
    """``host:port`` of the store the workers build this generation's groups on (served by the lowest node)."""
    finished: tuple[int, ...] = ()
    """Nodes with no worker still training."""
    succeeded: bool = False
    """Some worker finished training (exit 0)."""
    holders: tuple[int, ...] = ()
    """Replacements that hold the training state (the first members hold it from the start)."""

    @property
    def done(self) -> bool:
        """Every voting node is finished: the job is over."""
        return set(self.nodes) <= set(self.finished)

    def majority(self) -> int:
        return len(self.nodes) // 2 + 1

    @staticmethod
    def of(data: dict[str, Any]) -> Entry:
        return Entry(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


@dataclass
class Report:
    """What one agent knows of its own workers."""

    dead: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    """Its workers that finished (exit 0): they leave the membership as the dead do, but are no failure."""
    ready: list[int] = field(default_factory=list)
    holding: list[int] = field(default_factory=list)
    """Its replacements that said they hold the training state."""
    finished: bool = False
    succeeded: bool = False
    candidate: bool = False
    """A spare node (or one left out while it ran) asking to become a voting node: a *candidate*."""


class Council:
    """This agent's seat: its connections to the other agents, the log, and the reports.

    Args:
        node: this node's rank.
        places: the nodes' ``(host, council port, store address)`` by node rank: every starting node's (and a
            spare's, the seats published so far).
        listener: this agent's listening socket (the council port of ``places[node]``).
        members: the job's first members (the workers' global ranks).
        node_of: the node a member runs on.
        token: the job's secret (None: the job has none, and neither does the council).
        meet_s: how long to wait for every other agent's connection.
        starting: how many nodes started the job (nodes ``0..starting-1``; default every place).
        most: the most nodes the job may have (spares are ``starting..most-1``).
        suspect_s: how long an agent may go unheard before it counts as failed (:data:`SUSPECT_S`).

    Raises:
        RuntimeError: some agent did not connect within ``meet_s`` (or could not prove the job's secret); a
            spare: no seat answered.
    """

    def __init__(self, node: int, places: dict[int, tuple[str, int, str]], listener: socket.socket,
                 members: list[int], node_of: Callable[[int], int], token: str | None, meet_s: float = 60.0,
                 *, starting: int | None = None, most: int | None = None, suspect_s: float = SUSPECT_S) -> None:
        if not suspect_s > BEAT_S:
            raise ValueError(f"the council's failure timeout {suspect_s:g} s must be longer than its beat "
                             f"({BEAT_S:g} s): raise keep_alive_interval x keep_alive_max_attempt (--rdzv-conf)")
        self.node = node
        self.suspect_s = suspect_s
        self.places = dict(places)
        self.node_of = node_of
        self.starting = len(places) if starting is None else starting
        self.most = max(self.starting, most or 0)
        self._key = hmac.new(job_key(token) if token else b"", b"ddpkit council", "sha256").digest()
        nodes = tuple(range(self.starting))
        self.entry = Entry(0, 0, tuple(members), nodes, places[0][2])
        self.role = Role.VOTING if node < self.starting else Role.SPARE
        """This node's part (changed by :meth:`_become` alone)."""
        self.report = Report(candidate=self.role is Role.SPARE)
        self.stop_reason = ""
        """Why this node stopped taking part (set with :attr:`Role.STOPPED`: it is cut off)."""
        self.returns = 0
        """How many times an entry left this node out while it ran and it asked to vote again (module notes)."""
        self.removal = ""
        """Why it was left out the last time it asked to vote again."""
        self._cond = threading.Condition()
        self._peers: dict[int, Connection] = {}
        self._reports: dict[int, Report] = {}
        self._heard: dict[int, float] = {}
        """When each agent was last heard (``time.monotonic()``)."""
        self._closed: set[int] = set()
        """Agents whose connection closed and has not been replaced (dialed again, or redialed by them)."""
        self._redialing: set[int] = set()
        self._promised: tuple[int, int] = (0, -1)
        self._accepted: tuple[tuple[int, int], Entry] | None = None
        self._counter = 0
        self._replies: dict[str, list[dict[str, Any]]] = {}
        self._sequence = 0
        self._wake = threading.Event()
        """Something to decide may have changed (a report, a lost peer, a commit)."""
        self._told = threading.Event()
        """This node's report changed: send it now."""
        self._stop = threading.Event()
        self._answering: dict[socket.socket, float] = {}
        """The connections being answered (:meth:`_accept_loop`) and when each came."""
        self._answering_lock = threading.Lock()
        self._listener = listener
        self._quorum = Quorum.HEARD
        self._minority_since = 0.0
        """Since when a majority of the entry's nodes has not been heard (``time.monotonic()``; while
        :attr:`Quorum.LOST`)."""
        self._candidates: set[int] = set()
        """Spares connected and not yet voting nodes: they hear the beats too."""
        threading.Thread(target=self._accept_loop, name="ddpkit-council-accept", daemon=True).start()
        if self.role is Role.VOTING:
            self._connect(nodes, meet_s)
        else:
            self._dial_seats(meet_s)
        threading.Thread(target=self._beat_loop, name="ddpkit-council-beat", daemon=True).start()
        threading.Thread(target=self._tick_loop, name="ddpkit-council", daemon=True).start()

    # -- connections -------------------------------------------------------

    def _connect(self, nodes: tuple[int, ...], timeout_s: float) -> None:
        """Every pair of agents shares one connection: the higher node dials the lower, both prove the secret."""
        for other in nodes:
            if other >= self.node:
                continue
            host, port, _ = self.places[other]
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    sock = socket.create_connection((host, port), timeout=5.0)
                    break
                except OSError as e:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"node {other}'s launcher at {host}:{port} did not answer within "
                                           f"{timeout_s:g} s ({e})") from None
                    time.sleep(0.05)
            self._handshake(sock, dialed=other)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._peers) < len(nodes) - 1:
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    missing = sorted(set(nodes) - set(self._peers) - {self.node})
                    raise RuntimeError(f"node(s) {missing} did not join the job's council within {timeout_s:g} s "
                                       "(a launcher not started, or started with another secret)")

    def _dial_seats(self, timeout_s: float) -> None:
        """A spare: dial every seat published (a node lost since does not answer), then learn the newest entry."""

        def dial(other: int) -> None:
            host, port, _ = self.places[other]
            try:
                sock = socket.create_connection((host, port), timeout=min(5.0, timeout_s))
            except OSError:
                return  # its launcher is gone (or cut off): the others say what became of it
            self._handshake(sock, dialed=other)

        dials = [threading.Thread(target=dial, args=(n,), daemon=True) for n in self.places if n != self.node]
        for t in dials:
            t.start()
        for t in dials:
            t.join()
        with self._cond:
            if not self._peers:
                raise RuntimeError(f"spare node {self.node}: none of the job's launchers answered at their seats "
                                   f"(nodes {sorted(n for n in self.places if n != self.node)}): the job is over, "
                                   "or cut off from this node")
        self._told.set()  # the first beat: a peer with a newer entry answers with it

    def wait_admitted(self, timeout_s: float) -> Entry | None:
        """A spare: the first entry that names this node a voting node (None: not within ``timeout_s``, the job
        ended first, or this node was cut off)."""
        with self._cond:
            self._cond.wait_for(lambda: self.node in self.entry.nodes or self.entry.done
                                or self.role is Role.STOPPED, timeout_s)
            return self.entry if self.node in self.entry.nodes else None

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._answering_lock:
                if len(self._answering) >= _HANDSHAKES:  # strangers hold the slots: the oldest makes room
                    oldest = min(self._answering, key=self._answering.__getitem__)
                    if time.monotonic() - self._answering[oldest] < _SETTLE_S:  # a flood: refuse the newcomer
                        close_socket(sock)
                        continue
                    del self._answering[oldest]
                    close_socket(oldest)
                self._answering[sock] = time.monotonic()
            threading.Thread(target=self._answer, args=(sock,), daemon=True).start()

    def _answer(self, sock: socket.socket) -> None:
        try:
            self._handshake(sock, None)
        finally:
            with self._answering_lock:
                self._answering.pop(sock, None)

    def _may_call(self, peer: int) -> None:
        """Refuse (PermissionError, saying why) a node that may not dial this one: only higher starting nodes and
        spares do."""
        if not (self.node < peer < self.starting or self.starting <= peer < self.most):
            raise PermissionError(f"called as node {peer}: only nodes {self.node + 1}..{self.starting - 1} "
                                  f"and spares {self.starting}..{self.most - 1} call this one")

    def _handshake(self, sock: socket.socket, dialed: int | None) -> None:
        """The link's handshake (:func:`~ddpkit.launcher.council_link.handshake`), as the dialer (``dialed``: the
        node called) or the answering agent; then the connection is the peer's (a reader thread per peer)."""
        made = handshake(sock, self._key, self.node, list(self.places[self.node]), dialed, self._may_call)
        with self._answering_lock:  # settled: no longer a slot a newcomer may take
            self._answering.pop(sock, None)
        if made is None:
            return
        connection, their_place, reader = made
        peer = connection.peer
        stale = None
        with self._cond:
            if self._stop.is_set():  # this agent has left: it takes no connection any more
                sock.close()
                return
            if peer in self._peers and peer not in self._closed:
                # Two connections between one pair (two spares that dialed each other): both sides keep the one
                # the higher node dialed.
                if (self.node if dialed is not None else peer) < max(self.node, peer):
                    sock.close()
                    return
                stale = self._peers[peer].sock
            self._peers[peer] = connection
            self._closed.discard(peer)
            self._heard[peer] = time.monotonic()
            self.places.setdefault(peer, tuple(their_place))  # type: ignore[arg-type]
            if peer >= self.starting and peer not in self.entry.nodes:
                self._candidates.add(peer)
            self._cond.notify_all()
        if stale is not None:
            close_socket(stale)
        threading.Thread(target=self._read_loop, args=(peer, reader, connection), name=f"ddpkit-council-{peer}",
                         daemon=True).start()

    def _read_loop(self, peer: int, reader: Any, connection: Connection) -> None:
        try:
            for line in reader:
                if (message := connection.open(line)) is not None:
                    self._handle(peer, message)
        except (OSError, ValueError):
            pass
        with self._cond:  # its launcher is gone (killed: the kernel closed its socket), or the link was reset
            if self._peers[peer] is connection:
                # Counted as gone REDIAL_S from now unless the connection is made again meanwhile (the higher of
                # the two dials it, see _redial): a killed launcher does not answer, a reset link does.
                self._closed.add(peer)
                self._heard[peer] = min(self._heard.get(peer, 0.0), time.monotonic() - self.suspect_s + REDIAL_S)
            self._cond.notify_all()
        self._wake.set()

    def _send(self, peer: int, message: dict[str, Any]) -> None:
        if peer == self.node:
            self._handle(self.node, message)
            return
        with self._cond:
            connection = self._peers.get(peer)
        if connection is None:
            return
        try:
            connection.send(message)
        except OSError:
            pass  # its reader notices the loss

    # -- messages ----------------------------------------------------------

    def _handle(self, peer: int, message: dict[str, Any]) -> None:
        kind = message["kind"]
        with self._cond:
            if peer not in self._closed:
                self._heard[peer] = time.monotonic()
            if "re" in message:
                self._replies.setdefault(message["re"], []).append(message)
                self._cond.notify_all()
                return
            if kind == "beat":
                self._reports[peer] = Report(**message["report"])
                self._cond.notify_all()  # a confirm() may wait for its ack
                if self._reports[peer].candidate and peer not in self.entry.nodes:
                    self._candidates.add(peer)  # a spare, or a node left out that asks to come back
                behind = message["index"] < self.entry.index
                self._wake.set()
            elif kind == "commit":
                self._adopt(Entry.of(message["entry"]))
                return
            else:
                answer = self._vote(message)
        if kind == "beat":
            if behind:
                self._send(peer, {"kind": "commit", "entry": asdict(self.entry)})
            return
        answer["re"] = message["id"]
        self._send(peer, answer)

    def _vote(self, message: dict[str, Any]) -> dict[str, Any]:
        """An acceptor's answer to ``prepare`` or ``accept`` (under the lock)."""
        base = Entry.of(message["base"])
        if base.index > self.entry.index:
            self._adopt(base)  # decided before: this node missed its commit
        if base.index < self.entry.index:
            return {"kind": "newer", "entry": asdict(self.entry)}
        ballot = tuple(message["ballot"])
        if ballot < self._promised:
            return {"kind": "refused", "promised": list(self._promised)}
        self._promised = ballot  # type: ignore[assignment]
        if message["kind"] == "prepare":
            accepted = self._accepted
            return {"kind": "promise",
                    "accepted": [list(accepted[0]), asdict(accepted[1])] if accepted else None}
        self._accepted = (ballot, Entry.of(message["entry"]))  # type: ignore[assignment]
        return {"kind": "accepted"}

    def _adopt(self, entry: Entry) -> None:
        """A decided entry (under the lock)."""
        if entry.index <= self.entry.index:
            return
        self.entry = entry
        self._promised, self._accepted = (0, -1), None
        self._candidates -= set(entry.nodes)
        if self.node in entry.nodes and self.role is Role.SPARE:
            self._become(Role.VOTING)
        self._cond.notify_all()
        self._wake.set()

    # -- proposing ---------------------------------------------------------

    def _ask(self, nodes: tuple[int, ...], message: dict[str, Any], want: int) -> list[dict[str, Any]]:
        """Send ``message`` to ``nodes``; the answers, once ``want`` of one kind came, or at :data:`ROUND_S`."""
        with self._cond:
            self._sequence += 1
            ask_id = f"{self.node}.{self._sequence}"
            self._replies[ask_id] = []
        message = {**message, "id": ask_id}
        for node in nodes:
            self._send(node, message)
        deadline = time.monotonic() + ROUND_S
        with self._cond:
            def enough() -> bool:  # a refusal: another proposer holds a higher ballot, so this one cannot win
                kinds = [r["kind"] for r in self._replies[ask_id]]
                return ("newer" in kinds or "refused" in kinds
                        or max((kinds.count(k) for k in set(kinds)), default=0) >= want)
            self._cond.wait_for(lambda: enough() or len(self._replies[ask_id]) >= len(nodes),
                                max(0.0, deadline - time.monotonic()))
            return self._replies.pop(ask_id)

    def _propose(self, base: Entry, wanted: Entry) -> bool:
        """One ballot for the entry after ``base``; True once some entry was decided there."""
        with self._cond:
            self._counter = max(self._counter, self._promised[0]) + 1
            ballot = [self._counter, self.node]
        common = {"ballot": ballot, "base": asdict(base)}
        answers = self._ask(base.nodes, {"kind": "prepare", **common}, base.majority())
        if newer := [a for a in answers if a["kind"] == "newer"]:
            with self._cond:
                self._adopt(Entry.of(newer[0]["entry"]))
            return True
        promises = [a for a in answers if a["kind"] == "promise"]
        self._learn_ballots(answers)
        if len(promises) < base.majority():
            return False
        prior = [a["accepted"] for a in promises if a["accepted"]]
        value = Entry.of(max(prior, key=lambda a: tuple(a[0]))[1]) if prior else wanted
        answers = self._ask(base.nodes, {"kind": "accept", **common, "entry": asdict(value)}, base.majority())
        self._learn_ballots(answers)
        if sum(a["kind"] == "accepted" for a in answers) < base.majority():
            return False
        with self._cond:
            told = set(base.nodes) | set(value.nodes) | self._candidates
        for node in sorted(told):
            self._send(node, {"kind": "commit", "entry": asdict(value)})
        return True

    def _learn_ballots(self, answers: list[dict[str, Any]]) -> None:
        with self._cond:
            for a in answers:
                if a["kind"] == "refused":
                    self._counter = max(self._counter, a["promised"][0])

    def _wanted(self, entry: Entry, heard: set[int], candidates: set[int]) -> Entry:
        """The next entry as the leader sees the reports: ``entry`` itself when nothing changed. ``candidates``:
        spares heard that ask to vote (not once training is over)."""
        over = entry.succeeded or any(r.succeeded for r in self._reports.values())
        nodes = tuple(sorted([n for n in entry.nodes if n in heard] + ([] if over else sorted(candidates))))
        reports = {n: r for n, r in self._reports.items() if n in nodes}
        reports[self.node] = self.report
        dead = {m for r in reports.values() for m in [*r.dead, *r.left]}
        members = [m for m in entry.members if m not in dead and self.node_of(m) in nodes]
        if not over:  # a replacement admitted after the others finished would wait for them forever
            members += [m for n in nodes for m in reports.get(n, Report()).ready
                        if m not in members and m not in dead and self.node_of(m) == n]
        holders = tuple(sorted((set(entry.holders) | {m for r in reports.values() for m in r.holding})
                              & set(members)))
        changed = tuple(members) != entry.members
        return replace(entry, index=entry.index + 1, generation=entry.generation + changed, members=tuple(members),
                       nodes=nodes, store=self.places[min(nodes)][2],
                       finished=tuple(n for n in nodes if reports.get(n, Report()).finished),
                       succeeded=entry.succeeded or any(r.succeeded for r in reports.values()), holders=holders)

    def _beat_loop(self) -> None:
        while not self._stop.is_set():
            self._told.wait(BEAT_S)
            self._told.clear()
            with self._cond:
                beat = {"kind": "beat", "report": asdict(self.report), "index": self.entry.index}
                nodes = self.entry.nodes if self.role is Role.VOTING else tuple(self._peers)
                nodes = tuple(sorted(set(nodes) | self._candidates))
            for node in nodes:
                if node != self.node:
                    self._send(node, beat)
            self._redial()

    def _redial(self) -> None:
        """Dial again the lower agents whose connection closed (the higher of two always dials): a reset link
        comes back within a beat, and the agent is not lost for it."""
        with self._cond:
            wanted = [n for n in self._closed if n < self.node and n not in self._redialing and n in self.places
                      and (n in self.entry.nodes or n in self._candidates)]
            self._redialing.update(wanted)

        def dial(other: int) -> None:
            host, port, _ = self.places[other]
            try:
                sock = socket.create_connection((host, port), timeout=min(REDIAL_S, 5.0))
                self._handshake(sock, dialed=other)
            except OSError:
                pass  # gone, or not yet back: the next beat tries again while it may still count as heard
            finally:
                with self._cond:
                    self._redialing.discard(other)

        for other in wanted:
            threading.Thread(target=dial, args=(other,), name=f"ddpkit-council-redial-{other}", daemon=True).start()

    def _tick_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(BEAT_S)
            self._wake.clear()
            now = time.monotonic()
            with self._cond:
                entry = self.entry
                heard = {self.node} | {n for n in entry.nodes if self._heard_lately(n, now)}
                candidates = {n for n in self._candidates if self._heard_lately(n, now)
                              and n in self._reports and self._reports[n].candidate}
            if entry.done or self._judge_minority(entry, heard, now):
                return
            if self.node not in entry.nodes or len(heard) < entry.majority() or min(heard) != self.node:
                continue
            with self._cond:
                wanted = self._wanted(entry, heard, candidates)
            if replace(wanted, index=entry.index) != entry and not self._stop.is_set():
                if not self._propose(entry, wanted):
                    time.sleep(random.uniform(0, BEAT_S / 2))  # two proposers at once: one of them wins next

    def _heard_lately(self, node: int, now: float) -> bool:
        """Whether ``node``'s agent was heard within the failure detector's timeout (never heard: no)."""
        return node in self._heard and now - self._heard[node] < self.suspect_s

    def _judge_minority(self, entry: Entry, heard: set[int], now: float) -> bool:
        if self.node not in entry.nodes and self.role is Role.SPARE:
            heard = heard - {self.node}  # a spare not yet voting: it must still hear a majority of the job
        elif self.node not in entry.nodes:
            if entry.succeeded:
                self._give_up(self.left_out(entry))
                return True
            self._ask_back(entry)
            return False
        if len(heard & set(entry.nodes)) >= entry.majority():
            self._quorum = Quorum.HEARD
            return False
        if self._quorum is Quorum.HEARD:
            self._quorum, self._minority_since = Quorum.LOST, now
        if now - self._minority_since < self.suspect_s:
            return False
        self._give_up(f"node {self.node} hears {len(heard & set(entry.nodes))} of the job's {len(entry.nodes)} "
                      f"nodes, not a majority ({entry.majority()}): it is cut off, or the others are gone; it stops "
                      "instead of training alone (split brain refused)")
        return True

    def left_out(self, entry: Entry) -> str:
        """Why ``entry`` does not name this node (which ran when it was decided)."""
        return (f"the other nodes' majority left node {self.node} out of membership entry {entry.index} (it was "
                f"not heard for {self.suspect_s:g} s)")

    def _ask_back(self, entry: Entry) -> None:
        """This node was left out of ``entry`` while it ran: it becomes a spare asking to vote again (the module
        notes' *return*); its launcher stops its workers when it sees the entry."""
        with self._cond:
            if self.entry is not entry or self.role is not Role.VOTING:
                return  # judged on an entry a newer one replaced meanwhile: judged again at the next tick
            self.removal = self.left_out(entry)
            self.returns += 1
            self._quorum = Quorum.HEARD
            self.report = Report()  # what it reported of its workers is of members no longer in the job
            self._become(Role.SPARE)
        self._told.set()

    def _give_up(self, why: str) -> None:
        with self._cond:
            self._become(Role.STOPPED, why)

    def _become(self, role: Role, why: str | None = None) -> None:
        """This node's move to ``role`` (under the lock); ``why``: a stop's reason. Raises RuntimeError on a move
        that :data:`MOVES` does not allow."""
        check_move(MOVES, self.role, role, f"the council of node {self.node}")
        self.role = role
        self.report.candidate = role is Role.SPARE
        if role is Role.STOPPED:
            self.stop_reason = why or "stopped"
        self._cond.notify_all()

    # -- the launcher's side -----------------------------------------------

    def tell(self, **changes: Any) -> None:
        """Update this node's report (``dead=[...]`` etc. are added to, flags set) and send it at once."""
        with self._cond:
            for name, value in changes.items():
                if isinstance(value, list):
                    getattr(self.report, name).extend(value)
                else:
                    setattr(self.report, name, value)
        self._told.set()
        self._wake.set()

    def standing(self) -> tuple[Entry, int, Role]:
        """The newest entry, :attr:`returns` and :attr:`role`, read together."""
        with self._cond:
            return self.entry, self.returns, self.role

    def confirm(self, timeout_s: float) -> None:
        """Wait until this node's entry is known to be the job's newest (at most ``timeout_s``): a majority of its
        nodes, this one counted, answered a beat sent from now on, or an entry came that leaves it out, or this
        node is no longer a voting node. Its launcher calls it after a pause (a stopped process), before it takes a
        worker's exit for a death: the others may have left this node out meanwhile, and the messages they sent
        before they did, read only now, say nothing of that."""
        with self._cond:
            entry = self.entry
            if self.role is not Role.VOTING:
                return
            marks = {n: (self._peers[n], self._peers[n].sent) for n in entry.nodes
                     if n != self.node and n in self._peers}
        self._told.set()  # a beat now, numbered after the marks

        def answered(node: int) -> bool:  # a beat of the peer's sent after it read one of this agent's from now on
            connection, sent = marks[node]
            now = self._peers.get(node)  # a connection made since (dialed again) carries only later beats
            return now is not None and (now.acked > sent if now is connection else now.acked > 0)

        def known() -> bool:  # a newer entry that still names this node may be followed by one that does not
            return (self.node not in self.entry.nodes or self.role is not Role.VOTING
                    or 1 + sum(map(answered, marks)) >= self.entry.majority())

        with self._cond:
            self._cond.wait_for(known, timeout_s)

    def wait_change(self, entry: Entry, timeout_s: float) -> Entry:
        """The newest entry, once it is newer than ``entry`` (or at the timeout, or when cut off)."""
        with self._cond:
            self._cond.wait_for(lambda: self.entry.index > entry.index or self.role is Role.STOPPED, timeout_s)
            return self.entry

    def close(self) -> None:
        """Leave: tell the others the job's end once more (one that missed the last commit learns it) and close."""
        with self._cond:
            entry, told = self.entry, set(self.entry.nodes) | self._candidates
        for node in sorted(told):
            if node != self.node:
                self._send(node, {"kind": "commit", "entry": asdict(entry)})
        self._stop.set()
        self._listener.close()  # first: a peer that sees its connection close dials again, and must find no one
        with self._cond:
            peers = list(self._peers.values())
        for peer in peers:
            close_socket(peer.sock)


def take_seat(rdzv: Any, *, node: int, nnodes: int, nproc: int, master_addr: str, port: int, token: str | None,
              timeout_s: float, most: int | None = None, suspect_s: float = SUSPECT_S) -> tuple[Council, Any]:
    """Meet the other nodes' agents through the job's first store and open this one's seat.

    Each agent publishes where it can be reached (its council port, and the store it serves for the workers
    should it become the lowest node: node 0's is the job's store itself), then dials the lower nodes. A spare
    (``node >= nnodes``, the starting nodes' count; ``most``: the job's most nodes) waits for the starting nodes'
    seats, then dials every seat published. Returns the council and the store this agent serves (None on node
    0, whose rendezvous serves it).

    Raises:
        RuntimeError: this node had a seat already (a lost node does not come back), or the others did not all
            come within ``timeout_s``.
    """
    from ddpkit.launcher.agent_store import AgentStore
    from ddpkit.runtime.network import local_address_towards
    from ddpkit.runtime.process import free_port

    most = max(nnodes, most or 0)
    deadline = time.monotonic() + timeout_s
    if node == 0:
        rdzv.store.set("council/nproc", str(nproc))
    else:  # ranks and member ids count on one number of workers a node: check it before taking a seat
        _wait_keys(rdzv.store, ["council/nproc"], deadline, "node 0 did not open the job's council")
        if (theirs := int(rdzv.store.get("council/nproc"))) != nproc:
            raise RuntimeError(f"node {node} runs --nproc-per-node {nproc}, node 0 runs {theirs}: under "
                               "--on-failure continue every node, a spare too, runs the same number of workers")
    if rdzv.store.add(f"seat/{node}", 1) != 1:  # atomic: two launchers given one node rank, one seat
        raise RuntimeError(f"node {node} already took its seat in this job, which goes on without it: under "
                           "--on-failure continue a lost node does not come back (the nodes left go on with their "
                           "workers; start a new job to use this node again, or give a spare an unused "
                           f"--node-rank below {most})")
    host = master_addr if node == 0 else (local_address_towards(master_addr, port) or master_addr)
    served = None
    store = f"{master_addr}:{port}"
    if node:
        served = AgentStore(host, free_port(host), lambda: timeout_s)
        served.start()
        store = served.where
    # On loopback alone when the job's address is a loopback one (every node on this machine), as its stores do.
    listener = socket.socket(fileno=loopback_listener(host, 0, or_any=True))
    rdzv.store.set(f"council/{node}", json.dumps([host, listener.getsockname()[1], store]))
    _wait_keys(rdzv.store, [f"council/{n}" for n in range(nnodes)], deadline,
               "node(s) {missing} did not publish their council seat")
    seats = [n for n in range(most) if n < nnodes or n == node or rdzv.marked(f"council/{n}")]
    places = {n: tuple(json.loads(rdzv.store.get(f"council/{n}"))) for n in seats}
    world = nnodes * nproc

    def node_of(member: int) -> int:
        return member // nproc if member < world else (member - world) % most

    council = Council(node, places, listener, list(range(world)), node_of, token,  # type: ignore[arg-type]
                      starting=nnodes, most=most, suspect_s=suspect_s)
    return council, served


def _wait_keys(store: Any, keys: list[str], deadline: float, what: str) -> None:
    """Until every key is in ``store``; RuntimeError ``what`` (``{missing}``: the keys' nodes) at the deadline."""
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = ", ".join(k.rsplit("/", 1)[1] for k in keys if not store.check([k]))
            raise RuntimeError(what.format(missing=missing) + " within the rendezvous timeout")
        time.sleep(0.05)

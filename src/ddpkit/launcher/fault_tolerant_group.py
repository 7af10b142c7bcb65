"""``--on-failure continue``: a worker's death changes the membership instead of stopping the job.

The launcher is where a death is known first (its ``waitpid`` returns within
milliseconds). In this mode it does not stop the other workers: it announces
a new view (a generation and the live member ids, see
:mod:`ddpkit.runtime.membership`) on the pipe it holds to every survivor, and
the survivors rebuild their group and go on in the same processes. With
``--max-restarts`` budget left it also starts a replacement, which joins the
view after next once it says it is ready (a peer hands it the training state).

The job succeeds when the workers still alive at the end exit 0; when the
last one dies, its first death is the job's failure, reported as today. A
worker that exits with code 2 (a usage error) before it held the training
state ends the job at once: a replacement would make the same mistake.
Parameter servers (``--num-servers``) are not members: the workers that are
left keep pushing to them, a server's death is survived while every key
range has a server left (``--ps-replication``), and they are stopped once
the workers are done.

Across nodes, a node that the others' majority leaves out while it still
runs (wrongly suspected: paused longer than the failure detector's timeout)
stops its workers, whose members are out of the job, and asks to come back
as a spare does; once an entry makes it a voting node again it starts its
workers anew, and they join with the state from a peer.

Each worker's part in the job, as its launcher sees it, is a :class:`WorkerPhase`; it moves by
:meth:`FaultTolerantGroup._move` only, along :data:`WORKER_MOVES`.
"""

from __future__ import annotations

import enum
import json
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ddpkit.launcher.council import Council, Entry, Role
from ddpkit.launcher.output import LogLayout
from ddpkit.launcher.plan import WorkerSpec
from ddpkit.launcher.node_rendezvous import RemoteFailure, rendezvous_timeout
from ddpkit.launcher.settings import LaunchSettings
from ddpkit.launcher.supervise import Failure, WorkerGroup, say
from ddpkit.runtime.process import SignalCatcher, describe_exit, terminate
from ddpkit.runtime.variables import FT_FD, FT_MEMBER, FT_REPLY_FD

__all__ = ["WORKER_MOVES", "Death", "FaultTolerantGroup", "WorkerPhase"]

_POLL_S = 0.05
USAGE_EXIT = 2
"""The exit code of a usage error (argparse's, ``ddpkit``'s command line): a worker that exits with it before it
held the training state ends the job instead of being replaced."""
_TORCH_LOG = re.compile(r"\[[IWEF]\d{4} ")
"""A line of torch's C++ log (``[W1128 02:46:49.469 socket.cpp:207] ...``), not the worker's own words."""


class WorkerPhase(enum.Enum):
    """A worker's part in the job, as its launcher sees it (the module notes); its moves are :data:`WORKER_MOVES`."""

    STARTED = "started"
    """Running, not yet holding the training state (a first worker before its first group is agreed, or a
    replacement before a peer handed it the state)."""
    TRAINING = "training"
    """Running and holding the training state (it said so: ``joined``)."""
    DISMISSED = "dismissed"
    """Stopped by this launcher (training over before it joined, its node left out, no holder of the state left):
    its member is out of the job, and its exit is no death."""
    FINISHED = "finished"
    """Exited 0."""
    DIED = "died"
    """Exited otherwise while in the job."""
    GONE = "gone"
    """Exited after it was dismissed."""

    @property
    def running(self) -> bool:
        """Its exit has not been seen yet."""
        return self in (WorkerPhase.STARTED, WorkerPhase.TRAINING, WorkerPhase.DISMISSED)

    @property
    def in_job(self) -> bool:
        """Running as a member of the job (not dismissed)."""
        return self in (WorkerPhase.STARTED, WorkerPhase.TRAINING)


WORKER_MOVES: dict[WorkerPhase, frozenset[WorkerPhase]] = {
    WorkerPhase.STARTED: frozenset({WorkerPhase.TRAINING, WorkerPhase.DISMISSED, WorkerPhase.FINISHED,
                                    WorkerPhase.DIED}),
    WorkerPhase.TRAINING: frozenset({WorkerPhase.DISMISSED, WorkerPhase.FINISHED, WorkerPhase.DIED}),
    WorkerPhase.DISMISSED: frozenset({WorkerPhase.GONE}),
    WorkerPhase.FINISHED: frozenset(),
    WorkerPhase.DIED: frozenset(),
    WorkerPhase.GONE: frozenset(),
}
"""The moves of a worker's :class:`WorkerPhase`; any other is a bug (:meth:`FaultTolerantGroup._move` raises)."""


@dataclass(frozen=True)
class Death:
    """One worker's death, as the launcher saw it."""

    member: int
    exitcode: int
    at: float
    """``time.time()`` when ``waitpid`` returned."""
    generation: int
    """The view announced for it."""


class FaultTolerantGroup(WorkerGroup):
    """The workers of a job that goes on without its dead: a pipe to each, a view per death or arrival."""

    def __init__(self, launch: LaunchSettings, layout: LogLayout, replacements: int = 0,
                 council: Council | None = None) -> None:
        super().__init__(launch, layout)
        self.council = council
        """Several nodes: the agents' majority decides each view (None: this launcher is the job)."""
        self.entry: Entry | None = council.entry if council else None
        """The council's newest entry this launcher acted on."""
        self.generation = 0
        self.members: list[int] = []
        self.pipes: dict[int, int] = {}
        """member id -> the write end of its pipe."""
        self.member_of: dict[int, int] = {}
        """worker index -> member id."""
        self.deaths: list[Death] = []
        self.replacements = replacements
        self._ready: queue.Queue[int] = queue.Queue()
        self.phases: dict[int, WorkerPhase] = {}
        """worker index -> its phase (members only: parameter servers are not); changed by :meth:`_move` only."""
        self._index_of: dict[int, int] = {}
        """member id -> worker index."""
        self._moving = threading.RLock()
        """Held by :meth:`_move` (the replies' threads move a worker to training)."""
        self._next_member = 0
        self.server_pipes: list[int] = []
        self._stopped: list[WorkerSpec] = []
        """The workers this node stopped when it was left out (it starts them anew when it comes back)."""
        self._voters: set[int] = set(council.entry.nodes) if council else set()
        """Every node that was a voting node in an entry this launcher acted on."""
        self._returns = 0
        """How many of the council's :attr:`~Council.returns` this launcher has acted on."""
        self._asked_back: float | None = None
        """Since when this node, left out, waits to be a voting node again (``time.monotonic()``)."""
        self._holding = False
        """The last entry followed left this node out, and its council has not yet decided (:meth:`_deciding`)."""

    def start(self, specs: list[WorkerSpec], signals: SignalCatcher) -> None:
        """Start this node's workers (a spare node's join the running job as replacements do)."""
        spare = self.launch.spare
        if spare:
            self.members, self.generation = list(self.entry.members), self.entry.generation  # type: ignore[union-attr]
        with signals.deferred():
            for spec in specs:
                if signals.received is not None:
                    break
                if spec.server is None:
                    self._start_member(spec, replacing=spare)
                else:
                    self._start_server(spec)
        if not spare:
            self.members = list(self.entry.members if self.entry else self.member_of.values())
            self._announce()

    def _start_member(self, spec: WorkerSpec, replacing: bool = False) -> None:
        member = self._member_id(spec, replacing)
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        spec.env.update({FT_FD: str(down_r), FT_REPLY_FD: str(up_w), FT_MEMBER: str(member)})
        index = self._start_one(spec, pass_fds=(down_r, up_w))
        os.close(down_r)
        os.close(up_w)
        self.member_of[index] = member
        self._index_of[member] = index
        self.phases[index] = WorkerPhase.STARTED
        self.pipes[member] = down_w
        if self.members:
            os.write(down_w, self._view())
        threading.Thread(target=self._read_replies, args=(up_r, member), daemon=True).start()

    def _start_server(self, spec: WorkerSpec) -> None:
        """A parameter server: not a member, but told of the deaths (its waits on another server end when that
        one dies) on a pipe of its own."""
        down_r, down_w = os.pipe()
        spec.env[FT_FD] = str(down_r)
        self._start_one(spec, pass_fds=(down_r,))
        os.close(down_r)
        self.server_pipes.append(down_w)

    def _member_id(self, spec: WorkerSpec, replacing: bool) -> int:
        """A worker's member id: its first rank; a replacement's, the next one unused (across nodes, this node's
        next one: the world size + the node + a multiple of the number of nodes)."""
        if self.council is None:
            member = self._next_member
        elif not replacing:
            member = spec.rank
        else:
            member = self.launch.world_size + self.council.node + self._next_member * self.launch.max_nodes
        self._next_member += 1
        return member

    def _read_replies(self, fd: int, member: int) -> None:
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            for line in pipe:
                if line.strip() == b"ready":
                    self._ready.put(member)
                elif line.strip() == b"holding":
                    with self._moving:  # read and moved together: the main loop may dismiss it meanwhile
                        index = self._index_of[member]
                        if self.phases[index] is WorkerPhase.STARTED:  # not dismissed, its exit not yet seen
                            self._move(index, WorkerPhase.TRAINING)
                    if member >= self.launch.world_size:  # a replacement's or a spare's: it can train now
                        say(f"member {member} holds the training state")
                    if self.council is not None:
                        self.council.tell(holding=[member])

    def _view(self) -> bytes:
        view = {"generation": self.generation, "members": self.members, "servers_gone": sorted(self.dead_servers)}
        if self.entry is not None:
            view["store"] = self.entry.store
        return (json.dumps(view) + "\n").encode()

    def _announce(self) -> None:
        line = self._view()
        for fd in [*self.pipes.values(), *self.server_pipes]:  # a replacement not yet admitted too
            try:
                os.write(fd, line)
            except OSError:
                pass  # it died a moment ago: its exit is in the queue and makes the next view

    def wait(self, watch: Callable[[], RemoteFailure | str | None] | None = None,
             ) -> Failure | RemoteFailure | str | None:
        """Until every live worker exited 0 (None) or none is left (the first death's :class:`Failure`)."""
        first: Failure | None = None
        looked = time.monotonic()
        while self._running() or (self.entry is not None and not self.entry.done):
            now = time.monotonic()  # one reading for the check and the next one: a stop in between counts
            if self.council is not None and self._paused(looked):
                # This launcher was stopped (or starved): the others may have left this node out meanwhile, and
                # then its workers are out of the job, and their exits no deaths. Known first, then acted on.
                self.council.confirm(self.council.suspect_s)
                now = time.monotonic()
            looked = now
            if self.council is not None:
                if not self._running() and not self.council.report.finished and self._asked_back is None:
                    self.council.tell(finished=True, succeeded=self._finished())
                if (cut_off := self._follow() or self._come_back()) is not None:
                    return None if not self._running() and self.council.report.succeeded else cut_off
                if self._holding:
                    time.sleep(_POLL_S)  # an exit now is of a worker out of the job, not a death: not yet
                    continue
            try:
                code, index = self.exits.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._finished():
                    self._admit_ready()
                continue
            if (self.council is not None and code != 0 and self.phases.get(index) is not WorkerPhase.DISMISSED
                    and self._paused(looked)):
                self.exits.put((code, index))  # stopped while waiting for it: handled after the check above
                continue
            if self.specs[index].server is not None:
                if code != 0:
                    if not self.server_replaced(index, code):
                        self.stop()
                        return self.failure(index, code)
                    self._announce()  # the same generation: the workers' requests to it stop waiting
                continue
            member = self.member_of[index]
            if self.phases[index] is WorkerPhase.DISMISSED:
                self._move(index, WorkerPhase.GONE)
                continue
            if code == 0:
                first_to_finish = not self._finished()
                self._move(index, WorkerPhase.FINISHED)
                if first_to_finish:
                    self._dismiss_joining()
                self._leave(member)
                continue
            usage = code == USAGE_EXIT and self.phases[index] is WorkerPhase.STARTED
            self._move(index, WorkerPhase.DIED)
            failure = self.failure(index, code)
            first = first or failure
            if usage:
                # Exit 2 before the worker held the training state: a usage error (a bad flag, a wrong launcher),
                # which every replacement would make again. Not a death to survive.
                say(f"member {member} (rank {failure.rank} at the start) exited with code {USAGE_EXIT} before it held "
                    "the training state: a usage error (its own line says which), not a death to survive; stopping "
                    "the job")
                self.stop()
                return failure
            self._close(member)
            said = [line for line in failure.last_lines if not _TORCH_LOG.match(line)]  # not c10d's warnings
            why = (failure.traceback.splitlines() or said or [""])[-1].strip()
            died = (f"member {member} (rank {failure.rank} at the start) died: {describe_exit(code)}"
                    + (f" ({why})" if why else ""))
            self.deaths.append(Death(member, code, time.time(), self.generation + 1))
            if self.council is not None:
                self.council.tell(dead=[member])
                say(f"{died}; the nodes' majority decides the next membership")
            elif not self._drop(member, died):
                break
            if self.replacements > 0 and not self._finished():
                self.replacements -= 1
                dead = self.specs[index]  # the replacement takes the dead worker's place (rank, local rank, GPU)
                env = {k: v for k, v in dead.env.items() if not k.startswith("DDPKIT_FT_")}
                if self.entry is not None:  # it meets on the store of now (node 0's may be gone)
                    env["MASTER_ADDR"], env["MASTER_PORT"] = self.entry.store.rsplit(":", 1)
                self._start_member(replace(dead, env=env), replacing=True)
                say(f"started member {self.member_of[len(self.procs) - 1]} to replace it ({self.replacements} "
                    "replacement(s) left); it joins at a step boundary once ready")
        for fd in list(self.pipes):
            self._close(fd)
        self.stop_servers()
        for fd in self.server_pipes:
            os.close(fd)
        if self.entry is not None:
            return None if self.entry.succeeded else first or "every worker of the job died"
        return None if self._finished() else first

    def _move(self, index: int, phase: WorkerPhase) -> None:
        """Move worker ``index`` to ``phase`` (the only place a phase changes; :data:`WORKER_MOVES` says which
        moves exist)."""
        with self._moving:
            now = self.phases[index]
            if phase not in WORKER_MOVES[now]:
                raise RuntimeError(f"member {self.member_of[index]}'s worker has no move from {now.value} to "
                                   f"{phase.value} (a bug in ddpkit: please report it)")
            self.phases[index] = phase

    def _running(self) -> list[int]:
        """The workers whose exit has not been seen yet (dismissed ones too)."""
        return [i for i, phase in self.phases.items() if phase.running]

    def _in_job(self) -> list[int]:
        """The workers running as members of the job."""
        return [i for i, phase in self.phases.items() if phase.in_job]

    def _finished(self) -> bool:
        """Some worker of this node finished training (exit 0)."""
        return WorkerPhase.FINISHED in self.phases.values()

    def _dismiss(self, indices: list[int]) -> None:
        """Stop these workers: their members are out of the job, and their exits no deaths."""
        for i in indices:
            self._move(i, WorkerPhase.DISMISSED)
        terminate([self.procs[i] for i in indices], self.launch.grace_period_s)

    def _leave(self, member: int) -> None:
        """A member finished (exit 0): the next view is announced without it, so that a peer still waiting in a
        collective with it (its last step's, interrupted by a death or a join) rebuilds without it instead of
        waiting for a process that is gone. Across nodes the majority decides that view too."""
        self._close(member)
        if not self._running():
            return  # the last one: no one is left to tell
        if self.council is not None:
            self.council.tell(left=[member])
        elif member in self.members:
            self.members.remove(member)
            self.generation += 1
            self._announce()

    def _drop(self, member: int, died: str) -> bool:
        """One node: this launcher's word is the next view. False when no worker holding the state is left (the
        replacements still running are stopped)."""
        if member in self.members:
            self.members.remove(member)
        self.generation += 1
        # Who holds the training state: the members that joined, and the first ones before anyone trained.
        joined = {self.member_of[i] for i, phase in self.phases.items() if phase is WorkerPhase.TRAINING}
        if not self._holders(self.members, joined):
            waiting = self._in_job()
            say(f"{died}; no worker holding the training state is left"
                + (f" (stopping {len(waiting)} replacement(s) that had not joined)" if waiting else ""))
            self._dismiss(waiting)
            return False
        say(f"{died}; the job goes on with {len(self.members)} worker(s), membership generation {self.generation}")
        self._announce()
        return True

    def _holders(self, members: list[int], joined: set[int]) -> list[int]:
        return [m for m in members if m in joined or m < self.launch.world_size]

    def _follow(self) -> str | None:
        """Several nodes: act on the council's newest entry (announce its view); why this node stopped, if so."""
        assert self.council is not None and self.entry is not None
        entry, returns, role = self.council.standing()
        node = self.council.node
        if returns > self._returns:  # wrongly suspected: its council asks to vote again
            self._returns = returns
            self._step_out(self.council.removal)
        self._holding = self._deciding(entry, role)
        if self._holding:
            return None  # its view is not for this node's workers, who are out of it
        if role is Role.STOPPED and not entry.done:
            if waiting := self._in_job():
                say(f"{self.council.stop_reason}; stopping this node's {len(waiting)} worker(s)")
                self.stop()
            elif self._asked_back is not None:  # stopped when it was left out: it waited to be taken back
                say(f"{self.council.stop_reason}; node {node} had stopped its workers when it was left out, and was "
                    "not taken back")
            else:  # its workers are done (exit 0 ends this launcher well): the others' end it cannot see
                say(f"{self.council.stop_reason}; this node's workers had ended")
            return self.council.stop_reason
        if entry.index == self.entry.index:
            return None
        gone = [n for n in self.entry.nodes if n not in entry.nodes and n != node]
        back = [n for n in entry.nodes if n not in self.entry.nodes and n != node and n in self._voters]
        self._voters.update(entry.nodes)
        if back:  # nodes left out while they ran (a spare's first arrival is said by the spare)
            say(f"node(s) {', '.join(map(str, back))} came back: {len(entry.nodes)} voting nodes; their workers join "
                "with the state from a peer"
                + (f"; the workers' store moves to node {min(entry.nodes)}" if entry.store != self.entry.store
                   else ""))
        if gone:
            say(f"node(s) {', '.join(map(str, gone))} left the job (its launcher died, or was not heard for "
                f"{self.council.suspect_s:g} s): {len(entry.nodes)} node(s) go on"
                + (f", the workers' store moves to node {min(entry.nodes)}" if entry.store != self.entry.store
                   else ""))
        self.entry = entry
        if entry.succeeded:  # training is over: no one is left to join
            self._dismiss_joining()
        if entry.generation == self.generation:
            return None
        left = [m for m in self.members if m not in entry.members]
        came = [m for m in entry.members if m not in self.members]
        self.members, self.generation = list(entry.members), entry.generation
        say(f"membership generation {entry.generation}: {len(self.members)} worker(s)"
            + (f", member(s) {', '.join(map(str, left))} left" if left else "")
            + (f", member(s) {', '.join(map(str, came))} joined" if came else ""))
        self._announce()
        if self.members and not self._holders(self.members, set(entry.holders)):
            waiting = self._in_job()
            say(f"no worker holding the training state is left (stopping {len(waiting)} replacement(s) of this "
                "node that had not joined)")
            self._dismiss(waiting)
        return None

    def _deciding(self, entry: Entry, role: Role) -> bool:
        """Whether ``entry`` left this voting node out and its council has not yet asked back or stopped (it does
        at its next tick). Not once training is over or the job done: the council then takes no decision (its
        ticks end with the job), and nothing is left to hold for."""
        assert self.council is not None and self.entry is not None
        node = self.council.node
        return (node in self.entry.nodes and node not in entry.nodes and role is Role.VOTING
                and not entry.succeeded and not entry.done)

    def _paused(self, since: float) -> bool:
        """Whether this launcher's loop went unrun from ``since`` for long enough that the others may have judged
        this node gone (half the failure detector's timeout)."""
        assert self.council is not None
        return time.monotonic() - since > self.council.suspect_s / 2

    def _step_out(self, why: str) -> None:
        """The majority left this node out while it ran (``why``): stop its workers (their members are out of the
        job: their exits are no deaths) and wait to be a voting node again (:meth:`_come_back`)."""
        assert self.council is not None
        waiting = self._in_job()
        self._stopped += [self.specs[i] for i in waiting]
        say(f"{why}; stopping this node's {len(waiting)} worker(s), whose members are out of "
            f"the job; node {self.council.node} asks to vote again as a spare does")
        self._dismiss(waiting)
        for i in waiting:
            self._close(self.member_of[i])
        self._asked_back = time.monotonic()

    def _come_back(self) -> str | None:
        """A node left out (:meth:`_step_out`): once an entry names it a voting node again, start its workers
        anew (they join with the state from a peer, as a spare's do). Why it gives up, if it does: not taken
        back within the rendezvous timeout."""
        if self._asked_back is None:
            return None
        assert self.council is not None and self.entry is not None
        entry, _, role = self.council.standing()
        if entry is not self.entry:
            return None  # followed first (the next turn of the loop)
        node = self.council.node
        if node not in entry.nodes or role is not Role.VOTING:
            if entry.succeeded:
                say(f"node {node}: the job's training ended before it was taken back; nothing left to do")
                self._asked_back = None
                return None
            if time.monotonic() - self._asked_back < rendezvous_timeout():
                return None
            why = (f"node {node} was not taken back into the job within {rendezvous_timeout():g} s (waited for the "
                   f"majority of nodes {', '.join(map(str, entry.nodes))})")
            say(why)
            return why
        self._asked_back = None
        say(f"node {node} is a voting node again ({len(entry.nodes)} voting nodes): starting its "
            f"{len(self._stopped)} worker(s) anew; they join at a step boundary with the training state from a peer")
        host, port = entry.store.rsplit(":", 1)
        stopped, self._stopped = self._stopped, []
        for spec in stopped:
            env = {k: v for k, v in spec.env.items() if not k.startswith("DDPKIT_FT_")}
            env["MASTER_ADDR"], env["MASTER_PORT"] = host, port
            self._start_member(replace(spec, env=env), replacing=True)
        return None

    def _dismiss_joining(self) -> None:
        """A worker finished, so training is over: stop the replacements that never got the state (they would
        wait for members that are gone, or train alone from the start)."""
        joining = [i for i, phase in self.phases.items()
                   if phase is WorkerPhase.STARTED and self.member_of[i] >= self.launch.world_size]
        if joining:
            say(f"training is over: stopping {len(joining)} replacement(s) that had not joined yet")
            self._dismiss(joining)
            gone = [self.member_of[i] for i in joining]  # the next view must not name them (no one waits for them)
            if self.council is not None:
                self.council.tell(left=gone)
            else:
                self.members = [m for m in self.members if m not in gone]

    def _admit_ready(self) -> None:
        """Replacements that said they are ready join the next view."""
        joined = []
        while True:
            try:
                member = self._ready.get_nowait()
            except queue.Empty:
                break
            if member in self.pipes and member not in self.members:
                joined.append(member)
        if joined and self.council is not None:
            self.council.tell(ready=joined)  # the nodes' majority admits them
        elif joined:
            self.members.extend(joined)
            self.generation += 1
            say(f"member(s) {', '.join(map(str, joined))} joined: {len(self.members)} worker(s), "
                f"membership generation {self.generation}")
            self._announce()

    def _close(self, member: int) -> None:
        fd = self.pipes.pop(member, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

"""``--on-failure continue``: a worker's death changes the membership instead of stopping the job.

The launcher is where a death is known first (its ``waitpid`` returns within
milliseconds). In this mode it does not stop the other workers: it announces
a new view (a generation and the live member ids, see
:mod:`ddpkit.runtime.membership`) on the pipe it holds to every survivor, and
the survivors rebuild their group and go on in the same processes. With
``--max-restarts`` budget left it also starts a replacement, which joins the
view after next once it says it is ready (a peer hands it the training state).

A worker that stops without dying (paused, or holding Python's lock) would
hold every survivor in its next collective until the group's timeout. Each
worker beats on its pipe back twice every keep-alive interval (``--rdzv-conf``'s
``keep_alive_interval``, 1 s), from a thread of its own, and says goodbye at
exit (its teardown gets the shutdown grace period more); one not heard for
the keep-alive's timeout (``keep_alive_interval x keep_alive_max_attempt``,
6 s) once it has beaten, or stopped (the system says so) that long before its
first beat, is killed, with a line that says so, and its death is
survived as any other (a replacement takes its place while ``--max-restarts``
allows). A launcher that was itself held up that long judges nobody on that
turn.

The job succeeds when the workers still alive at the end exit 0; when the
last one dies, the first of the deaths that ended it is the job's failure
(on one node, the deaths since the survivors last went on: one of them built
the group of a view after a death), reported as today. A
worker that exits with code 2 (a usage error), or that called torch's
collectives with no default process group (the mode builds none), before it
held the training state ends the job at once: a replacement would make the
same mistake.
Parameter servers (``--num-servers``) are not members: the workers that are
left keep pushing to them, a server's death is survived while every key
range has a server left (``--ps-replication``), and they are stopped once
the workers are done. They beat as the workers do, and one that stalls is
killed in the same way.

Across nodes the nodes' majority decides each view instead
(:mod:`ddpkit.launcher.council_group`).

Each worker's part in the job, as its launcher sees it, is a :class:`WorkerPhase`; it moves by
:meth:`FaultTolerantGroup._move` only, along :data:`WORKER_MOVES`. What its beats say of it is a
:class:`Liveness`, moved by :meth:`FaultTolerantGroup._hear` only, along :data:`LIVENESS_MOVES`.
"""

from __future__ import annotations

import enum
import json
import os
import queue
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Union

from ddpkit.launcher.output import LogLayout
from ddpkit.launcher.plan import WorkerSpec
from ddpkit.launcher.node_rendezvous import RemoteFailure
from ddpkit.launcher.settings import LaunchSettings
from ddpkit.launcher.supervise import Failure, WorkerGroup, say
from ddpkit.runtime.process import SignalCatcher, describe_exit, process_stopped, signal_groups, terminate
from ddpkit.runtime.states import check_move
from ddpkit.runtime.variables import FT_FD, FT_KEEP_ALIVE, FT_MEMBER, FT_REPLY_FD

__all__ = ["GO", "HOLD", "LIVENESS_MOVES", "USAGE_EXIT", "WORKER_MOVES", "Death", "FaultTolerantGroup", "Liveness",
           "Stop", "Turn", "WorkerPhase"]

_POLL_S = 0.05
USAGE_EXIT = 2
"""The exit code of a usage error (argparse's, ``ddpkit``'s command line): a worker that exits with it before it
held the training state ends the job instead of being replaced."""
_NO_GROUP = "Default process group has not been initialized"
"""torch's words when a program calls its collectives (or builds torch's DDP) without a default process group."""
_NO_GROUP_HELP = ("under --on-failure continue ddpkit.init() builds no default process group (the job's world changes "
                  "with its membership), so torch.distributed's own collectives and torch's DDP cannot run: reduce "
                  "through ddpkit.FaultTolerance (ft.steps(), ft.all_reduce(), ft.barrier(), or "
                  "ddpkit.DistributedDataParallel inside ft.steps(); docs/failures.md), or launch without "
                  "--on-failure continue")
_TORCH_LOG = re.compile(r"\[[IWEF]\d{4} ")
"""A line of torch's C++ log (``[W1128 02:46:49.469 socket.cpp:207] ...``), not the worker's own words."""


class WorkerPhase(enum.Enum):
    """A worker's part in the job, as its launcher sees it (the module notes); its moves are :data:`WORKER_MOVES`."""

    STARTED = "started"
    """Running, not yet holding the training state (a first worker before its first group is agreed, or a
    replacement before a peer handed it the state)."""
    TRAINING = "training"
    """Running and holding the training state (it said so: ``holding``)."""
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


class Go(enum.Enum):
    """What the wait loop does this turn (:meth:`FaultTolerantGroup._turn`) when it does not stop."""

    GO = "go"
    """Wait for the next exit."""
    HOLD = "hold"
    """Take no exit this turn: this node was left out and its council has not yet decided (an exit now is of a
    worker out of the job, not a death)."""


class Liveness(enum.Enum):
    """What a worker's or a parameter server's beats say of it (the module notes), as its launcher hears them;
    orthogonal to a worker's :class:`WorkerPhase` (a worker may stall or say goodbye whether or not it holds the
    state). Its moves are :data:`LIVENESS_MOVES`, made by :meth:`FaultTolerantGroup._hear` only."""

    UNHEARD = "unheard"
    """No line from it yet (starting: an interpreter, torch's import, the program's own set-up): judged only
    when the system says it is stopped (a SIGSTOP), for the keep-alive's timeout."""
    BEATING = "beating"
    """It beats: judged silent after the keep-alive's timeout."""
    LEAVING = "leaving"
    """It said goodbye (its program ended): exiting; its teardown gets the shutdown grace period more."""
    STALLED = "stalled"
    """Killed by its launcher for its silence: its exit is a death."""
    CUT_SHORT = "cut short"
    """Killed by its launcher for its silence after its goodbye: only its teardown hung, and it counts as
    finished."""
    EXITED = "exited"
    """Its exit was seen: nothing left to judge."""

    @property
    def judged(self) -> bool:
        """Whether its silence is watched (it beat once, and it was not killed yet)."""
        return self in (Liveness.BEATING, Liveness.LEAVING)

    @property
    def leaving(self) -> bool:
        """Whether it said goodbye."""
        return self in (Liveness.LEAVING, Liveness.CUT_SHORT)


LIVENESS_MOVES: dict[Liveness, frozenset[Liveness]] = {
    Liveness.UNHEARD: frozenset({Liveness.BEATING, Liveness.LEAVING, Liveness.STALLED, Liveness.EXITED}),
    Liveness.BEATING: frozenset({Liveness.LEAVING, Liveness.STALLED, Liveness.EXITED}),
    Liveness.LEAVING: frozenset({Liveness.CUT_SHORT, Liveness.EXITED}),
    Liveness.STALLED: frozenset({Liveness.EXITED}),
    Liveness.CUT_SHORT: frozenset({Liveness.EXITED}),
    Liveness.EXITED: frozenset(),
}
"""The moves of a process's :class:`Liveness`; any other is a bug (:meth:`FaultTolerantGroup._hear` raises)."""

GO, HOLD = Go.GO, Go.HOLD


@dataclass(frozen=True)
class Stop:
    """The wait ends with ``outcome`` (a turn's answer)."""

    outcome: Failure | RemoteFailure | str | None


Turn = Union[Go, Stop]


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
    """The workers of a job that goes on without its dead: a pipe to each, a view per death or arrival.

    On one node this launcher's word is each view; across nodes, :class:`~ddpkit.launcher.council_group.CouncilGroup`
    overrides the decisions (the methods after :meth:`wait`) to follow the nodes' majority.
    """

    def __init__(self, launch: LaunchSettings, layout: LogLayout, replacements: int = 0) -> None:
        super().__init__(launch, layout)
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
        self._moving = threading.RLock()
        """Held by :meth:`_move` (the replies' threads move a worker to training)."""
        self._next_member = 0
        self.server_pipes: list[int] = []
        self.keep_alive = launch.keep_alive()
        """(interval, timeout) in seconds: each worker beats every interval; one silent for the timeout is stalled."""
        self.liveness: dict[int, Liveness] = {}
        """worker index (members and parameter servers) -> what its beats say of it; changed by :meth:`_hear`
        only."""
        self._heard: dict[int, float] = {}
        """worker index -> ``time.monotonic()`` of its last line on the pipe back (a replies' thread writes it)."""
        self._swept = time.monotonic()
        """When :meth:`_kill_stalled` last looked."""
        self._stopped_since: dict[int, float] = {}
        """worker index -> ``time.monotonic()`` since which the system has said it is stopped (unheard ones)."""
        self.channel_built = False
        """Whether the parameter servers' channel (one group of every worker and server, made once) is built: a
        server said so. A server lost before then cannot be stood in for."""
        self._readers: dict[int, threading.Thread] = {}
        """server index -> the thread reading its pipe back."""
        self._built: dict[int, int] = {}
        """member id -> the newest generation whose group it built (a replies' thread writes it)."""

    def start(self, specs: list[WorkerSpec], signals: SignalCatcher) -> None:
        """Start this node's workers."""
        with signals.deferred():
            for spec in specs:
                if signals.received is not None:
                    break
                if spec.server is None:
                    self._start_member(spec, replacing=self._replacing_at_start())
                else:
                    self._start_server(spec)
        if not self._replacing_at_start():
            self.members = self._first_members()
            self._announce()

    def _replacing_at_start(self) -> bool:
        """Whether this node's first workers join a running job, as replacements do (a spare node's)."""
        return False

    def _first_members(self) -> list[int]:
        return list(self.member_of.values())

    def _start_member(self, spec: WorkerSpec, replacing: bool = False) -> None:
        member = self._member_id(spec, replacing)
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        spec.env[FT_MEMBER] = str(member)
        spec.env[FT_KEEP_ALIVE] = ",".join(f"{s:g}" for s in self.keep_alive)
        index = self._start_one(spec, fds={FT_FD: down_r, FT_REPLY_FD: up_w})
        os.close(down_r)
        os.close(up_w)
        self.member_of[index] = member
        self.phases[index] = WorkerPhase.STARTED
        self.liveness[index] = Liveness.UNHEARD
        self.pipes[member] = down_w
        if self.members:
            os.write(down_w, self._view())
        threading.Thread(target=self._read_replies, args=(up_r, index), daemon=True).start()

    def _start_server(self, spec: WorkerSpec) -> None:
        """A parameter server: not a member, but told of the deaths (its waits on another server end when that
        one dies) on a pipe of its own, and beating on one back as a worker does (a stalled server would hold
        every worker's request to it)."""
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        spec.env[FT_KEEP_ALIVE] = ",".join(f"{s:g}" for s in self.keep_alive)
        index = self._start_one(spec, fds={FT_FD: down_r, FT_REPLY_FD: up_w})
        os.close(down_r)
        os.close(up_w)
        self.server_pipes.append(down_w)
        self.liveness[index] = Liveness.UNHEARD
        self._readers[index] = threading.Thread(target=self._read_replies, args=(up_r, index), daemon=True)
        self._readers[index].start()

    def _member_id(self, spec: WorkerSpec, replacing: bool) -> int:
        """A worker's member id: its first rank; a replacement's, the next one unused."""
        member = self._next_member
        self._next_member += 1
        return member

    def _read_replies(self, fd: int, index: int) -> None:
        member = self.member_of.get(index, -1)  # (a parameter server's only beat)
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            for line in pipe:
                self._heard[index] = time.monotonic()
                bye = line.strip() == b"bye"  # exiting: its teardown beats no more (judged after the grace period)
                with self._moving:  # read and moved together: the main loop may kill it meanwhile
                    # (a line read after it was killed or its exit seen, or a beat after its goodbye, leaves it)
                    if bye and self.liveness[index] in (Liveness.UNHEARD, Liveness.BEATING):
                        self._hear(index, Liveness.LEAVING)
                    elif not bye and self.liveness[index] is Liveness.UNHEARD:
                        self._hear(index, Liveness.BEATING)
                if line.strip() == b"channel":
                    self.channel_built = True
                elif line.startswith(b"built "):  # it built a view's group: the job went on past that change
                    self._built[member] = int(line.split()[1])
                elif line.strip() == b"ready":
                    self._ready.put(member)
                elif line.strip() == b"holding":
                    with self._moving:  # read and moved together: the main loop may dismiss it meanwhile
                        if self.phases[index] is WorkerPhase.STARTED:  # not dismissed, its exit not yet seen
                            self._move(index, WorkerPhase.TRAINING)
                    if member >= self.launch.world_size:  # a replacement's or a spare's: it can train now
                        say(f"member {member} holds the training state")
                    self._holds_state(member)

    def _holds_state(self, member: int) -> None:
        """``member`` said it holds the training state (a replies' thread)."""

    def _view(self) -> bytes:
        return (json.dumps(self._view_fields()) + "\n").encode()

    def _view_fields(self) -> dict[str, Any]:
        return {"generation": self.generation, "members": self.members, "servers_gone": sorted(self.dead_servers)}

    def _announce(self) -> None:
        line = self._view()
        for fd in [*self.pipes.values(), *self.server_pipes]:  # a replacement not yet admitted too
            try:
                os.write(fd, line)
            except OSError:
                pass  # it died a moment ago: its exit is in the queue and makes the next view

    def wait(self, watch: Callable[[], RemoteFailure | str | None] | None = None,
             ) -> Failure | RemoteFailure | str | None:
        """Until every live worker exited 0 (None) or none is left (the :class:`Failure` of the first of the deaths
        that ended the job: on one node, the deaths since a member last built a group of a view after a death, a
        sign the job went on from it; the deaths before are each in a line of their own)."""
        first: Failure | None = None
        first_view = 0  # the view announced for `first`
        while self._running() or not self._job_over():
            turn = self._turn()
            if isinstance(turn, Stop):
                return turn.outcome
            if turn is HOLD:
                time.sleep(_POLL_S)  # an exit now is of a worker out of the job, not a death: not yet
                continue
            self._kill_stalled()
            try:
                code, index = self.exits.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._finished():
                    self._admit_ready()
                continue
            if code != 0 and self.phases.get(index) is not WorkerPhase.DISMISSED and self._postpone():
                self.exits.put((code, index))  # stopped while waiting for it: handled after the next turn's check
                continue
            live = self.liveness[index]
            self._hear(index, Liveness.EXITED)
            if self.specs[index].server is not None:
                if code != 0 and not self._channel_was_built(index):
                    say(f"parameter server {self.specs[index].server} died before the channel to the servers was "
                        f"built ({describe_exit(code)}): it is one group of every worker and server, made once, so no "
                        "replica stands in for it there; stopping the job")
                    self.stop()
                    return self._with_stall(self.failure(index, code), index, live)
                if code != 0:
                    if not self.server_replaced(index, code):
                        self.stop()
                        return self._with_stall(self.failure(index, code), index, live)
                    self._announce()  # the same generation: the workers' requests to it stop waiting
                continue
            member = self.member_of[index]
            if self.phases[index] is WorkerPhase.DISMISSED:
                self._move(index, WorkerPhase.GONE)
                continue
            if code != 0 and live is Liveness.CUT_SHORT:
                code = 0  # its program had ended (it said goodbye): only its teardown hung, and was cut short
            if code == 0:
                first_to_finish = not self._finished()
                self._move(index, WorkerPhase.FINISHED)
                if first_to_finish:
                    self._dismiss_joining()
                self._leave(member)
                continue
            started = self.phases[index] is WorkerPhase.STARTED
            self._move(index, WorkerPhase.DIED)
            failure = self._with_stall(self.failure(index, code), index, live)
            no_group = _NO_GROUP in failure.traceback
            if first is not None and self._went_on() and max(tuple(self._built.values()), default=-1) >= first_view:
                first = None  # the job went on from the deaths before: not the cause of a failure to come
            if first is None:
                failure.earlier, first_view = len(self.deaths), self.generation + 1
            first = first or failure
            if started and (code == USAGE_EXIT or no_group):
                # Exit 2 before the worker held the training state: a usage error (a bad flag, a wrong launcher),
                # which every replacement would make again; so is a program written for a default process group.
                # Not a death to survive.
                say(f"member {member} (rank {failure.rank} at the start) exited with code {USAGE_EXIT} before it held "
                    "the training state: a usage error (its own line says which), not a death to survive; stopping "
                    "the job" if not no_group else
                    f"member {member} (rank {failure.rank} at the start) called torch.distributed before it held the "
                    f"training state: {_NO_GROUP_HELP}; stopping the job (a replacement would fail the same way)")
                self.stop()
                return failure
            self._close(member)
            said = [line for line in failure.last_lines if not _TORCH_LOG.match(line)]  # not c10d's warnings
            why = (failure.traceback.splitlines() or said or [""])[-1].strip()
            if live is Liveness.STALLED:
                silence = self._silence(index)
                why = f"{why}; then it stalled: {silence}" if failure.traceback else f"it had stalled: {silence}"
            died = (f"member {member} (rank {failure.rank} at the start) died: {describe_exit(code)}"
                    + (f" ({why})" if why else "") + (f"; {_NO_GROUP_HELP}" if no_group else ""))
            self.deaths.append(Death(member, code, time.time(), self.generation + 1))
            if not self._died(member, died):
                break
            if self.replacements > 0 and not self._finished():
                self.replacements -= 1
                dead = self.specs[index]  # the replacement takes the dead worker's place (rank, local rank, GPU)
                env = {k: v for k, v in dead.env.items() if not k.startswith("DDPKIT_FT_")}
                self._start_member(replace(dead, env=self._replacement_env(env)), replacing=True)
                say(f"started member {self.member_of[len(self.procs) - 1]} to replace it ({self.replacements} "
                    "replacement(s) left); it joins at a step boundary once ready")
        for fd in list(self.pipes):
            self._close(fd)
        self.stop_servers()
        for fd in self.server_pipes:
            os.close(fd)
        return self._outcome(first)

    def _kill_stalled(self) -> None:
        """Kill the workers in the job and the parameter servers that beat once and then fell silent for the
        keep-alive's timeout, or that the system says were stopped that long before their first beat (the module
        notes); their exits come as deaths. A launcher held up for half that timeout itself (paused, or starved)
        judges nobody this turn: the beats may be waiting unread in their pipes."""
        now = time.monotonic()
        interval, timeout = self.keep_alive
        if now - self._swept > timeout / 2:
            self._heard = dict.fromkeys(tuple(self._heard), now)  # (a replies' thread may add one meanwhile)
            self._stopped_since = dict.fromkeys(self._stopped_since, now)
        self._swept = now
        servers = [i for i, spec in enumerate(self.specs) if spec.server is not None]
        for index in [*self._in_job(), *servers]:
            with self._moving:  # judged and moved together: a replies' thread may read its goodbye meanwhile
                live = self.liveness[index]
                if live is Liveness.UNHEARD:
                    if not self._stopped_too_long(index, now):
                        continue
                elif not live.judged or now - self._heard.get(index, now) <= self._limit(index):
                    continue
                leaving = live is Liveness.LEAVING
                self._hear(index, Liveness.CUT_SHORT if leaving else Liveness.STALLED)
            spec = self.specs[index]
            who = (f"parameter server {spec.server}" if spec.server is not None
                   else f"member {self.member_of[index]} (rank {spec.rank} at the start)")
            if live is Liveness.UNHEARD:
                say(f"{who} was stopped (a SIGSTOP, or a debugger's stop) before its first beat and stayed so for "
                    f"{timeout:g} s: killing it "
                    "so that the job goes on without it (--rdzv-conf keep_alive_interval x keep_alive_max_attempt "
                    "sets how long)")
            elif leaving:
                say(f"{who} is still exiting {self._limit(index):g} s after its goodbye (the keep-alive's timeout "
                    "and --shutdown-timeout): killing it; its program had ended, so it counts as finished")
            else:
                say(f"{who} sent no word for {timeout:g} s (a beat is due every {interval:g} s): it stalled (paused, "
                    "or holding Python's lock); killing it so that the job goes on without it (--rdzv-conf "
                    "keep_alive_interval x keep_alive_max_attempt sets how long)")
            signal_groups([self.procs[index]], signal.SIGKILL)

    def _stopped_too_long(self, index: int, now: float) -> bool:
        """Whether the system has said process ``index`` is stopped for longer than the keep-alive's timeout (one
        that has not beaten yet: its program may take any time to start, but a stopped one makes no progress)."""
        if not process_stopped(self.procs[index].pid):
            self._stopped_since.pop(index, None)
            return False
        return now - self._stopped_since.setdefault(index, now) > self.keep_alive[1]

    def _channel_was_built(self, index: int) -> bool:
        """Whether the servers' channel was built before process ``index`` (a server) exited: its own pipe back is
        read to its end first (a last line may be on its way)."""
        if not self.channel_built:
            self._readers[index].join(timeout=1.0)
        return self.channel_built

    def _with_stall(self, failure: Failure, index: int, live: Liveness) -> Failure:
        """``failure``, the exit of process ``index`` whose liveness was ``live``, saying that its launcher killed
        it for its silence, if it did."""
        if live is Liveness.STALLED:
            failure.last_lines = [*failure.last_lines,
                                  f"(killed by its launcher: it had stalled, {self._silence(index)})"]
        return failure

    def _silence(self, index: int) -> str:
        """How process ``index``, killed as stalled, was silent."""
        if index not in self._heard:
            return f"stopped before its first beat for {self.keep_alive[1]:g} s"
        return f"no word from it for {self._limit(index):g} s"

    # -- what one node decides alone (CouncilGroup asks the nodes' majority instead) ---------------

    def _job_over(self) -> bool:
        """Whether the job is over once this node's workers are: here, always."""
        return True

    def _turn(self) -> Turn:
        """What the loop does before it waits for the next exit: go on (this launcher is the job's word)."""
        return GO

    def _limit(self, index: int) -> float:
        """How long process ``index`` may be silent: the keep-alive's timeout; after its goodbye, the shutdown grace
        period more (its teardown)."""
        return self.keep_alive[1] + (self.launch.grace_period_s if self.liveness[index].leaving else 0.0)

    def _went_on(self) -> bool:
        """Whether the job went on from the deaths handled so far (one node: it did, since :meth:`_died` did not
        say otherwise); across nodes the majority decides later, and the first death stays the cause of a
        failure."""
        return True

    def _postpone(self) -> bool:
        """Whether a worker's exit is handled after the next turn instead (never here)."""
        return False

    def _replacement_env(self, env: dict[str, str]) -> dict[str, str]:
        """The environment of a replacement (it meets on the store the dead worker met on)."""
        return env

    def _outcome(self, first: Failure | None) -> Failure | str | None:
        """What the job ended with once no worker is left: success if one finished, else the first death it did not
        go on from."""
        return None if self._finished() else first

    def _died(self, member: int, died: str) -> bool:
        """``member`` died (``died`` says how): the next view, said; False when the job cannot go on."""
        return self._drop(member, died)

    def _move(self, index: int, phase: WorkerPhase) -> None:
        """Move worker ``index`` to ``phase`` (the only place a phase changes; :data:`WORKER_MOVES` says which
        moves exist)."""
        with self._moving:
            check_move(WORKER_MOVES, self.phases[index], phase, f"member {self.member_of[index]}'s worker")
            self.phases[index] = phase

    def _hear(self, index: int, liveness: Liveness) -> None:
        """What process ``index``'s beats say now (the only place a liveness changes; :data:`LIVENESS_MOVES` says
        which moves exist)."""
        with self._moving:
            check_move(LIVENESS_MOVES, self.liveness[index], liveness, f"process {index}'s liveness")
            self.liveness[index] = liveness

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
        self._left([member])

    def _left(self, members: list[int]) -> None:
        """These members left the job (finished, or dismissed before they held the state): the next view."""
        if any(m in self.members for m in members):
            self.members = [m for m in self.members if m not in members]
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
                + (f" (stopping {len(waiting)} replacement(s) that had not received it)" if waiting else ""))
            self._dismiss(waiting)
            return False
        say(f"{died}; the job goes on with {len(self.members)} worker(s), membership generation {self.generation}")
        self._announce()
        return True

    def _holders(self, members: list[int], joined: set[int]) -> list[int]:
        return [m for m in members if m in joined or m < self.launch.world_size]

    def _dismiss_joining(self) -> None:
        """A worker finished, so training is over: stop the replacements that never got the state (they would
        wait for members that are gone, or train alone from the start)."""
        joining = [i for i, phase in self.phases.items()
                   if phase is WorkerPhase.STARTED and self.member_of[i] >= self.launch.world_size]
        if joining:
            say(f"training is over: stopping {len(joining)} replacement(s) that had not received the training "
                "state yet")
            self._dismiss(joining)
            # The next view must not name them (no one waits for them): here it comes with the next change.
            self._left_unannounced([self.member_of[i] for i in joining])

    def _left_unannounced(self, members: list[int]) -> None:
        self.members = [m for m in self.members if m not in members]

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
        if joined:
            self._admit(joined)

    def _admit(self, joined: list[int]) -> None:
        """Ready replacements join the next view."""
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

"""``--on-failure continue`` across nodes: this node's workers, each view the nodes' majority decides.

:class:`CouncilGroup` is :class:`~ddpkit.launcher.fault_tolerant_group.FaultTolerantGroup` with its decisions
handed to the node's :class:`~ddpkit.launcher.council.Council`: this launcher tells it the deaths, the finished,
the ready and the holders, and announces each entry it decides to its workers (with the store they meet on).

A node that the others' majority leaves out while it still runs (wrongly suspected: paused longer than the failure
detector's timeout) stops its workers, whose members are out of the job, and asks to come back as a spare does;
once an entry makes it a voting node again it starts its workers anew, and they join with the state from a peer.
Where the node stands is a :class:`Standing`, moved by :meth:`CouncilGroup._stand` along :data:`STANDING_MOVES`;
whether a turn holds (takes no exit) is decided anew each turn.
"""

from __future__ import annotations

import enum
import time
from dataclasses import replace
from typing import Any

from ddpkit.launcher.council import Council, Entry, Role
from ddpkit.launcher.fault_tolerant_group import GO, HOLD, FaultTolerantGroup, Stop, Turn
from ddpkit.launcher.node_rendezvous import RemoteFailure, rendezvous_timeout
from ddpkit.launcher.output import LogLayout
from ddpkit.launcher.plan import WorkerSpec
from ddpkit.launcher.settings import LaunchSettings
from ddpkit.launcher.supervise import Failure, say
from ddpkit.runtime.process import SignalCatcher
from ddpkit.runtime.states import check_move

__all__ = ["STANDING_MOVES", "CouncilGroup", "Standing"]


class Standing(enum.Enum):
    """Where this node stands in the job, as its launcher acts on the council's entries."""

    FOLLOWING = "following"
    """It acts on each entry (announces its view, takes its workers' exits)."""
    ASKED_BACK = "asked back"
    """It stopped its workers and waits, since :attr:`CouncilGroup._asked_back_at`, to be a voting node again."""


STANDING_MOVES: dict[Standing, frozenset[Standing]] = {
    Standing.FOLLOWING: frozenset({Standing.ASKED_BACK}),
    # A voting node again, or training ended first; or left out again before its launcher saw it come back (the
    # workers it stops are added to those it starts anew).
    Standing.ASKED_BACK: frozenset({Standing.FOLLOWING, Standing.ASKED_BACK}),
}
"""The moves of a node's :class:`Standing`; any other is a bug (:meth:`CouncilGroup._stand` raises)."""


class CouncilGroup(FaultTolerantGroup):
    """This node's workers of a job across nodes (the module notes)."""

    def __init__(self, launch: LaunchSettings, layout: LogLayout, council: Council, replacements: int = 0) -> None:
        super().__init__(launch, layout, replacements)
        self.council = council
        self.entry: Entry = council.entry
        """The council's newest entry this launcher acted on."""
        self.standing = Standing.FOLLOWING
        """Changed by :meth:`_stand` only."""
        self._stopped: list[WorkerSpec] = []
        """The workers this node stopped when it was left out (it starts them anew when it comes back)."""
        self._voters: set[int] = set(council.entry.nodes)
        """Every node that was a voting node in an entry this launcher acted on."""
        self._returns = 0
        """How many of the council's :attr:`~Council.returns` this launcher has acted on."""
        self._asked_back_at = 0.0
        """When this node stepped out (``time.monotonic()``; while :attr:`Standing.ASKED_BACK`)."""
        self._looked = time.monotonic()
        """When the wait loop last ran a turn."""

    def _stand(self, standing: Standing) -> None:
        """Move :attr:`standing` (the only place it changes; :data:`STANDING_MOVES` says which moves exist)."""
        check_move(STANDING_MOVES, self.standing, standing, f"node {self.council.node}'s launcher")
        self.standing = standing

    # -- the decisions, the council's ---------------------------------------------------------------------

    def _replacing_at_start(self) -> bool:
        return self.launch.spare  # a spare node's workers join the running job as replacements do

    def _first_members(self) -> list[int]:
        return list(self.entry.members)

    def start(self, specs: list[WorkerSpec], signals: SignalCatcher) -> None:
        if self.launch.spare:
            self.members, self.generation = list(self.entry.members), self.entry.generation
        super().start(specs, signals)

    def _member_id(self, spec: WorkerSpec, replacing: bool) -> int:
        """A first worker's rank; a replacement's, this node's next one: the world size + the node + a multiple of
        the number of nodes (unique across nodes)."""
        member = (self.launch.world_size + self.council.node + self._next_member * self.launch.max_nodes
                  if replacing else spec.rank)
        self._next_member += 1
        return member

    def _holds_state(self, member: int) -> None:
        self.council.tell(holding=[member])

    def _view_fields(self) -> dict[str, Any]:
        return {**super()._view_fields(), "store": self.entry.store}

    def _job_over(self) -> bool:
        return self.entry.done

    def wait(self, watch: Any = None) -> Failure | RemoteFailure | str | None:
        self._looked = time.monotonic()  # the pause clock starts with the loop (starting the workers is no pause)
        return super().wait(watch)

    def _turn(self) -> Turn:
        now = time.monotonic()  # one reading for the check and the next one: a stop in between counts
        if self._paused():
            # This launcher was stopped (or starved): the others may have left this node out meanwhile, and then
            # its workers are out of the job, and their exits no deaths. Known first, then acted on.
            self.council.confirm(self.council.suspect_s)
            now = time.monotonic()
        self._looked = now
        if not self._running() and not self.council.report.finished and self.standing is not Standing.ASKED_BACK:
            self.council.tell(finished=True, succeeded=self._finished())
        turn = self._follow()
        if isinstance(turn, Stop) or (cut_off := self._come_back()) is not None:
            why = turn.outcome if isinstance(turn, Stop) else cut_off
            return Stop(None if not self._running() and self.council.report.succeeded else why)
        return turn  # HOLD: an entry left this node out and its council has not yet decided

    def _postpone(self) -> bool:
        return self._paused()  # stopped while waiting for the exit: handled after the next turn's check

    def _replacement_env(self, env: dict[str, str]) -> dict[str, str]:
        host, port = self.entry.store.rsplit(":", 1)  # it meets on the store of now (node 0's may be gone)
        return {**env, "MASTER_ADDR": host, "MASTER_PORT": port}

    def _went_on(self) -> bool:
        return False

    def _outcome(self, first: Failure | None) -> Failure | str | None:
        return None if self.entry.succeeded else first or "every worker of the job died"

    def _died(self, member: int, died: str) -> bool:
        self.council.tell(dead=[member])
        say(f"{died}; the nodes' majority decides the next membership")
        return True

    def _left(self, members: list[int]) -> None:
        self.council.tell(left=members)

    def _left_unannounced(self, members: list[int]) -> None:
        self.council.tell(left=members)

    def _admit(self, joined: list[int]) -> None:
        self.council.tell(ready=joined)  # the nodes' majority admits them

    # -- following the entries -----------------------------------------------------------------------------

    def _follow(self) -> Turn:
        """Act on the council's newest entry (announce its view): go on, hold (the entry left this node out and its
        council has not yet asked back), or stop (why, if it was cut off)."""
        entry, returns, role = self.council.standing()
        node = self.council.node
        if returns > self._returns:  # wrongly suspected: its council asks to vote again
            self._returns = returns
            self._step_out(self.council.removal)
        if self._deciding(entry, role):
            return HOLD  # its view is not for this node's workers, who are out of it
        if role is Role.STOPPED and not entry.done:
            if waiting := self._in_job():
                say(f"{self.council.stop_reason}; stopping this node's {len(waiting)} worker(s)")
                self.stop()
            elif self.standing is Standing.ASKED_BACK:  # stopped when it was left out: it waited to be taken back
                say(f"{self.council.stop_reason}; node {node} had stopped its workers when it was left out, and was "
                    "not taken back")
            else:  # its workers are done (exit 0 ends this launcher well): the others' end it cannot see
                say(f"{self.council.stop_reason}; this node's workers had ended")
            return Stop(self.council.stop_reason)
        if entry.index == self.entry.index:
            return GO
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
            return GO
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
                "node that had not received it)")
            self._dismiss(waiting)
        return GO

    def _deciding(self, entry: Entry, role: Role) -> bool:
        """Whether ``entry`` left this voting node out and its council has not yet asked back or stopped (it does
        at its next tick). Not once training is over or the job done: the council then takes no decision (its
        ticks end with the job), and nothing is left to hold for."""
        node = self.council.node
        return (node in self.entry.nodes and node not in entry.nodes and role is Role.VOTING
                and not entry.succeeded and not entry.done)

    def _paused(self) -> bool:
        """Whether this launcher's loop went unrun since its last turn for long enough that the others may have
        judged this node gone (half the failure detector's timeout)."""
        return time.monotonic() - self._looked > self.council.suspect_s / 2

    def _step_out(self, why: str) -> None:
        """The majority left this node out while it ran (``why``): stop its workers (their members are out of the
        job: their exits are no deaths) and wait to be a voting node again (:meth:`_come_back`)."""
        waiting = self._in_job()
        self._stopped += [self.specs[i] for i in waiting]
        say(f"{why}; stopping this node's {len(waiting)} worker(s), whose members are out of "
            f"the job; node {self.council.node} asks to vote again as a spare does")
        self._dismiss(waiting)
        for i in waiting:
            self._close(self.member_of[i])
        self._stand(Standing.ASKED_BACK)
        self._asked_back_at = time.monotonic()

    def _come_back(self) -> str | None:
        """A node left out (:meth:`_step_out`): once an entry names it a voting node again, start its workers
        anew (they join with the state from a peer, as a spare's do). Why it gives up, if it does: not taken
        back within the rendezvous timeout."""
        if self.standing is not Standing.ASKED_BACK:
            return None
        entry, _, role = self.council.standing()
        if entry is not self.entry:
            return None  # followed first (the next turn of the loop)
        node = self.council.node
        if node not in entry.nodes or role is not Role.VOTING:
            if entry.succeeded:
                say(f"node {node}: the job's training ended before it was taken back; nothing left to do")
                self._stand(Standing.FOLLOWING)
                return None
            if time.monotonic() - self._asked_back_at < rendezvous_timeout():
                return None
            why = (f"node {node} was not taken back into the job within {rendezvous_timeout():g} s (waited for the "
                   f"majority of nodes {', '.join(map(str, entry.nodes))})")
            say(why)
            return why
        self._stand(Standing.FOLLOWING)
        say(f"node {node} is a voting node again ({len(entry.nodes)} voting nodes): starting its "
            f"{len(self._stopped)} worker(s) anew; they join at a step boundary with the training state from a peer")
        host, port = entry.store.rsplit(":", 1)
        stopped, self._stopped = self._stopped, []
        for spec in stopped:
            env = {k: v for k, v in spec.env.items() if not k.startswith("DDPKIT_FT_")}
            env["MASTER_ADDR"], env["MASTER_PORT"] = host, port
            self._start_member(replace(spec, env=env), replacing=True)
        return None

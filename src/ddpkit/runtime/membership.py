"""Membership of a job that outlives its workers: views, interruptible waits, and groups rebuilt per view.

Under ``ddpkit launch --on-failure continue`` the launcher owns the job's
membership. It numbers every worker with a *member id* (its first rank; a
replacement gets the next unused one) and, whenever a worker dies or a
replacement is ready, announces a new :class:`View` (a generation and the live
member ids) on a pipe it holds to every worker (``DDPKIT_FT_FD``). A thread
in each worker reads that pipe, so a death is known to every survivor within
milliseconds of the launcher's ``waitpid``, not at a collective's timeout.

Workers never repair a group whose member died: they *abandon* it and build
the group of the new view on a fresh store prefix (``ft/GENERATION/``), ranks in
member order. Gloo cannot abort an operation in flight (measured:
``ProcessGroup.abort()`` leaves it waiting until its timeout), so every wait
of the mode is :meth:`Membership.wait`: it returns when the operation
completes and raises :class:`MembershipChanged` as soon as a newer view
comes (a join too, except in a training step's collectives, whose members
switch to a view that only adds members at a step they agree on). The
abandoned operation keeps its buffers until its own timeout; its owner must
not reuse them.

The pipe carries one JSON line per view (with the parameter servers that
died, which are not members: a server's death is announced in the same
generation); a worker answers on ``DDPKIT_FT_REPLY_FD``: ``ready`` (a
replacement that can take part), ``holding`` (it holds the training state),
``built GENERATION`` (it built that view's group: the job went on past the
change), ``beat`` twice every keep-alive interval from a thread of its own
(``DDPKIT_FT_KEEP_ALIVE``), so that its launcher knows a worker that stopped
(paused, or holding Python's lock) from one that is only slow: a worker silent
for the keep-alive's timeout is killed, and its death is survived as any other;
and ``bye`` at exit (its teardown beats no more, and is no stall).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.runtime import variables
from ddpkit.runtime.sealed_store import marked

__all__ = ["FD_ENV", "MEMBER_ENV", "REPLY_FD_ENV", "Membership", "MembershipChanged", "View", "current",
           "keep_alive_of"]

FD_ENV, REPLY_FD_ENV, MEMBER_ENV = variables.FT_FD, variables.FT_REPLY_FD, variables.FT_MEMBER
KEEP_ALIVE = (1.0, 6.0)
"""The launcher's keep-alive by default (``--rdzv-conf keep_alive_interval`` x ``keep_alive_max_attempt``): a beat
every second, and a worker, or the launcher's word after a failed operation, awaited 6 s."""
_POLL_S = 0.005
_LOOK_S = 0.05
"""How often a wait that lets a join pass looks whether a member went ahead to the joiners' group."""


@dataclass(frozen=True)
class View:
    """One membership: its generation (0 at the start, +1 per change) and the live member ids, in rank order."""

    generation: int
    members: tuple[int, ...]
    servers_gone: tuple[int, ...] = ()
    """The job's parameter servers that died (``--num-servers``; the members go on while their key ranges
    live on another server)."""
    store: str = ""
    """``host:port`` of the store this view's group is built on, across nodes (the launchers' lowest node
    serves it, so it moves when that node is lost); empty: the job's first store."""

    def rank_of(self, member: int) -> int:
        return self.members.index(member)

    @property
    def size(self) -> int:
        return len(self.members)


class MembershipChanged(RuntimeError):
    """A newer view came while this worker waited: abandon what it waited for and rebuild."""

    def __init__(self, view: View, lost: tuple[int, ...]) -> None:
        super().__init__(f"membership generation {view.generation}: member(s) {', '.join(map(str, lost))} left the job")
        self.view = view
        self.lost = lost


class Membership:
    """This worker's side of the launcher's membership: the newest view, and groups built per view.

    Args:
        fd: the read end of the launcher's pipe.
        member: this worker's member id.
        store: the launcher's store (it outlives every worker), under the job's key prefix (None: a process
            that only listens, such as a parameter server, which builds no group).
        timeout_s: the timeout of each group built (an abandoned operation waits at most this long).
        reply_fd: the write end of the pipe back to the launcher, if any.
        reach: opens a connection to the store at ``host:port`` (``""``: the job's first store), under the job's
            key prefix: each group is built on one of its own.
        keep_alive: the launcher's keep-alive (interval, timeout) in seconds: a beat on ``reply_fd`` every
            interval, and the launcher's word awaited that long after a failed operation.
    """

    def __init__(self, fd: int, member: int, store: dist.Store | None, timeout_s: float,
                 reply_fd: int | None = None, reach: Callable[[str], dist.Store] | None = None,
                 keep_alive: tuple[float, float] = KEEP_ALIVE):
        self.member = member
        self.keep_alive = keep_alive
        self.store = store
        self._reach = reach
        self.timeout = timedelta(seconds=timeout_s)
        self._reply_fd = reply_fd
        self._cond = threading.Condition()
        self._views: list[View] = []
        self._closed = False
        self._by_generation: dict[int, dist.ProcessGroup] = {}
        self._group_stores: dict[int, dist.Store] = {}
        """The store each group of ``_by_generation`` met on, kept while the group lives (a sealed store is Python's
        to keep: runtime/sealed_store.py)."""
        """The groups built, by generation; an older one is freed once no abandoned operation of it is left
        (:meth:`_free_old`)."""
        self._abandoned: dict[int, list[threading.Event]] = {}
        """By generation: the operations abandoned on a change (each event set once the operation ended)."""
        self.noticed_at: dict[int, float] = {}
        """``time.time()`` at which each generation's view reached this worker."""
        self._looked = 0.0
        self._lookouts: dict[str, dist.Store] = {}
        """Connections (by ``host:port``) on which a waiting thread looks for members gone ahead."""
        self._reader = threading.Thread(target=self._read, args=(fd,), name="ddpkit-membership", daemon=True)
        self._reader.start()
        self._leaving = False
        self._finals = 0
        """Calls of :meth:`by_the_first` so far (each has its own mark)."""
        if reply_fd is not None:
            threading.Thread(target=self._beat, name="ddpkit-membership-beat", daemon=True).start()
            atexit.register(self._bye)

    def _beat(self) -> None:
        """Tell the launcher this process still runs, twice every keep-alive interval (a beat late by up to half
        an interval is no missed one), until it closes the pipe or this process says goodbye."""
        while not self._closed and not self._leaving:
            self._reply(b"beat\n")
            time.sleep(self.keep_alive[0] / 2)

    def _bye(self) -> None:
        """At exit (``atexit``, while threads still run): no more beats come, and the interpreter's teardown, which
        stops this thread and may outlast the keep-alive, is no stall (its launcher gives it the shutdown grace
        period). Not after an exception escaped: a failing worker holds its peers in their collectives until it
        is gone, so its teardown is judged as any stall."""
        if getattr(sys, "last_value", None) is not None:
            return
        self._leaving = True
        self._reply(b"bye\n")

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            buffered = b""
            while chunk := pipe.read(65536):
                buffered += chunk
                *lines, buffered = buffered.split(b"\n")
                for line in lines:
                    message = json.loads(line)
                    view = View(int(message["generation"]), tuple(int(m) for m in message["members"]),
                                tuple(int(s) for s in message.get("servers_gone", ())), message.get("store", ""))
                    with self._cond:
                        self.noticed_at[view.generation] = time.time()
                        self._views.append(view)
                        self._cond.notify_all()
        with self._cond:
            self._closed = True  # the launcher is gone: die_with_parent ends this process next
            self._cond.notify_all()

    def latest(self, timeout_s: float = 60.0) -> View:
        """The newest view (waiting for the first one to arrive)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._views or self._closed, timeout_s) or not self._views:
                raise RuntimeError("the launcher announced no membership: is this process started by "
                                   "ddpkit launch --on-failure continue?")
            return self._views[-1]

    def left(self, members: range | list[int]) -> list[int]:
        """Which of ``members`` the newest view no longer has (none before the first view)."""
        with self._cond:
            newest = self._views[-1].members if self._views else None
        return [] if newest is None else [m for m in members if m not in newest]

    def server_gone(self, server: int) -> bool:
        """Whether the launcher announced parameter server ``server``'s death."""
        with self._cond:
            return bool(self._views) and server in self._views[-1].servers_gone

    def servers_lost(self, servers: int) -> list[int]:
        """Which of the parameter servers ``0 .. servers - 1`` the launcher announced dead."""
        with self._cond:
            return [s for s in range(servers) if self._views and s in self._views[-1].servers_gone]

    def lost_since(self, view: View) -> tuple[int, ...]:
        """Members of ``view`` that a newer view no longer has."""
        with self._cond:
            newest = self._views[-1] if self._views else view
        return tuple(m for m in view.members if m not in newest.members) if newest.generation > view.generation else ()

    def wait(self, work: Any, view: View, *, joins: bool = True) -> None:
        """Wait for ``work`` (a torch Work or Future); raise :class:`MembershipChanged` when a newer view comes.

        ``joins=False``: a newer view that only adds members does not end the wait (a collective of a training
        step, which the members finish in ``view`` and switch after, at a step they agree on: see
        :meth:`knows_a_join`); one that loses a member of ``view``, or this member, does.

        Raises:
            MembershipChanged: the membership changed (a member left, or one joins); ``work`` is abandoned.
            RuntimeError: the operation failed while the view stayed whole (after waiting briefly for the
                launcher's word, since a broken connection is usually a death it is about to announce).
        """
        future = work.get_future() if hasattr(work, "get_future") else work  # a Work, or a future (a comm hook's)
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        while not done.wait(_POLL_S):
            try:
                self._check(view, joins=joins)
            except MembershipChanged:
                if done.is_set():
                    break  # it completed meanwhile: its result stands (the change is met at the next one)
                self._abandoned.setdefault(view.generation, []).append(done)  # its group is freed once it ends
                raise
        try:
            future.wait()
        except Exception:
            # A peer's death reaches gloo as a reset connection, often before the launcher's word reaches us.
            self._expect_change(view)
            raise

    def knows_a_join(self, view: View) -> bool:
        """Whether a newer view than ``view`` came that keeps every member of it (and this one): members only
        join. The members switch to it together, at the first step boundary after a step in which each of
        them knew of it (they tell each other with the step's reduction), so that no healthy step is aborted
        and no member waits in the next group for one still in this one's step."""
        with self._cond:
            newest = self._views[-1] if self._views else view
        return newest.generation > view.generation and self.member in newest.members and not self.lost_since(view)

    def _expect_change(self, view: View) -> None:
        """After a failed operation: raise :class:`MembershipChanged` if a newer view comes within the keep-alive's
        timeout (a launcher held up that long is judged as a stalled worker is)."""
        deadline = time.monotonic() + self.keep_alive[1]
        while time.monotonic() < deadline:
            self._check(view)
            with self._cond:
                self._cond.wait(0.05)
        sys.stderr.write(f"ddpkit: member {self.member}: an operation of membership generation {view.generation} "
                         f"failed and the launcher announced no change within {self.keep_alive[1]:g} s (--rdzv-conf "
                         "keep_alive_interval x keep_alive_max_attempt): not a death it saw, or the launcher was "
                         "held up; this worker stops with the error below\n")
        sys.stderr.flush()

    def _check(self, view: View, *, joins: bool = True) -> None:
        # Any newer view ends the wait, a join too (unless the caller switches at an agreed step, `joins=False`):
        # a member that saw it first has left this view's group to build the next one, so an operation here
        # could never complete. A join passes only while no member of `view` has gone to a newer group (one
        # that finished a rebuild's last operation after this one gave it up).
        if (newest := self.latest()).generation > view.generation:
            if joins or not self.knows_a_join(view) or self._gone_ahead(view, newest):
                raise MembershipChanged(newest, self.lost_since(view))
        if self._closed:
            raise RuntimeError("the launcher closed the membership pipe (it stopped): this worker stops too")

    def _gone_ahead(self, view: View, newest: View) -> bool:
        """Whether a member of ``view`` arrived at the group of a view up to ``newest`` (looked up at most every
        :data:`_LOOK_S`, while a join is pending): it left ``view``'s group, so no operation there completes."""
        now = time.monotonic()
        if now - self._looked < _LOOK_S or (self._reach is None and self.store is None):
            return False
        self._looked = now
        with self._cond:
            later = [v for v in self._views if view.generation < v.generation <= newest.generation]
        for v in later:
            if v.store not in self._lookouts:  # one connection per store, this thread's own
                self._lookouts[v.store] = self._store_of(v)
            # (each arrival mark sealed: a store client cannot make one up, as it could raise a counter)
            if any(marked(self._lookouts[v.store], f"ft/{v.generation}/arrived/{m}")
                   for m in v.members if m in view.members):
                return True
        return False

    def barrier(self) -> View:
        """Wait until every member of the newest view got here; after a change, until every member of the next
        one did. The view it ended in."""
        while True:
            view = self.latest()
            if self.member not in view.members:
                raise RuntimeError(f"member {self.member} is not in membership generation {view.generation}: a "
                                   "replacement joins through ddpkit.FaultTolerance")
            try:
                self.wait(self.group(view).allreduce([torch.zeros(1)]), view)
                return view
            except MembershipChanged:
                continue

    def by_the_first(self, view: View, work: Callable[[list[int]], None]) -> None:
        """``work(alive)`` done once, by the first member of ``view`` still alive (a run's final files; ``alive``:
        the members of ``view`` still in the job), while the others wait for it: when the one doing it dies
        first, the next one does it again, so a death at the very end loses nothing that a survivor holds.

        A mark in the store says it is done (not a collective: a replacement admitted at the end, still in its
        state agreement on the newest view's group, must meet no collective of the members there; the
        launcher stops it once a member finishes). Every member calls it as often as the others, each with the
        view it ended in (views a death or a join apart name the same first member alive). Every wait is bounded
        by the liveness of the one doing the work: its death, or its silence (the launcher kills a stalled
        worker), makes the next view; so does the loss of the store's node (the next view names the store's new
        place).
        """
        self._finals += 1
        done = f"ft/final/{self._finals}/done"  # (not the view's: members may end in views a death apart)
        stores: dict[str, dist.Store] = {}  # this thread's own connection per store (the store moves with node 0)
        worked = False
        while True:
            newest = self.latest()
            alive = [m for m in view.members if m in newest.members]
            try:
                if newest.store not in stores:
                    stores[newest.store] = self._store_of(newest)
                if marked(stores[newest.store], done):
                    return
                if worked:  # (again when its mark was lost with a store)
                    stores[newest.store].set(done, str(self.member))
                    return
            except Exception:  # noqa: BLE001 - the store's node lost: its next place comes with the next view
                stores.pop(newest.store, None)
                try:
                    self._expect_change(newest)
                except MembershipChanged:
                    continue
                raise
            if alive and alive[0] == self.member:
                work(alive)  # (its own failure is its own: not taken for the store's)
                worked = True
                continue
            if self._closed:
                raise RuntimeError("the launcher closed the membership pipe while the run's last files were being "
                                   "written: this worker stops too")
            with self._cond:
                self._cond.wait(_LOOK_S)

    def group(self, view: View, *, free_old: bool = False) -> dist.ProcessGroup:
        """The gloo group of ``view`` (this worker's rank: its place in ``view.members``), built once per view.

        ``free_old``: let go of earlier views' groups (:meth:`_free_old`), for a caller that waits on every
        operation it issues through :meth:`wait` (so every abandoned one is known); a caller that leaves
        operations in flight unwaited (SSP's) keeps them, since destroying a group with one in flight blocks
        until that operation's timeout.

        Every member first marks its arrival in the store and waits for the others, watching the view, so a
        member that dies before arriving makes this raise :class:`MembershipChanged` instead of hanging.
        """
        if view.generation in self._by_generation:
            return self._by_generation[view.generation]
        prefix = f"ft/{view.generation}/"
        built: dict[str, Any] = {}
        done, abandoned = threading.Event(), threading.Event()

        def build() -> None:  # on a thread: the store itself may die with its node (or hang, cut off)
            try:
                store = built["store"] = self._store_of(view)
                mine = f"{prefix}arrived/{self.member}"
                store.set(mine, "1")  # (also what members still in an older group look for: _gone_ahead)
                keys = [f"{prefix}arrived/{m}" for m in view.members]
                deadline = time.monotonic() + self.timeout.total_seconds()
                # (each mark opened: one a client of the store forged, or wrote over a member's, is none)
                while not (store.check(keys) and all(marked(store, key) for key in keys)):  # (the cheap look first)
                    if not marked(store, mine):  # deleted or overwritten by a client of the store (it admits
                        store.set(mine, "1")  # any): again
                    if time.monotonic() > deadline:  # (one deleted after its member went on: bounded)
                        missing = [m for m in view.members if not marked(store, f"{prefix}arrived/{m}")]
                        raise RuntimeError(f"membership generation {view.generation}: member(s) "
                                           f"{', '.join(map(str, missing))} did not arrive within "
                                           f"{self.timeout.total_seconds():g} s")
                    if abandoned.wait(_POLL_S):
                        return
                built["group"] = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}group/", store),
                                                       view.rank_of(self.member), view.size, self.timeout)
            except Exception as e:  # noqa: BLE001 - re-raised on the caller's thread
                built["error"] = e
            done.set()

        threading.Thread(target=build, name=f"ddpkit-group-{view.generation}", daemon=True).start()
        try:
            while not done.wait(_POLL_S):
                self._check(view)
            if "error" in built:
                self._expect_change(view)  # a member, or the store's node, died: the launchers are about to say
                raise built["error"]
        finally:
            abandoned.set()
        self._by_generation[view.generation] = built["group"]
        self._group_stores[view.generation] = built["store"]
        self._reply(f"built {view.generation}\n".encode())  # the job went on past that view's change
        if free_old:
            self._free_old(view.generation)
        return built["group"]

    def _free_old(self, current: int) -> None:
        """Let go of the groups of views before ``current`` whose abandoned operations have all ended (completed,
        or failed at the group's timeout): a group with one still in flight would block its destructor until
        then, so it is kept until a later rebuild finds it done."""
        for generation in [e for e in self._by_generation if e < current]:
            if all(done.is_set() for done in self._abandoned.get(generation, [])):
                del self._by_generation[generation]
                self._group_stores.pop(generation, None)
                self._abandoned.pop(generation, None)

    def _store_of(self, view: View) -> dist.Store:
        """A connection of its own to the store ``view``'s group meets on (the first one, or the one the launchers
        moved it to): a group abandoned while it was being built may hold its connection in a wait."""
        assert self.store is not None, "a listening Membership builds no group"
        return self.store if self._reach is None else self._reach(view.store)

    def wait_for_member(self, view: View) -> None:
        """Wait for a view newer than ``view`` (a replacement waits for the view that admits it)."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._views[-1].generation > view.generation)
            if self._closed:
                raise RuntimeError("the launcher closed the membership pipe before admitting this worker")

    def ready(self) -> None:
        """Tell the launcher this (replacement) worker can join the next view."""
        self._reply(b"ready\n")

    def holds_state(self) -> None:
        """Tell the launcher this worker holds the training state (a replacement stopped before that has none)."""
        self._reply(b"holding\n")

    def channel_built(self) -> None:
        """Tell the launcher this parameter server's channel to the workers is built (one group of every worker
        and server, made once: a server lost before that ends the job)."""
        self._reply(b"channel\n")

    def _reply(self, line: bytes) -> None:
        if self._reply_fd is not None:
            try:
                os.write(self._reply_fd, line)
            except OSError:
                pass  # the launcher is gone: the membership pipe says so too


_membership: Membership | None = None


def current(store: dist.Store | None = None, timeout_s: float = 1800.0,
            reach: Callable[[str], dist.Store] | None = None) -> Membership | None:
    """This process's :class:`Membership` when its launcher runs the job with ``--on-failure continue``, else None.

    ``store`` (the launcher's store, under the job's prefix) is needed the first time.
    """
    global _membership
    if _membership is None and (fd := os.environ.get(FD_ENV)):
        if store is None:
            raise RuntimeError("membership: the first call needs the launcher's store")
        reply = os.environ.get(REPLY_FD_ENV)
        _membership = Membership(int(fd), int(os.environ[MEMBER_ENV]), store, timeout_s,
                                 int(reply) if reply else None, reach, keep_alive_of(os.environ))
    return _membership


def keep_alive_of(environ: Mapping[str, str]) -> tuple[float, float]:
    """The keep-alive its launcher gave this worker (``DDPKIT_FT_KEEP_ALIVE``, ``INTERVAL,TIMEOUT``), else
    :data:`KEEP_ALIVE`."""
    given = environ.get(variables.FT_KEEP_ALIVE)
    if not given:
        return KEEP_ALIVE
    interval, timeout = (float(part) for part in given.split(","))
    return interval, timeout

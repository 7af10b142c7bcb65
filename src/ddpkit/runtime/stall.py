"""The stall inspector: which collective each rank is in, and who keeps the others waiting.

Every collective ddpkit issues first announces itself
(:func:`ddpkit.runtime.events.collective`: a name such as ``"DDP bucket {}
all-reduce"``, its arguments and step, formatted only when shown). The
inspector reads that record; the training path pays for the announcement
alone, no I/O.

A daemon thread per rank (the *inspector*, started by :func:`ddpkit.init` in
a world of two or more) publishes this rank's state to the rendezvous store
every :data:`INTERVAL_S`: its sequence number, its last few collectives and a
heartbeat. When this rank's current collective has waited longer than the
stall threshold it reads every rank's state and, if some ranks have not
reached that collective, the most advanced rank with the lowest number
prints once, on stderr::

    ddpkit stall: rank 1 stalled: collective #57 "DDP bucket 0 all-reduce, step 12" waited 61 s on rank 0 for it
    ddpkit stall:   rank 1: last collective #56 "broadcast buffers, step 12", 62 s ago; no heartbeat for 61 s: \
process stopped or hung

Ranks whose recent collectives differ at the same sequence number (one rank
issued an extra collective, or skipped one) are reported naming both
operations. Waiting goes on; when the collective then fails (its timeout, a
broken connection) the failing rank prints the report once more, freshly
taken, before its traceback, and ``ddpkit launch`` shows that report as the
root cause instead of the rank that waited.

Settings (environment):

``DDPKIT_STALL_WARN``
    Seconds a collective may wait before the report (default
    :data:`DEFAULT_WARN_S`); ``0`` turns the inspector off (no thread, no
    heartbeat, no report, no line for refused processes). The report comes
    earlier when the collective timeout is shorter, so it is never lost.

Rank 0's inspector also prints a line for each process the rendezvous
refused for not presenting the job's secret (see :func:`ddpkit.init`).

Heartbeat ages compare wall clocks, exact on one machine and as good as the
nodes' clock synchronisation across machines.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from ddpkit.runtime import events, variables
from ddpkit.runtime.network import BoundedStore

DEFAULT_WARN_S = 60.0
"""Default stall threshold in seconds (``DDPKIT_STALL_WARN``)."""
INTERVAL_S = 1.0
"""How often each rank publishes its state at least (its heartbeat)."""
_TICK_S = 0.25
"""How often the inspector looks: a new collective is published within this."""
PREFIX = "ddpkit stall: "
"""Every line of a report starts with this (``ddpkit launch`` looks for it)."""
_KEY = "ddpkit-stall/"
_CALL_TIMEOUT_S = 3.0
"""Longest one store call may take before the store counts as gone."""
REFUSED_KEY = "ddpkit/refused"
"""Counter, at the store's root, of processes the rendezvous refused (no or wrong job secret);
``REFUSED_KEY/N`` describes the N-th. Rank 0's inspector reports each one."""


def _op(state: dict[str, Any], seq: int | None = None) -> str:
    if seq is None or seq == state["seq"]:
        return f'#{state["seq"]} "{state["op"]}"' if state["seq"] else "no collective yet"
    for s, name in state["recent"]:
        if s == seq:
            return f'#{s} "{name}"'
    return f"#{seq}"


def diagnose(me: int, states: dict[int, dict[str, Any] | None], now: float, stale_s: float) -> list[str]:
    """The report lines (without :data:`PREFIX`) on ``states`` as seen by rank ``me``; empty when all is well.

    Laggards are ranks that have not reached the most advanced rank's
    collective; a mismatch is two ranks naming one sequence number differently.
    """
    known = {r: s for r, s in states.items() if s is not None}
    if not known:
        return []
    lines: list[str] = []
    # A mismatch: the same sequence number, different operations.
    by_seq: dict[int, dict[str, list[int]]] = {}
    for r, s in known.items():
        for seq, name in s["recent"]:
            by_seq.setdefault(seq, {}).setdefault(name, []).append(r)
    for seq in sorted(by_seq):
        names = by_seq[seq]
        if len(names) > 1:
            parts = "; ".join(f'{_ranks(rs)} issued "{n}"'
                              for n, rs in sorted(names.items(), key=lambda kv: min(kv[1])))
            lines.append(f"ranks disagree on collective #{seq}: {parts} (a collective issued on some ranks only; "
                         "every rank must issue the same collectives in the same order)")
            break
    top = max(s["seq"] for s in known.values())
    ahead = sorted(r for r, s in known.items() if s["seq"] == top)
    behind = sorted(r for r in states if r not in ahead)
    if top and behind:
        lead = known[ahead[0]]
        waited = now - lead["since"]
        lines.append(f"{_ranks(behind)} stalled: collective {_op(lead)} waited {waited:.0f} s on "
                     f"{_ranks(ahead)} for {'it' if len(behind) == 1 else 'them'}")
        for r in behind:
            s = states[r]
            if s is None:
                lines.append(f"  rank {r}: never published a heartbeat: process not started, stopped or hung early")
                continue
            if s.get("ended"):
                where = f"last seen entering {_op(s)}" if s["seq"] else "no collective"
                lines.append(f"  rank {r} ({s['host']}, pid {s['pid']}): {where}; then its process {s['ended']} "
                             "before issuing this collective: a collective some ranks never call")
                if "zero-3" in str(lead.get("op", "")):
                    lines.append("  a ZeRO-3 model's state_dict() and forward gather its parameters: a collective "
                                 "every rank calls (not `if rank == 0: model.state_dict()`; see ddpkit.save_sharded)")
                continue
            beat = now - s["wall"]
            where = f"last seen entering {_op(s)}, {now - s['since']:.0f} s ago" if s["seq"] else "no collective yet"
            alive = (f"no heartbeat for {beat:.0f} s: process stopped, hung or gone" if beat > stale_s
                     else f"heartbeat {beat:.1f} s ago: running, but not reaching the collective (slow, or in a "
                     "loop, or waiting for something else)")
            lines.append(f"  rank {r} ({s['host']}, pid {s['pid']}): {where}; {alive}")
    return lines


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _threshold(warn_s: float, timeout_s: float) -> float:
    # Before the collective timeout, whatever the warning setting: the report
    # must come out while the waiting rank is still alive to print it.
    return max(1.0, min(warn_s, timeout_s - 3 * INTERVAL_S))


class Inspector(threading.Thread):
    """Publishes this rank's state and reports stalls; one per process (see the module notes)."""

    def __init__(self, root: Any, prefix: str, rank: int, world_size: int, warn_s: float, timeout_s: float,
                 store_owner: str = "rank 0") -> None:
        super().__init__(name="ddpkit-stall-inspector", daemon=True)
        import torch.distributed as dist

        from ddpkit.runtime.discovery import JOB_TOKEN_ENV
        from ddpkit.runtime.sealed_store import seal

        # Every store call is bounded: the process serving the store may be
        # the one that stopped, and a call to it would never return.
        self.root = BoundedStore(root, _CALL_TIMEOUT_S)
        self.store = BoundedStore(seal(dist.PrefixStore(prefix, root), os.environ.get(JOB_TOKEN_ENV), prefix),
                                  _CALL_TIMEOUT_S)
        self.store_owner = store_owner
        self.rank = rank
        self.world_size = world_size
        self.threshold = _threshold(warn_s, timeout_s) if warn_s else float("inf")
        self._refused = 0
        self._stop_event = threading.Event()
        self._reported = 0
        self._published = (-1, 0.0)
        self._broken = False
        self._lock = threading.Lock()

    def run(self) -> None:
        while not self._stop_event.wait(_TICK_S):
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - the store is gone: say so once, stop watching
                if not self._stop_event.is_set():
                    self._store_gone(e)
                return

    def stop(self, ended: str | None = None) -> None:
        """Stop watching; with ``ended`` (how this process ends), publish it last, so that a peer waiting for this
        rank in a collective is told it will never come (one bounded store call; the store may be gone)."""
        self._stop_event.set()
        if ended is not None and not self._broken:
            try:
                self.store.set(f"{_KEY}{self.rank}", json.dumps({**events.snapshot(), "ended": ended}))
            except Exception:  # noqa: BLE001 - the store (rank 0's process) may be gone first
                pass

    def _store_gone(self, error: Exception) -> None:
        with self._lock:
            if self._broken:
                return
            self._broken = True
        from ddpkit.runtime.sealed_store import ForgedValue

        if isinstance(error, ForgedValue):  # it answers, with a value the job's secret did not seal
            _print([f"stopped watching: {error}"])
            return
        _print([f"the rendezvous store stopped answering ({type(error).__name__}): {self.store_owner}, which serves "
                "it, is stopped, hung or gone"])

    def publish(self) -> dict[str, Any]:
        state = events.snapshot()
        self.store.set(f"{_KEY}{self.rank}", json.dumps(state))
        self._published = (state["seq"], state["wall"])
        return state

    def read_all(self) -> dict[int, dict[str, Any] | None]:
        keys = [f"{_KEY}{r}" for r in range(self.world_size)]
        # One round trip when every rank has published (the usual case), one per rank otherwise.
        present = [True] * len(keys) if self.store.check(keys) else [self.store.check([k]) for k in keys]
        values = self.store.multi_get([k for k, p in zip(keys, present) if p]) if any(present) else []
        it = iter(values)
        return {r: (json.loads(next(it)) if p else None) for r, p in enumerate(present)}

    def tick(self) -> None:
        seq, now = events.sequence(), time.time()
        if seq == self._published[0] and now - self._published[1] < INTERVAL_S:
            return
        mine = self.publish()
        if self.rank == 0:
            self._report_refused()
        now = mine["wall"]
        if not mine["seq"] or now - mine["since"] < self.threshold or self._reported == mine["seq"]:
            return
        states = self.read_all()
        states[self.rank] = mine
        lines = diagnose(self.rank, states, now, stale_s=3 * INTERVAL_S)
        if lines and self._is_reporter(states):
            self._reported = mine["seq"]
            _print(lines + ["  still waiting; the job fails at the collective timeout (DDPKIT_TIMEOUT)"])

    def _report_refused(self) -> None:
        count = self.root.add(REFUSED_KEY, 0)
        while self._refused < count:
            self._refused += 1
            # Written by a process without the job's secret (which is why it was refused): its words, on one
            # escaped line of at most 200 characters, never lines of the job's own.
            who = ascii(self.root.get(f"{REFUSED_KEY}/{self._refused}").decode(errors="replace"))[1:-1][:200]
            sys.stderr.write(f"ddpkit: the rendezvous refused {who}; the job goes on without it\n")
            sys.stderr.flush()

    def _is_reporter(self, states: dict[int, dict[str, Any] | None]) -> bool:
        """The lowest-numbered rank among the most advanced prints, so the report comes once."""
        known = {r: s for r, s in states.items() if s is not None}
        top = max(s["seq"] for s in known.values())
        return self.rank == min(r for r, s in known.items() if s["seq"] == top)

    def final_report(self) -> None:
        """After a failed collective: publish, give the others one interval to publish, report.

        Bounded in time: the process is failing and must exit.
        """
        if self._broken:
            return  # the store is gone, and that was reported
        thread = threading.Thread(target=self._final_report, name="ddpkit-stall-final", daemon=True)
        thread.start()
        thread.join(2 * INTERVAL_S + 2 * _CALL_TIMEOUT_S)

    def _final_report(self) -> None:
        try:
            mine = self.publish()
            deadline = time.monotonic() + 2 * INTERVAL_S + 0.5
            while True:
                states = self.read_all()
                states[self.rank] = mine
                fresh = all(s is not None and s["wall"] >= mine["wall"] - 0.1 for s in states.values())
                if fresh or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            # A live rank publishes within INTERVAL_S: one silent since this
            # rank failed (and the wait began) has stopped, hung or gone.
            now = time.time()
            lines = diagnose(self.rank, states, now, stale_s=min(3 * INTERVAL_S, max(0.5, now - mine["wall"] - 0.25)))
        except Exception as e:  # noqa: BLE001 - diagnosis is best effort while the job is failing
            if isinstance(e, TimeoutError):
                self._store_gone(e)
            return
        if lines:
            _print(lines + [f"  rank {self.rank}'s collective failed; the error follows"])


def _print(lines: list[str]) -> None:
    sys.stderr.write("".join(f"{PREFIX}{line}\n" for line in lines))
    sys.stderr.flush()


_inspector: Inspector | None = None
_COLLECTIVE_ERRORS = ("gloo", "Gloo", "NCCL", "nccl", "Connection closed", "Connection reset", "Timed out", "timed out")


def warn_seconds() -> float:
    """``DDPKIT_STALL_WARN`` in seconds (0: off), validated (:mod:`ddpkit.runtime.variables`)."""
    return variables.stall_warn_seconds(os.environ, DEFAULT_WARN_S)


def start(host: str, port: int, prefix: str, rank: int, world_size: int, timeout_s: float) -> Inspector | None:
    """Start this process's inspector on its own connection to the store at ``host:port``."""
    global _inspector
    warn_s = warn_seconds()
    if warn_s == 0 or world_size < 2:
        return None
    stop()
    import torch.distributed as dist

    client = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=max(5.0, 3 * INTERVAL_S)),
                           wait_for_workers=False)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    _inspector = Inspector(client, prefix, rank, world_size, warn_s, timeout_s,
                           store_owner="the launcher on node 0" if agent else "rank 0")
    _inspector.start()
    _install_excepthook()
    atexit.unregister(stop_at_exit)  # once, however often init() runs
    atexit.register(stop_at_exit)
    return _inspector


def stop_at_exit() -> None:
    """:func:`stop`, saying how this process ends: with an exception that escaped its main thread, or without."""
    stop("exited with an exception (exit code 1)" if _UNHANDLED else "exited without an exception")


_UNHANDLED: list[BaseException] = []
"""An exception that escaped the main thread (seen by the excepthook): the process exits with code 1."""


def stop(ended: str | None = None) -> None:
    """Stop the inspector and wait for its thread (``ddpkit.shutdown``, and at exit through :func:`stop_at_exit`);
    ``ended`` says how this process ends, for its peers' reports.

    Waiting matters: a thread still inside a store call while the process
    group and the store are torn down can abort the process at exit.
    """
    global _inspector
    inspector, _inspector = _inspector, None
    if inspector is not None:
        inspector.stop(ended)
        if inspector.is_alive() and inspector is not threading.current_thread():
            inspector.join(_CALL_TIMEOUT_S + 1.0)


def _install_excepthook() -> None:
    if getattr(sys.excepthook, "_ddpkit_stall", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):  # noqa: ANN001 - sys.excepthook's signature
        _UNHANDLED.append(exc)
        inspector = _inspector
        if inspector is not None and inspector.threshold != float("inf") and is_collective_error(exc):
            inspector.final_report()
        previous(exc_type, exc, tb)

    hook._ddpkit_stall = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def is_collective_error(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it chains) is a failed collective: a timeout or a broken peer."""
    seen = 0
    while exc is not None and seen < 8:
        if type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistError") or (
            isinstance(exc, RuntimeError) and any(k in str(exc) for k in _COLLECTIVE_ERRORS)
        ):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False

"""Where a group's MPI calls run: one progress thread per group, in the order the caller issued them.

torch's collectives return a :class:`MPIWork` at once; the group's progress
thread runs the operations one after the other, in issue order (every rank
issues a group's collectives in the same order, so the threads meet), and
completes each work's future. mpi4py releases the GIL inside MPI calls, so a
bucket's all-reduce moves bytes while autograd computes the next gradients:
this is what makes DDP's overlap work on this backend.

Point-to-point operations are posted at once, from the caller's thread, as
nonblocking requests (a blocking send in the progress thread would hold up
every collective behind it, and two ranks sending to each other would wait
forever); a second thread of the group completes them as MPI reports them
done, in whatever order that is.

MPI cannot cancel a call. A collective that outlives the group's timeout
(``DDPKIT_TIMEOUT``, else 30 minutes) is reported with its rank, group and
operation, and then the whole job is aborted (``MPI_Abort``), as NCCL's
watchdog tears a process down: the alternative is a job that hangs.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

__all__ = ["MPIWork", "Progress"]


class MPIWork(dist.Work):
    """The handle torch's ``async_op=True`` collectives return on this backend.

    ``wait()`` blocks until the operation is done (re-raising its error),
    ``get_future()`` is completed with the output tensors, as gloo's and
    NCCL's are (DDP's comm hooks chain on it).
    """

    def __init__(self, what: str, outputs: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.what = what
        self._outputs = list(outputs)
        self._future: Future = Future()
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        # The future first: whoever wait() releases may read the future's value at once.
        try:
            if error is None:
                self._future.set_result(self._outputs)
            else:
                self._future.set_exception(error)
        finally:
            self._done.set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else None
        if not self._done.wait(seconds if seconds else None):
            raise RuntimeError(f"MPI backend: {self.what} did not complete within {seconds} s (wait's timeout)")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> Future:
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        source = getattr(self, "_source", None)
        if source is None:
            raise RuntimeError(f"MPI backend: {self.what} has no source rank (only a receive from any rank has one)")
        return source

    def _source_rank(self) -> int:
        return self.source_rank()


_STOP = object()


class Progress:
    """A group's progress thread (collectives, in order) and its completer of point-to-point requests."""

    def __init__(self, label: str, timeout_s: float, abort: Callable[[], None]) -> None:
        self.label = label
        self.timeout_s = timeout_s
        self._abort = abort
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._current: tuple[str, float] | None = None
        self._pending: list[tuple[Any, MPIWork, Callable[[Any], None] | None]] = []
        self._pending_lock = threading.Lock()
        self._pending_wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"ddpkit-mpi-{label}", daemon=True)
        self._p2p: threading.Thread | None = None
        self._thread.start()
        _watch(self)

    def submit(self, what: str, run: Callable[[], None], outputs: Sequence[torch.Tensor]) -> MPIWork:
        """Queue ``run`` (it makes the MPI calls and any copies back) and return the work that completes with it."""
        if self._stopping:
            raise RuntimeError(f"MPI backend: {what} on a process group that was destroyed: create a new group")
        work = MPIWork(what, outputs)
        self._queue.put((work, run))
        return work

    def post(self, what: str, request: Any, outputs: Sequence[torch.Tensor],
             then: Callable[[Any], None] | None = None) -> MPIWork:
        """Track a posted nonblocking request; ``then(status)`` runs when it completes, before the work does."""
        work = MPIWork(what, outputs)
        with self._pending_lock:
            self._pending.append((request, work, then))
            if self._p2p is None:
                self._p2p = threading.Thread(target=self._complete, name=f"ddpkit-mpi-{self.label}-p2p", daemon=True)
                self._p2p.start()
        self._pending_wake.set()
        return work

    def stop(self) -> None:
        """Run what is queued, then end the threads (the group is being destroyed)."""
        if self._stopping:
            return
        self._stopping = True
        self._queue.put(_STOP)
        self._pending_wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        if self._p2p is not None and threading.current_thread() is not self._p2p:
            self._p2p.join()
        _unwatch(self)

    def overdue(self, now: float) -> str | None:
        """The operation running longer than the timeout, if one is."""
        current = self._current
        if current is not None and now - current[1] > self.timeout_s:
            return current[0]
        return None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            work, run = item
            self._current = (work.what, time.monotonic())
            try:
                run()
            except BaseException as e:  # noqa: BLE001 - every failure belongs to the caller's work
                self._current = None
                work._finish(RuntimeError(f"MPI backend: {work.what} failed: {e}"))
                continue
            self._current = None
            work._finish()

    def _complete(self) -> None:
        """Complete posted requests as MPI reports them done; poll, backing off while none is."""
        from ddpkit.comm.mpi.library import load

        MPI = load()
        nap = 0.0
        while True:
            with self._pending_lock:
                pending = list(self._pending)
            if not pending:
                if self._stopping:
                    return
                self._pending_wake.wait(0.05)
                self._pending_wake.clear()
                continue
            status = MPI.Status()
            index = MPI.Request.Testany([request for request, _, _ in pending], status)[0]
            if index == MPI.UNDEFINED or index < 0:
                nap = min(1e-3, nap * 2 or 2e-5)
                time.sleep(nap)
                continue
            nap = 0.0
            request, work, then = pending[index]
            with self._pending_lock:
                self._pending.remove(pending[index])
            try:
                if then is not None:
                    then(status)
            except BaseException as e:  # noqa: BLE001
                work._finish(RuntimeError(f"MPI backend: {work.what} failed: {e}"))
                continue
            work._finish()


_watched: list[Progress] = []
_watch_lock = threading.Lock()
_watchdog: threading.Thread | None = None


def _watch(progress: Progress) -> None:
    global _watchdog
    with _watch_lock:
        _watched.append(progress)
        if _watchdog is None:
            _watchdog = threading.Thread(target=_watchdog_loop, name="ddpkit-mpi-watchdog", daemon=True)
            _watchdog.start()


def _unwatch(progress: Progress) -> None:
    with _watch_lock:
        if progress in _watched:
            _watched.remove(progress)


def _watchdog_loop() -> None:
    while True:
        time.sleep(1.0)
        now = time.monotonic()
        with _watch_lock:
            watched = list(_watched)
        for progress in watched:
            what = progress.overdue(now)
            if what is not None:
                rank = os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK")
                print(f"[ddpkit rank {rank}] MPI backend: {what} on group {progress.label} has not completed in "
                      f"{progress.timeout_s:g} s (the group's timeout, DDPKIT_TIMEOUT): another rank never reached "
                      "it; MPI cannot cancel a call, so the job is aborted", file=sys.stderr, flush=True)
                progress._abort()
                return

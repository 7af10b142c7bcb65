"""``ddpkit launch --backend mpi``: one round's workers started by ``mpirun``, supervised like any others.

Workers that are to share an MPI communicator must be started by MPI's
launcher, so the round's workers are one ``mpirun`` job of
:mod:`ddpkit.launcher.mpi_rank` shims, each running the worker the launcher
planned for its rank (the same command line and torchrun environment as
without MPI). Each worker's output comes back through two named pipes per
rank and its exit status through a file, so everything else is
:class:`~ddpkit.launcher.supervise.WorkerGroup`'s: prefixes and log files,
the first failure in time as the root cause with its traceback, teardown,
restarts. Parameter servers are started as usual, beside the job.
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ddpkit.launcher.output import Pump
from ddpkit.launcher.plan import WorkerSpec
from ddpkit.launcher.supervise import TAIL_LINES, WorkerGroup
from ddpkit.runtime import mpirun
from ddpkit.runtime.process import SignalCatcher, die_with_parent, terminate

__all__ = ["MPIWorkerGroup"]

_POLL_S = 0.05


class MPIWorkerGroup(WorkerGroup):
    """The workers of one round as one ``mpirun`` job (see the module notes)."""

    def start(self, specs: list[WorkerSpec], signals: SignalCatcher) -> None:
        workers = [s for s in specs if s.server is None]
        with signals.deferred():
            self._folder = Path(tempfile.mkdtemp(prefix="ddpkit-launch-mpi-"))
            plan = {"ranks": []}
            self._keep_open: list[int] = []
            for spec in workers:
                paths = {name: self._folder / f"rank{spec.rank}.{name}" for name in ("stdout", "stderr")}
                for path in paths.values():
                    os.mkfifo(path)
                plan["ranks"].append({"argv": spec.argv, "env": spec.env, "status": str(self._folder /
                                      f"rank{spec.rank}.status"), **{k: str(v) for k, v in paths.items()}})
                self._follow(spec, paths)
            (self._folder / "plan.json").write_text(json.dumps(plan))
            launcher = mpirun.find()
            argv = mpirun.command(launcher, len(workers), [sys.executable, "-m", "ddpkit.launcher.mpi_rank",
                                                           str(self._folder / "plan.json")])
            self.job = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=die_with_parent)
            self.job_procs = [self.job]
            threading.Thread(target=self._watch_statuses, args=(workers,), daemon=True).start()
            for spec in specs:
                if spec.server is not None and signals.received is None:
                    self._start_one(spec)

    def _follow(self, spec: WorkerSpec, paths: dict[str, Path]) -> None:
        """Pumps for the rank's two pipes: opened now (with a writer of our own, so that they do not end before
        the rank opens them), ended when its status is in."""
        index = len(self.specs)
        self.specs.append(spec)
        self.procs.append(_Rank(self, index))
        self.tails[spec.rank] = collections.deque(maxlen=TAIL_LINES)
        console = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}
        sources = {}
        for name, path in paths.items():
            read = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            self._keep_open.append(os.open(path, os.O_WRONLY))
            flags = fcntl.fcntl(read, fcntl.F_GETFL)
            fcntl.fcntl(read, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
            sources[name] = os.fdopen(read, "rb")  # buffered: Pump reads with read1()
        for name, dst, prefix, log, dup in self.layout.streams(spec.rank, spec.local_rank, console):
            pump = Pump(sources[name], dst, prefix, log, self.tails[spec.rank] if name == "stderr" else None, dup)
            pump.start()
            self.pumps.append(pump)

    def _watch_statuses(self, workers: list[WorkerSpec]) -> None:
        """Each rank's exit status the moment its file appears; mpirun's own when it ends without them."""
        pending = {spec.rank: i for i, spec in enumerate(workers)}
        while pending:
            for rank, index in list(pending.items()):
                status = self._folder / f"rank{rank}.status"
                if status.exists():
                    code = int(status.read_text())
                    self.procs[index].code = code
                    del pending[rank]
                    self.exits.put((code, index))
            if pending and self.job.poll() is not None:
                time.sleep(0.2)  # a status written just before mpirun ended
                if all(not (self._folder / f"rank{r}.status").exists() for r in pending):
                    code = self.job.returncode or 1
                    for rank, index in pending.items():
                        self.procs[index].code = code
                        self.exits.put((code, index))
                    return
            time.sleep(_POLL_S)
        self._close_writers()

    def _close_writers(self) -> None:
        for fd in self._keep_open:
            try:
                os.close(fd)
            except OSError:
                pass
        self._keep_open = []

    def stop(self, first_signal: int = signal.SIGTERM) -> None:
        """After a rank's failure mpirun ends the job itself: give it the grace period to, then signal mpirun
        alone (it passes the signal to every rank; a signal to its whole process group, SIGCONT included, can
        crash Open MPI's mpirun in its own teardown), then SIGKILL what is left."""
        grace = self.launch.grace_period_s
        failed = any(isinstance(p, _Rank) and p.code not in (None, 0) for p in self.procs)
        try:
            self.job.wait(timeout=grace if failed else 0.01)  # a signal to the launcher: at once
        except subprocess.TimeoutExpired:
            self.job.send_signal(first_signal)
            try:
                self.job.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                terminate(self.job_procs, 0.0, signal.SIGKILL)
        terminate([p for p in self.procs if not isinstance(p, _Rank)], grace, first_signal)
        self._end_leftovers()
        self._close_writers()
        self.finish()

    def _end_leftovers(self) -> None:
        """SIGKILL the process group of every rank that did not succeed: what its shim would have done, had the MPI
        launcher not killed the shim first (Hydra does; Open MPI's mpirun sends SIGTERM, which the shim forwards)."""
        for index, proc in enumerate(self.procs):
            if not isinstance(proc, _Rank) or proc.code == 0:
                continue
            recorded = self._folder / f"rank{self.specs[index].rank}.pgid"
            try:
                os.killpg(int(recorded.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass  # never started, or its group is gone already

    def finish(self) -> None:
        if self.job.poll() is None:
            try:
                self.job.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self._close_writers()
        super().finish()
        shutil.rmtree(self._folder, ignore_errors=True)


class _Rank:
    """A rank of the job where :class:`WorkerGroup` expects a process: its exit status once known."""

    def __init__(self, group: MPIWorkerGroup, index: int) -> None:
        self.group, self.index, self.code = group, index, None
        self.pid = None

    def poll(self) -> int | None:
        return self.code

    def wait(self) -> int | None:
        while self.code is None and self.group.job.poll() is None:
            time.sleep(_POLL_S)
        return self.code

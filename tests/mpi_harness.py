"""A pool of persistent ranks started by ``mpirun``, on ddpkit's ``mpi`` backend.

The same protocol as :class:`harness.RankPool` (a test sends a module-level
function, every rank runs it, the parent gets the results by rank), but the
ranks are one ``mpirun`` job: they connect back to the test process over an
authenticated local socket and say their rank. The first failure, a dead
``mpirun`` or a timeout tears the whole job down; the next ``run`` starts
another.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

from harness import RankPool

from ddpkit.runtime import mpirun
from ddpkit.runtime.spawn import WorkerError


def mpi_missing() -> str | None:
    """Why MPI rank pools cannot start here, or None."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install -e '.[mpi]'; scripts/setup.sh does)"
    try:
        mpirun.check(mpirun.find(), mpirun.library_of_mpi4py())
    except mpirun.MpirunError as e:
        return str(e)
    return None


def mpi_required() -> bool:
    """Whether a missing MPI backend fails the tests instead of skipping them: wherever an MPI is installed (as
    scripts/setup.sh installs one, so in CI), since a skip there would hide a broken backend; or when
    ``DDPKIT_REQUIRE_MPI=1`` asks for it."""
    return os.environ.get("DDPKIT_REQUIRE_MPI") == "1" or shutil.which("mpirun") is not None


def skip_or_fail(why: str) -> None:
    """Skip the test for ``why`` (no MPI here), or fail it where :func:`mpi_required`."""
    import pytest

    if mpi_required():
        pytest.fail(f"the MPI backend is unavailable though an MPI is installed here: {why}")
    pytest.skip(f"MPI backend unavailable: {why}")


class MPIRankPool(RankPool):
    """``world_size`` ranks of one ``mpirun`` job with ``ddpkit.init(backend='mpi')`` done."""

    def __init__(self, world_size: int, start_timeout: float = 120.0, env: dict[str, str] | None = None):
        super().__init__(world_size, start_timeout)
        self._mpirun: subprocess.Popen | None = None
        self._env = env or {}

    def _start(self) -> None:
        # The process's own key: tensors in replies travel as shared memory whose descriptors multiprocessing
        # hands over only to a peer that presents it.
        key = multiprocessing.current_process().authkey
        listener = Listener(("127.0.0.1", 0), authkey=key)
        env = {**os.environ, **self._env, "DDPKIT_TEST_POOL": f"{listener.address[0]}:{listener.address[1]}",
               "DDPKIT_TEST_KEY": key.hex(), "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        argv = mpirun.command(mpirun.find(), self.world_size, [sys.executable, str(Path(__file__).with_name(
            "mpi_worker.py"))], env=["DDPKIT_TEST_POOL", "DDPKIT_TEST_KEY", "OMP_NUM_THREADS", "PYTHONPATH"])
        self._mpirun = subprocess.Popen(argv, env=env, start_new_session=True)
        conns: dict[int, Any] = {}

        def accept() -> None:
            while len(conns) < self.world_size:
                try:
                    conn = listener.accept()
                except OSError:
                    return
                conns[conn.recv()] = conn

        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        deadline = time.monotonic() + self._start_timeout
        while acceptor.is_alive() and time.monotonic() < deadline and self._mpirun.poll() is None:
            acceptor.join(0.1)
        listener.close()
        if len(conns) < self.world_size:
            code = self._mpirun.poll()
            self.close()
            raise WorkerError(0, f"mpirun started {len(conns)} of {self.world_size} ranks within "
                              f"{self._start_timeout:g} s (mpirun exit code {code})", exitcode=code)
        self._conns = [conns[r] for r in range(self.world_size)]
        self._procs = [self._mpirun] * self.world_size
        self._collect(self._start_timeout, "start-up")

    def _exitcode(self, rank: int) -> int | None:
        return self._mpirun.poll() if self._mpirun is not None else None

    def close(self) -> None:
        self._say_goodbye()
        if self._mpirun is not None:
            try:
                self._mpirun.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self._mpirun.pid, 9)
                self._mpirun.wait()
        self._mpirun = None
        self._procs, self._conns = [], []

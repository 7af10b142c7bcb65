"""Multi-process test harness: a pool of persistent gloo ranks on localhost.

``import torch`` costs about a second here, so the workers are started once
per world size and reused by every test, each forked from a server that
imported torch and ddpkit once (multiprocessing's forkserver,
:data:`POOL_PRELOAD`): the test sends a module-level
function, every rank runs it, and the parent gets the per-rank results. The
first failure (an exception or a dead worker) is re-raised in the test with
the rank and its traceback, the other ranks are killed (they would be stuck
in a collective), and the next ``run`` starts a fresh pool. ``run`` enforces
a timeout, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from ddpkit.runtime.preloaded import Inherited
from ddpkit.runtime.process import free_port, terminate, worker_env
from ddpkit.runtime.spawn import WorkerError, leave_forkserver, start_forkserver, take_environment


POOL_PRELOAD = ("torch", "torch._dynamo", "ddpkit", "ddpkit.runtime.group", "ddpkit.parallel.ddp.wrapper", "harness")
"""What the ranks' server imports once for every rank it forks (``import torch`` and the DDP wrapper's
``torch._dynamo`` are most of a fresh rank's 2.5 CPU-seconds before its first job)."""


def _serve(rank: int, world_size: int, port: int, conn, environ: dict[str, str], stdout: int, stderr: int) -> None:
    # What a spawned rank had and a forked one must be given: the output, environment and randomness of its own
    # start, not of the server's (started earlier, perhaps by another test, with that test's captured output).
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    faulthandler.enable()  # a worker killed by a signal (SIGSEGV, SIGABRT) leaves its Python stack in the test's stderr
    leave_forkserver()  # (the server then exits with the test process, as a fresh rank's parent would be gone)
    os.setpgid(0, 0)
    take_environment({**worker_env(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size,
                                   master_port=port, base=environ), "DDPKIT_BACKEND": "gloo", "OMP_NUM_THREADS": "1"})
    _coverage_as_started()
    import torch

    import ddpkit

    torch.seed()  # each rank its own seed, as each fresh interpreter's import of torch draws one
    ddpkit.init(backend="gloo", timeout=90)
    serve_jobs(conn)


def _coverage_as_started() -> None:
    """coverage.py's start-up hook (its ``.pth`` file, ``tests/fast_tier.py``) runs in a fresh interpreter, not in
    a rank forked from the server: run it where this rank's environment asks for it, and stop a measurement the
    server's own start began where it does not."""
    wanted = "COVERAGE_PROCESS_CONFIG" in os.environ or "COVERAGE_PROCESS_START" in os.environ
    coverage = sys.modules.get("coverage")
    started = getattr(getattr(coverage, "process_startup", None), "coverage", None)
    if wanted and started is None:
        import coverage

        coverage.process_startup()
    elif started is not None and not wanted:
        started.stop()


def serve_jobs(conn) -> None:
    """A rank's loop: say ready, then run each function the test process sends and send back its outcome."""
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        fn, args, kwargs = job
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - report everything to the parent
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


class RankPool:
    """``world_size`` worker processes with an initialised gloo process group."""

    def __init__(self, world_size: int, start_timeout: float = 120.0):
        self.world_size = world_size
        self._start_timeout = start_timeout
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Any] = []

    def _start(self) -> None:
        # Forked from this process's forkserver, which imports POOL_PRELOAD once (a server already started by a
        # test before, with another preload, serves as well: its ranks then import the rest themselves).
        start_forkserver(POOL_PRELOAD)
        ctx = mp.get_context("forkserver")
        port = free_port()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, daemon=True,
                               args=(rank, self.world_size, port, child, dict(os.environ), Inherited(1), Inherited(2)))
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect(self._start_timeout, "start-up")

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results by rank.

        Raises:
            WorkerError: a rank raised or died (the pool is restarted next time).
            TimeoutError: not every rank answered within ``timeout`` seconds.
        """
        if not self._procs:
            self._start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(timeout, getattr(fn, "__name__", repr(fn)))

    def _collect(self, timeout: float, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        by_conn = {id(c): r for r, c in enumerate(self._conns)}
        try:
            while len(results) < self.world_size:
                waiting = [c for r, c in enumerate(self._conns) if r not in results]
                left = deadline - time.monotonic()
                ready = wait(waiting, timeout=max(left, 0))
                if not ready:
                    missing = sorted(set(range(self.world_size)) - set(results))
                    raise TimeoutError(f"{what}: ranks {missing} did not answer within {timeout:g} s")
                for conn in ready:
                    rank = by_conn[id(conn)]
                    try:
                        reply = conn.recv()
                    except EOFError:
                        code = self._exitcode(rank)
                        raise WorkerError(rank, f"{what}: worker died (exit code {code})", exitcode=code) from None
                    if reply[0] == "error":
                        raise WorkerError(rank, f"{what}: {reply[1]}", reply[2])
                    results[rank] = reply[1]
        except BaseException:
            self.close()
            raise
        return [results[r] for r in range(self.world_size)]

    def _say_goodbye(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass

    def _exitcode(self, rank: int) -> int | None:
        """The exit status of a rank whose pipe has closed (its forkserver reports it a moment after)."""
        self._procs[rank].join(timeout=5.0)
        return self._procs[rank].exitcode

    def close(self) -> None:
        """Stop the workers (they are restarted by the next ``run``)."""
        self._say_goodbye()
        terminate(self._procs, grace_s=2.0)
        self._procs, self._conns = [], []

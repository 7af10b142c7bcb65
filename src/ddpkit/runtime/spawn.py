"""``ddpkit.spawn``: run a function on N local processes, like ``torch.multiprocessing.spawn``.

The parent picks a free loopback port and gives each child the launcher
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...), so
the function only has to call :func:`ddpkit.init`. The parent then watches
every child: the first one to raise (or die) has its traceback sent home, the
others are terminated at once (they would otherwise wait in a collective
until the timeout), and :class:`WorkerError` is raised in the parent with that
rank and traceback.

Start methods: ``spawn`` (the default, as torch's) starts a fresh interpreter
per child, which imports torch and the function's module again;
``forkserver`` forks each child from a server process that imported them
once, started early with :func:`start_forkserver` so that its imports run
while the parent does its own work (``ddpkit train`` does this). Children
die with the parent either way: a forkserver exits when its parent does,
and takes its children with it.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from ddpkit.runtime.discovery import JOB_TOKEN_ENV, mint_job_token
from ddpkit.runtime.failures import WorkerError, encode_failure
from ddpkit.runtime.mpi_spawn import spawn_mpi
from ddpkit.runtime.process import (
    NUM_SERVERS_ENV,
    PS_PORT_ENV,
    SERVER_MODULE,
    SignalCatcher,
    describe_exit,
    die_with_parent,
    exit_now,
    finish_as_interpreter,
    free_ports,
    pid_alive,
    server_env,
    torn_down,
    worker_env,
)

START_METHODS = ("spawn", "forkserver")


def start_forkserver(preload: Sequence[str]) -> None:
    """Start this process's forkserver now, importing ``preload`` (module names) once for every child after.

    The imports run in the server while this process goes on. Call it before
    anything else starts the forkserver (its preload is fixed when it starts);
    later calls do nothing. A module that fails to import is left out (the
    child imports it then, and fails there with its own traceback).
    """
    import multiprocessing.forkserver as forkserver

    # The server's own exit first (see ddpkit.runtime.server_exit), then what the caller asks for.
    forkserver.set_forkserver_preload(["ddpkit.runtime.server_exit", *preload])
    forkserver.ensure_running()


def leave_forkserver() -> None:
    """In a child the forkserver forked: close this process's copy of the pipe whose end tells the server that its
    parent is gone.

    multiprocessing gives every child that copy; while any child holds it, the server never sees its parent die,
    so a parent killed outright (SIGKILL, the OOM killer) left the server running, and with it every child (whose
    ``die_with_parent`` watches the server). Without the copy, the server exits when the parent does and the
    kernel ends the children. A child that starts processes of its own by the forkserver method gets a server of
    its own (multiprocessing's rule in a child already: it never reuses its parent's).
    """
    import multiprocessing.forkserver as forkserver

    # The one place multiprocessing keeps the copy (CPython 3.8 to 3.14; elsewhere nothing to do).
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None and getattr(server, "_forkserver_pid", None) is None:  # (a server of this process's own: no)
        os.close(fd)
        server._forkserver_alive_fd = None  # noqa: SLF001


def take_environment(env: dict[str, str]) -> None:
    """In a child forked with torch already imported: ``env`` becomes this process's environment, and its
    ``OMP_NUM_THREADS`` torch's thread count.

    torch came in before this environment was set (with the function's module, or in the forkserver), so it sized
    its thread pool for the whole machine: several ranks would each use every core. The launcher's rule (one thread
    per worker unless the user chose) has to be applied by hand here.
    """
    os.environ.clear()
    os.environ.update(env)
    if "torch" in sys.modules and "OMP_NUM_THREADS" in env:
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))


def _child(fn: Callable[..., Any], rank: int, args: Sequence[Any], env: dict[str, str], conn: Connection,
           parent: int) -> None:
    # A parent killed outright (kill -9, the OOM killer) cannot stop its children: the kernel does, as for the
    # launcher's workers (torch's spawn asks for SIGINT, which a rank blocked in a collective would not see
    # until the collective's timeout). A parent already gone before this line means: exit at once. Under a
    # forkserver the kernel's parent is the server, which exits when ``parent`` does.
    die_with_parent()
    leave_forkserver()
    if os.getppid() != parent and (os.getppid() == 1 or not pid_alive(parent)):
        exit_now(1)
    # Own process group, so the parent can take down grandchildren too (a
    # DataLoader worker is one) with a single killpg.
    os.setpgid(0, 0)
    take_environment(env)
    # Each way out ends as the interpreter would (atexit handlers, open files flushed: torch's spawn children run
    # the teardown), without the teardown itself; a failing one joins no thread (one may wait on a dead peer).
    try:
        fn(rank, *args)
    except KeyboardInterrupt:
        pass  # torch's rule: a worker stopped by SIGINT (the parent stopping it) has not failed
    except SystemExit as exc:
        # As a process would exit (torch's spawn too): sys.exit() and sys.exit(0) succeed, sys.exit(3)
        # fails with exit code 3, sys.exit("message") prints it and fails with 1.
        if exc.code is None or exc.code == 0:
            finish_as_interpreter()
            exit_now(0)
        if not isinstance(exc.code, int):
            sys.stderr.write(f"{exc.code}\n")
        conn.send(encode_failure(exc))
        finish_as_interpreter(join_threads=False)
        exit_now(exc.code if isinstance(exc.code, int) else 1)
    except BaseException as exc:  # noqa: BLE001 - everything goes home, then exit non-zero
        conn.send(encode_failure(exc))
        finish_as_interpreter(join_threads=False)
        exit_now(1)
    _leave_in_order()
    finish_as_interpreter()
    exit_now(0)


def _leave_in_order() -> None:
    """After ``fn`` returned: leave the process group so that rank 0, whose process serves the store, goes last.

    A rank that returns right after ``ddpkit.init()`` would otherwise close the store while a peer still talks
    to it (its stall inspector's connection, the end of its own set-up): the peer fails with "Connection reset
    by peer" in a job that did nothing wrong. Every rank first meets the others (a barrier: all are past their
    set-up and their ``fn``), stops its stall inspector, meets them again (no one uses the store any more),
    then tears its group down. A peer that failed is the parent's to report: then this rank just exits.
    """
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    from ddpkit.runtime import stall
    from ddpkit.runtime.group import shutdown

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    try:
        dist.barrier()
        stall.stop()
        dist.barrier()
    except Exception:  # noqa: BLE001 - a peer failed or left: the parent reports it
        return
    shutdown()


def serve_module(_index: int, module: str) -> None:
    """A process that runs ``module``'s ``main()`` as ``python -m module`` would (a parameter server:
    :data:`SERVER_MODULE`); its return value is the exit code, its exception the process's failure."""
    sys.exit(importlib.import_module(module).main())


def spawn(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), backend: str | None = None,
          start_method: str = "spawn", *, num_servers: int = 0) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes and wait for all of them.

    Args:
        fn: a picklable (module-level) function; each process calls
            ``fn(rank, *args)`` with the launcher environment already set, so
            ``ddpkit.init()`` inside it joins the group.
        nprocs: number of processes (the world size).
        args: extra positional arguments for ``fn``.
        backend: sets ``DDPKIT_BACKEND`` for the children (default: ddpkit's choice). ``mpi``: the
            children are the ranks of one ``mpirun`` job (:mod:`ddpkit.runtime.mpi_spawn`; ``start_method`` does
            not apply, mpirun starts fresh interpreters).
        start_method: ``spawn`` (default) or ``forkserver`` (see the module notes).
        num_servers: parameter server processes to start beside the workers
            (:class:`ddpkit.ParameterServerOptimizer`); they are stopped once
            every worker has finished, and one that fails fails the run
            (its rank in the error is ``nprocs + k``).

    Raises:
        ValueError: ``nprocs`` is smaller than 1, or an unknown ``start_method``.
        WorkerError: a child raised or died; the first failure, with its rank
            and traceback. The other children are terminated. As under
            torch's spawn, ``sys.exit()`` / ``sys.exit(0)`` in a child is
            success, ``sys.exit(N)`` a failure with exit code N, and a
            ``KeyboardInterrupt`` in a child is not a failure.
        ddpkit.runtime.process.Interrupted: SIGINT or SIGTERM reached this
            process (main thread): every child and its children were stopped
            (the same signal, SIGKILL after 5 s). A ``KeyboardInterrupt``.

    Example::

        def worker(rank, steps):
            ctx = ddpkit.init()
            ...

        ddpkit.spawn(worker, nprocs=2, args=(100,))
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        order = (" (ddpkit.spawn takes fn, nprocs, args; torch's spawn takes fn, args, nprocs: pass them by name)"
                 if isinstance(nprocs, (tuple, list)) else "")
        raise ValueError(f"nprocs={nprocs!r} must be a positive integer{order}")
    if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 0:
        raise ValueError(f"num_servers={num_servers!r} must be a whole number >= 0")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r}: use one of {', '.join(START_METHODS)}")
    if backend == "mpi":
        return _spawn_mpi(fn, nprocs, args, num_servers)
    ctx = mp.get_context(start_method)
    # The parameter servers' channel (rank 0's, without servers) on a port found free too, another than the
    # rendezvous': its default, the rendezvous port + 1, may be any other process's (a client's ephemeral port,
    # another job's store).
    port, ps = free_ports(2)
    ps_port = str(ps)
    token = mint_job_token()  # only these children may join (see ddpkit.init)
    procs: list[mp.process.BaseProcess] = []
    conns: dict[int, tuple[int, Connection]] = {}
    signals = SignalCatcher()
    # On success the children have exited already; on a failure or a signal every other child and its own
    # children are stopped as the block ends.
    with signals.installed(), torn_down(procs, signals):
        with signals.deferred():
            for rank in range(nprocs + num_servers):
                if signals.received is not None:
                    break
                parent_conn, child_conn = ctx.Pipe(duplex=False)
                env = _env(min(rank, nprocs - 1), nprocs, port, backend, token)
                if num_servers:
                    env.update({NUM_SERVERS_ENV: str(num_servers), PS_PORT_ENV: ps_port})
                else:
                    env.setdefault(PS_PORT_ENV, ps_port)
                target, child_args, name = fn, tuple(args), f"ddpkit-rank{rank}"
                if rank >= nprocs:
                    env = server_env(env, rank - nprocs)
                    target, child_args, name = serve_module, (SERVER_MODULE,), f"ddpkit-server{rank - nprocs}"
                proc = ctx.Process(
                    target=_child, args=(target, rank, child_args, env, child_conn, os.getpid()), name=name,
                )
                proc.start()
                child_conn.close()
                procs.append(proc)
                conns[proc.sentinel] = (rank, parent_conn)
        _watch(procs, conns, nprocs)


def _spawn_mpi(fn: Callable[..., Any], nprocs: int, args: Sequence[Any], num_servers: int) -> None:
    """The ranks under mpirun (:mod:`ddpkit.runtime.mpi_spawn`); the parameter servers started here, as usual."""
    ctx = mp.get_context("spawn")
    conns: dict[int, tuple[int, Connection]] = {}

    def start_servers(env: dict[str, str]) -> list[mp.process.BaseProcess]:
        servers = []
        for k in range(num_servers):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(serve_module, nprocs + k, (SERVER_MODULE,), server_env(env, k),
                                                    child_conn, os.getpid()), name=f"ddpkit-server{k}")
            proc.start()
            child_conn.close()
            servers.append(proc)
            conns[proc.sentinel] = (nprocs + k, parent_conn)
        return servers

    def watch_servers(servers: list[mp.process.BaseProcess]) -> None:
        for proc in servers:
            if proc.exitcode not in (None, 0):
                rank, conn = conns[proc.sentinel]
                raise _failure(rank, proc.exitcode, _read(conn), time.time(), f"parameter server {rank - nprocs}")[1]

    spawn_mpi(fn, nprocs, args, num_servers, start_servers, watch_servers)


def _env(rank: int, nprocs: int, port: int, backend: str | None, token: str) -> dict[str, str]:
    env = worker_env(rank=rank, local_rank=rank, world_size=nprocs, local_world_size=nprocs, master_port=port)
    env[JOB_TOKEN_ENV] = token
    if backend:
        env["DDPKIT_BACKEND"] = backend
    return env


def _watch(procs: list[mp.process.BaseProcess], conns: dict[int, tuple[int, Connection]], workers: int) -> None:
    """Until every worker (the first ``workers`` processes) succeeded, or one process failed (raised).

    A child's report is read as soon as it is sent: one larger than the pipe's buffer (a long message, a
    traceback, a pickled exception: 64 KiB) would otherwise keep the child in its send, and the parent waiting
    for it to exit, for good.
    """
    pending = {p.sentinel: p for p in procs}
    unread = {conns[p.sentinel][1]: p.sentinel for p in procs}
    reports: dict[int, Any] = {}
    while any(conns[s][0] < workers for s in pending):
        failures = []
        alive_at = time.time()  # every process still pending was alive when this wait began
        for ready in wait([*pending, *unread]):
            if isinstance(ready, Connection):
                if ready in unread:  # (else read already: its process's exit came first in this list)
                    reports[unread.pop(ready)] = _read(ready)
                continue
            proc = pending.pop(ready)  # type: ignore[call-overload]
            proc.join()
            if proc.exitcode != 0:
                rank, conn = conns[ready]
                report = reports[ready] if ready in reports else _read(conn)
                unread.pop(conn, None)
                failures.append(_failure(rank, proc.exitcode, report, alive_at,
                                         f"parameter server {rank - workers}" if rank >= workers else None))
        if failures:
            _, error = min(failures, key=lambda f: f[0])
            raise error


def _read(conn: Connection) -> Any:
    """A child's report, or None: it sent none (a signal, os._exit, a success)."""
    try:
        return conn.recv() if conn.poll() else None
    except (EOFError, OSError):
        return None


def _failure(rank: int, exitcode: int | None, report: Any, alive_at: float,
             who: str | None) -> tuple[float, WorkerError]:
    """When the process failed (for the root cause: the earliest wins) and the error naming it (``report``: what
    it sent, or None).

    A process killed by SIGKILL reports nothing, and nothing but the outside (a user, the OOM killer) sends that
    signal, never a peer's failure: it counts as failed when it was last known alive (``alive_at``), so that the
    ranks which raised because it vanished, and reported before the parent woke, are not blamed in its place.
    """
    if report is None:
        how = describe_exit(exitcode)
        how = how if how.startswith("killed") else f"ended with {how}"
        when = alive_at if exitcode == -signal.SIGKILL else time.time()
        return when, WorkerError(rank, f"process {how} without a Python exception", exitcode=exitcode, who=who)
    when, message, text, payload = report
    error = WorkerError(rank, message, text, exitcode=exitcode, who=who)
    if payload is not None:
        try:
            error.__cause__ = pickle.loads(payload)
        except Exception:  # noqa: BLE001 - the text is enough
            pass
    return when, error

"""``ddpkit.spawn(..., backend="mpi")``: the ranks started by ``mpirun``, so that they form one MPI job.

Processes started one by one (as :func:`ddpkit.spawn` starts them) cannot
share an MPI communicator: MPI's launcher has to start them. Here the parent
writes the function and its arguments to a job folder and runs
``mpirun -np N python -m ddpkit.runtime.mpi_spawn FOLDER``; each rank reads
its MPI rank, sets torchrun's variables from it (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of the parent's choosing)
and ``DDPKIT_BACKEND=mpi``, and calls ``fn(rank, *args)``. A rank that raises
leaves its report in the folder and exits non-zero without finalising MPI,
and ``mpirun`` then stops the others; the parent raises the earliest
report as :class:`~ddpkit.runtime.spawn.WorkerError`, as spawn does.
Parameter servers are ordinary processes beside the job (their channel is a
gloo group of its own, whatever the workers' backend).
"""

from __future__ import annotations

import multiprocessing.spawn
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ddpkit.runtime import mpirun
from ddpkit.runtime.discovery import JOB_TOKEN_ENV, mint_job_token
from ddpkit.runtime.failures import WorkerError, encode_failure
from ddpkit.runtime.process import (
    NUM_SERVERS_ENV,
    PS_PORT_ENV,
    SignalCatcher,
    exit_now,
    finish_as_interpreter,
    free_ports,
    torn_down,
    worker_env,
)

__all__ = ["spawn_mpi"]

_JOB = "job.pkl"
_PASSED = ("MASTER_ADDR", "MASTER_PORT", "DDPKIT_BACKEND", JOB_TOKEN_ENV, "OMP_NUM_THREADS", NUM_SERVERS_ENV,
           PS_PORT_ENV, "PYTHONPATH")
"""Variables every rank gets from the parent (mpirun passes the rest of its environment on this node only)."""


def spawn_mpi(fn: Callable[..., Any], nprocs: int, args: Sequence[Any], num_servers: int,
              start_servers: Callable[[dict[str, str]], list[Any]],
              watch_servers: Callable[[list[Any]], None]) -> None:
    """Run ``fn(rank, *args)`` on ``nprocs`` ranks of one ``mpirun`` job (see the module notes).

    ``start_servers(env)`` starts the parameter servers (none when ``num_servers`` is 0) and ``watch_servers``
    raises when one of them failed; both are :mod:`ddpkit.runtime.spawn`'s.

    Raises:
        ddpkit.runtime.mpirun.MpirunError: no ``mpirun``, or one of another MPI than mpi4py's.
        WorkerError: a rank raised or died.
        Interrupted: SIGINT or SIGTERM reached this process; the job was stopped.
    """
    launcher = mpirun.find()
    mpirun.check(launcher, mpirun.library_of_mpi4py())
    port, ps_port = free_ports(2)  # (two calls could return one port twice)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DDPKIT_BACKEND": "mpi",
           JOB_TOKEN_ENV: mint_job_token(), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    if nprocs > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    if num_servers:
        env.update({NUM_SERVERS_ENV: str(num_servers), PS_PORT_ENV: str(ps_port)})
    with tempfile.TemporaryDirectory(prefix="ddpkit-mpi-") as folder:
        with open(Path(folder) / _JOB, "wb") as f:
            # What multiprocessing's spawn gives a child (sys.path, the main module by path), so that a function
            # defined in the parent's script unpickles in the ranks as it does in spawn's children.
            prep = multiprocessing.spawn.get_preparation_data("ddpkit-mpi-rank")
            prep.pop("authkey", None)  # the parent's secret stays here (nothing in the ranks connects back)
            pickle.dump(prep, f)
            pickle.dump((fn, tuple(args)), f)
        argv = mpirun.command(launcher, nprocs, [sys.executable, "-m", "ddpkit.runtime.mpi_spawn", folder],
                              env=[name for name in _PASSED if name in env])
        signals = SignalCatcher()
        procs: list[Any] = []
        with signals.installed(), torn_down(procs, signals):
            with signals.deferred():
                job = subprocess.Popen(argv, env=env, start_new_session=True)
                procs.append(job)
                servers = start_servers(worker_env(rank=0, local_rank=0, world_size=nprocs,
                                                   local_world_size=nprocs, master_port=port, base=env))
                procs += servers
            while job.poll() is None:
                watch_servers(servers)
                time.sleep(0.05)
            if job.returncode != 0:
                raise _failure(Path(folder), job.returncode)


def _failure(folder: Path, code: int) -> WorkerError:
    """The earliest rank report in ``folder``, or mpirun's exit status when no rank reported."""
    reports = []
    for path in folder.glob("rank*.report"):
        try:
            reports.append((int(path.stem[4:]), pickle.loads(path.read_bytes())))
        except (OSError, ValueError, pickle.UnpicklingError, EOFError):
            continue
    if not reports:
        return WorkerError(0, f"mpirun exited with status {code} and no rank left a Python exception (see its "
                          "messages above)", exitcode=code, who="the mpirun job")
    rank, (_, message, text, payload) = min(reports, key=lambda r: r[1][0])
    error = WorkerError(rank, message, text, exitcode=1)
    if payload is not None:
        try:
            error.__cause__ = pickle.loads(payload)
        except Exception:  # noqa: BLE001 - the text is enough
            pass
    return error


def _mpi_place(env: dict[str, str]) -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) from the MPI launcher's variables."""
    for rank, size, local, local_size in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ):
        if rank in env and size in env:
            r, n = int(env[rank]), int(env[size])
            return r, n, int(env.get(local, r)), int(env.get(local_size, n))
    raise RuntimeError("ddpkit.runtime.mpi_spawn runs under mpirun (no OMPI_COMM_WORLD_RANK or PMI_RANK here)")


def main(folder: str) -> None:
    """One rank: torchrun's variables from MPI's, then ``fn(rank, *args)``; a failure reported in ``folder``."""
    rank, world, local_rank, local_world = _mpi_place(dict(os.environ))
    os.environ.update(worker_env(rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
                                 master_port=int(os.environ["MASTER_PORT"]), master_addr=os.environ["MASTER_ADDR"],
                                 node_rank=rank // max(local_world, 1), nnodes=-(-world // max(local_world, 1))))
    try:
        with open(Path(folder) / _JOB, "rb") as f:
            multiprocessing.spawn.prepare(pickle.load(f))
            fn, args = pickle.load(f)
        if "torch" in sys.modules and "OMP_NUM_THREADS" in os.environ:
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        fn(rank, *args)
    except KeyboardInterrupt:
        pass
    except BaseException as exc:  # noqa: BLE001 - the parent shows it; mpirun stops the other ranks
        code = exc.code if isinstance(exc, SystemExit) else 1
        if isinstance(exc, SystemExit) and (code is None or code == 0):
            _finish(0)
        (Path(folder) / f"rank{rank}.report").write_bytes(pickle.dumps(encode_failure(exc)))
        exit_now(code if isinstance(code, int) else 1)  # without MPI_Finalize: mpirun ends the job
    _finish(0)


def _finish(code: int) -> None:
    """Destroy the group (its progress threads), end as the interpreter would, then exit at once
    (:func:`exit_now` leaves MPI first)."""
    from ddpkit.runtime.group import shutdown

    shutdown()
    finish_as_interpreter()
    exit_now(code)


if __name__ == "__main__":
    main(sys.argv[1])

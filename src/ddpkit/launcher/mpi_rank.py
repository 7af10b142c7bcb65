"""One rank of ``ddpkit launch --backend mpi``: started by ``mpirun``, it runs the worker the launcher planned.

``python -m ddpkit.launcher.mpi_rank PLAN.json``: reads its MPI rank, takes
the launcher's plan for that rank (command line, torchrun's environment,
the two pipes its output goes to) and runs the worker with MPI's own
variables added, so that the worker joins the MPI job. It writes the
worker's exit status where the launcher watches for it and exits with it;
SIGTERM and SIGINT are passed on to the worker's process group (the worker
and its children). torch-free: it costs mpirun nothing but an interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from ddpkit.runtime.process import die_with_parent

MPI_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "OPAL_", "ORTE_", "PRTE_", "HYDRA_", "MPI_", "I_MPI_", "MPIR_")
"""The MPI launcher's variables: the worker needs them to join the job."""


def mpi_rank(env: dict[str, str]) -> int:
    """This process's rank in the MPI job, from Open MPI's or a PMI launcher's variables."""
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        if name in env:
            return int(env[name])
    raise SystemExit("ddpkit.launcher.mpi_rank runs under mpirun (no OMPI_COMM_WORLD_RANK or PMI_RANK here)")


def pmi_fds(env: dict[str, str]) -> tuple[int, ...]:
    """The descriptors a PMI launcher handed this process to reach it (MPICH's Hydra: ``PMI_FD``), for the worker:
    it is the worker, not this shim, that joins the MPI job."""
    value = env.get("PMI_FD", "")
    return (int(value),) if value.isdigit() else ()


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def main(plan_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    rank = mpi_rank(dict(os.environ))
    spec = plan["ranks"][rank]
    env = {**spec["env"], **{k: v for k, v in os.environ.items() if k.startswith(MPI_PREFIXES)}}
    with open(spec["stdout"], "wb", buffering=0) as out, open(spec["stderr"], "wb", buffering=0) as err:
        worker = subprocess.Popen(spec["argv"], env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                  start_new_session=True, preexec_fn=die_with_parent, pass_fds=pmi_fds(env))
        # The worker's process group, for the launcher to end if this shim is killed before it can (MPICH's Hydra
        # ends the other ranks of a failed job with SIGKILL, and the worker's own children would outlive it).
        Path(spec["status"]).with_suffix(".pgid").write_text(str(worker.pid))
        stopped = []

        def forward(signum: int, _frame: object) -> None:
            stopped.append(signum)
            _signal_group(worker.pid, signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, forward)
        code = worker.wait()
        if code != 0 or stopped:
            # As the launcher tears a failed or stopped worker down: its children (a DataLoader's workers,
            # anything it started) go with it. A worker that succeeded keeps what it left running, as torchrun's.
            _signal_group(worker.pid, signal.SIGKILL)
    status = Path(spec["status"])
    temporary = status.with_suffix(".tmp")
    temporary.write_text(str(code))
    temporary.replace(status)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

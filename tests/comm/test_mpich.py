"""The mpi backend on MPICH (Debian's ``mpich``, launched by its Hydra ``mpiexec``), beside Open MPI.

mpi4py's wheel carries an extension for each of the two ABIs and loads MPICH's
as ``libmpi.so.12``, a name Debian's package does not install (its library is
``libmpich.so.12``): the job gets a directory holding that name on
``LD_LIBRARY_PATH`` and ``MPI4PY_MPIABI=mpich`` (what docs/mpi.md tells users).
Each test starts MPICH jobs the three ways a user does: ``ddpkit launch
--backend mpi`` (whose shims must hand Hydra's PMI descriptor to the worker),
``ddpkit train --backend mpi``, and a rank that fails, after which nothing of
the job may be left running (Hydra ends the other ranks with SIGKILL).
"""

from __future__ import annotations

import ctypes.util
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from procs import base_env, launch, script
from safetensors.torch import load_file

pytestmark = pytest.mark.slow("MPICH jobs: a launch, two training runs and a failure, about 40 s")

HYDRA = shutil.which("mpiexec.mpich")


@pytest.fixture
def mpich_env(tmp_path: Path, mpi_why: str | None) -> dict[str, str]:
    if mpi_why:
        pytest.skip(mpi_why)
    library = ctypes.util.find_library("mpich")
    if HYDRA is None or library is None:
        pytest.skip("MPICH is not installed here (apt-get install mpich; scripts/setup.sh does as root)")
    found = [Path(d) / "libmpich.so.12" for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")]
    real = next((p for p in found if p.exists()), None)
    if real is None:
        pytest.skip(f"MPICH's libmpich.so.12 is not in the usual places (find_library says {library})")
    abi = tmp_path / "mpich-abi"
    abi.mkdir()
    (abi / "libmpi.so.12").symlink_to(real)
    return base_env(LD_LIBRARY_PATH=str(abi), MPI4PY_MPIABI="mpich", DDPKIT_MPIRUN=HYDRA)


LIBRARY = textwrap.dedent("""
    import json, torch, torch.distributed as dist, ddpkit
    from ddpkit.comm.mpi.library import describe
    ctx = ddpkit.init()
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    print("MPICH " + json.dumps({"rank": ctx.rank, "world": ctx.world_size, "backend": ctx.backend,
                                 "scheme": ctx.scheme, "sum": t.item(), "library": describe().name}), flush=True)
    ddpkit.shutdown()
""")


def test_launch_backend_mpi_runs_on_mpich(mpich_env: dict[str, str], tmp_path: Path):
    program = tmp_path / "which.py"
    program.write_text(LIBRARY)
    done = launch("--backend", "mpi", "--nproc-per-node", "3", str(program), env=mpich_env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = sorted((json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
                      if line.startswith("MPICH ")), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1, 2]  # the scheme: ddpkit launch plans RANK and the rest
    assert {(r["world"], r["backend"], r["scheme"], r["sum"]) for r in reports} == {(3, "mpi", "env", 3.0)}
    assert all(r["library"].startswith("MPICH") for r in reports), reports[0]["library"]


def test_train_on_mpich_equals_train_on_gloo(mpich_env: dict[str, str], tmp_path: Path):
    common = ["--dataset", "synthetic", "--synthetic-samples", "512", "--epochs", "1", "--no-progress",
              "--nproc-per-node", "2"]
    for backend in ("gloo", "mpi"):
        done = subprocess.run([sys.executable, "-m", "ddpkit", "train", "--backend", backend, "--output-dir",
                               str(tmp_path / backend), *common], env=mpich_env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    ours, theirs = load_file(tmp_path / "mpi" / "model.safetensors"), load_file(tmp_path / "gloo" / "model.safetensors")
    assert ours.keys() == theirs.keys() and ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)  # two ranks: every sum adds two numbers


def test_a_failed_rank_on_mpich_is_named_and_leaves_nothing_behind(mpich_env: dict[str, str], tmp_path: Path):
    done = launch("--backend", "mpi", "--nproc-per-node", "3", script("crash.py"), str(tmp_path), env=mpich_env,
                  timeout=120)
    assert done.returncode == 1
    assert "rank 1 (local rank 1) failed first: exit code 1" in done.stderr
    assert "ValueError: shard 1 is corrupt" in done.stderr
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(pids) == 3  # every rank started its grandchild
    for pid in pids:  # the workers' own children too: Hydra SIGKILLs the shims, the launcher ends their groups
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "zombie" in status.read_text().lower(), pid

"""The mpi backend's way in: mpirun's command line, ddpkit.init(backend="mpi") with and without mpirun, spawn,
``ddpkit launch --backend mpi``, and the one-line refusals (a launcher that is not MPI's, an mpirun of another
MPI, mpi4py missing)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from procs import base_env, launch, script

import ddpkit
from ddpkit.runtime import mpirun

OPEN_MPI = mpirun.Launcher(path="/usr/bin/mpirun", vendor="openmpi", version="mpirun (Open MPI) 4.1.4")
HYDRA = mpirun.Launcher(path="/usr/bin/mpiexec.hydra", vendor="mpich", version="HYDRA build details:")


def test_mpirun_command_lines_for_each_launcher():
    argv = mpirun.command(OPEN_MPI, 3, ["python", "x.py"], env=["A", "B"], hosts=["h1:2", "h2"])
    assert argv[:3] == ["/usr/bin/mpirun", "-np", "3"] and argv[-2:] == ["python", "x.py"]
    assert "--oversubscribe" in argv and argv[argv.index("--bind-to") + 1] == "none"
    assert argv.count("-x") == 2 and argv[argv.index("--host") + 1] == "h1:2,h2"
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)
    argv = mpirun.command(HYDRA, 2, ["python", "x.py"], env=["A", "B"], hosts=["h1", "h2"])
    assert argv[argv.index("-genvlist") + 1] == "A,B" and argv[argv.index("-hosts") + 1] == "h1,h2"
    assert "--oversubscribe" not in argv
    with pytest.raises(ValueError, match="nproc 0"):
        mpirun.command(OPEN_MPI, 0, ["python"])


def test_an_mpirun_of_another_mpi_is_refused_naming_both():
    with pytest.raises(mpirun.MpirunError, match=r"mpiexec.hydra is 'HYDRA build details:' and mpi4py loads "
                                                 r"'Open MPI v4.1.4.*DDPKIT_MPIRUN"):
        mpirun.check(HYDRA, "Open MPI v4.1.4, package: Debian OpenMPI")
    mpirun.check(OPEN_MPI, "Open MPI v4.1.4, package: Debian OpenMPI")
    mpirun.check(HYDRA, "MPICH Version: 4.0.2")
    with pytest.raises(mpirun.MpirunError, match="no-such-mpirun is not on PATH"):
        mpirun.find("no-such-mpirun")


_ONE = textwrap.dedent("""
    import torch, torch.distributed as dist, ddpkit
    ctx = ddpkit.init(backend="mpi")
    t = torch.arange(4.0)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    work = dist.broadcast(t, 0, async_op=True)
    work.wait()
    print(ctx.world_size, ctx.rank, ctx.backend, dist.get_backend(), t.tolist(), work.is_completed(), flush=True)
    ddpkit.shutdown()
""")


def test_a_world_of_one_needs_no_launcher(needs_mpi):
    done = subprocess.run([sys.executable, "-c", _ONE], env=base_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "0", "mpi", "mpi4py", "[0.0,", "1.0,", "2.0,", "3.0]", "True"]


def test_a_launcher_that_is_not_mpis_is_refused_in_one_line(needs_mpi):
    env = base_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    done = subprocess.run([sys.executable, "-c", "import ddpkit; ddpkit.init(backend='mpi')"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: backend 'mpi' needs MPI's launcher: this process is rank 1 of 2"), last
    assert "mpirun -np 2" in last and "ddpkit launch --backend mpi" in last


def test_mpi4py_missing_is_said_with_the_fix():
    blocker = ("import sys, importlib.abc\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path, target=None):\n"
               "        if name == 'mpi4py': raise ModuleNotFoundError('No module named mpi4py')\n"
               "sys.meta_path.insert(0, Block())\n"
               "import ddpkit\nddpkit.init(backend='mpi')\n")
    done = subprocess.run([sys.executable, "-c", blocker], env=base_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert "pip install 'ddpkit[mpi]'" in done.stderr.strip().splitlines()[-1]


def _ranks(rank: int, fail_on: int | None) -> None:
    import torch
    import torch.distributed as dist

    ctx = ddpkit.init()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert (ctx.backend, os.environ["RANK"], t.item()) == ("mpi", str(rank), sum(range(ctx.world_size)))
    if rank == fail_on:
        raise KeyError(f"planted on rank {rank}")


def test_spawn_runs_the_ranks_under_mpirun(needs_mpi):
    ddpkit.spawn(_ranks, 3, args=(None,), backend="mpi")
    with pytest.raises(ddpkit.WorkerError) as caught:
        ddpkit.spawn(_ranks, 2, args=(1,), backend="mpi")
    assert caught.value.rank == 1 and isinstance(caught.value.__cause__, KeyError)
    assert "planted on rank 1" in str(caught.value)


@pytest.mark.slow("a whole mpirun job under ddpkit launch (the fast tier starts ranks under mpirun with spawn)")
def test_launch_backend_mpi_runs_torchrun_scripts_as_one_mpi_job(needs_mpi):
    done = launch("--backend", "mpi", "--nproc-per-node", "2", script("report_env.py"), "a1")
    assert done.returncode == 0, done.stderr
    reports = done.reports()
    assert [r["rank"] for r in reports] == [0, 1]
    assert {(r["backend"], r["sum"], r["world_size"]) for r in reports} == {("mpi", 1.0, 2)}
    assert [r["env"]["RANK"] for r in reports] == ["0", "1"] and reports[1]["env"]["LOCAL_RANK"] == "1"
    assert reports[0]["argv"] == ["a1"]


@pytest.mark.slow("a whole mpirun job under ddpkit launch whose rank fails")
def test_launch_backend_mpi_names_the_failing_rank_and_leaves_nothing_behind(needs_mpi, tmp_path: Path):
    done = launch("--backend", "mpi", "--nproc-per-node", "3", "--max-restarts", "1", script("crash.py"),
                  str(tmp_path), timeout=120)
    assert done.returncode == 1
    assert done.stderr.count("rank 1 (local rank 1) failed first: exit code 1") == 2  # and once more, restarted
    assert "restarting the worker group (restart 1 of 1)" in done.stderr
    assert "ValueError: shard 1 is corrupt" in done.stderr
    for pid_file in tmp_path.glob("rank*.pid"):
        pid = int(pid_file.read_text())
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_launch_backend_mpi_refuses_several_nodes_in_one_line():
    done = launch("--backend", "mpi", "--nnodes", "2", "--node-rank", "0", script("report_env.py"))
    assert done.returncode != 0
    assert "--backend mpi with --nnodes 2: ddpkit launch starts one MPI job on this node" in done.stderr
    assert "Traceback" not in done.stderr


def test_master_addr_is_offered_first_and_loopback_never_overrides():
    from ddpkit.comm.mpi.world import _offered

    found = ["10.0.0.5", "192.168.1.2", "127.0.0.1"]
    assert _offered("192.168.1.2", found) == ["192.168.1.2", "10.0.0.5", "127.0.0.1"]
    assert _offered("node0", found) == ["node0", *found]  # a host name the other nodes resolve
    for unset_or_local in ("", "127.0.0.1", "localhost"):
        assert _offered(unset_or_local, found) == found

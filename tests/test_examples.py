"""The examples run as users run them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow("the MNIST example, launched")
def test_mnist_distributed_example(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "mnist_distributed.py"), "--nprocs", "2", "--epochs", "2"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    # Rank 0 prints, once; all 359 test images are counted exactly once.
    found = re.findall(r"Test accuracy: ([\d.]+)% on 359 images", proc.stdout)
    assert len(found) == 1 and float(found[0]) > 90, proc.stdout


@pytest.mark.slow("a reference run, then a run killed with kill -9 and restarted by its launcher")
def test_resumable_loop_survives_kill_9_bit_identical(tmp_path: Path) -> None:
    from procs import children, wait_for
    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def launch(out: Path) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "ddpkit", "launch", "--standalone", "--nproc-per-node", "2", "--max-restarts",
             "3", str(ROOT / "examples" / "resumable_loop.py"), "--out", str(out), "--steps", "120"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    whole = launch(tmp_path / "whole")
    assert whole.wait(timeout=120) == 0, whole.stderr.read()
    killed = launch(tmp_path / "killed")
    wait_for(lambda: (tmp_path / "killed" / "ckpt" / "step-00000040.safetensors").is_file())
    victim = max(pid for pid, line in children(killed.pid) if "resumable_loop.py" in line)
    os.kill(victim, signal.SIGKILL)
    out, err = killed.communicate(timeout=120)
    assert killed.returncode == 0, err
    assert "restarting the worker group" in err and "resumed at step" in out
    a, b = load_file(tmp_path / "whole" / "final.safetensors"), load_file(tmp_path / "killed" / "final.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _run(args: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _launch(*args: str) -> list[str]:
    return [sys.executable, "-m", "ddpkit", "launch", "--standalone", "--nproc-per-node", "2", *args]


def test_the_zero3_example_shards_a_meta_model_saves_and_loads_it(tmp_path: Path) -> None:
    done = _run(_launch(str(ROOT / "examples" / "zero3_sharded.py"), "--output-dir", "out", "--steps", "3"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 holds 136,322 of the model's 272,644 parameters" in done.stdout
    assert "loaded into a fresh model: the same loss on every rank" in done.stdout
    assert sorted(p.name for p in (tmp_path / "out" / "sharded").iterdir()) == [
        "index.json", "rank-0-of-2.safetensors", "rank-1-of-2.safetensors"]


@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.slow(
    "the fast tier runs the example in its asynchronous mode; the synchronous servers are test_consistency.py's "
    "and test_ps.py's there")), "async"])
def test_the_parameter_server_example_trains_under_both_modes(tmp_path: Path, mode: str) -> None:
    done = _run(_launch("--num-servers", "1", str(ROOT / "examples" / "parameter_servers.py"), "--mode", mode,
                        "--steps", "10"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = re.findall(r"worker (\d): last loss [\d.]+; staleness of the parameters it trained on: (\{.*\})",
                       done.stdout)
    assert sorted(w for w, _ in lines) == ["0", "1"], done.stdout
    if mode == "sync":  # every step waits for both workers' gradients: nothing is ever stale
        assert all(h == "{'0': 10}" for _, h in lines), lines


@pytest.mark.slow("Lightning's own two processes, started again by Lightning")
def test_the_lightning_example_trains_in_ddpkits_wrapper(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    done = _run([sys.executable, str(ROOT / "examples" / "lightning_ddpkit.py"), "--devices", "2", "--epochs", "1"],
                tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("trained 1 epochs on 2 processes, the model wrapped in ddpkit.parallel.ddp.wrapper."
            "DistributedDataParallel") in done.stdout


def test_the_hello_example(tmp_path: Path) -> None:
    done = _run(_launch(str(ROOT / "examples" / "hello_allreduce.py")), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(gloo): all-reduce sum = 3" in done.stdout and "ok: sum 3 == 3" in done.stdout


def test_the_hello_example_under_mpirun(tmp_path: Path, mpi_why: str | None) -> None:
    from mpi_harness import skip_or_fail

    if mpi_why:
        skip_or_fail(mpi_why)
    done = _run(_launch("--backend", "mpi", str(ROOT / "examples" / "hello_allreduce.py")), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(mpi): all-reduce sum = 3" in done.stdout and "ok: sum 3 == 3" in done.stdout


def test_the_fault_tolerant_example_prints_each_workers_pid(tmp_path: Path) -> None:
    done = _run(_launch("--on-failure", "continue", str(ROOT / "examples" / "fault_tolerant.py"), "--epochs", "1",
                        "--step-time", "0"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(re.findall(r"worker (\d) of 2: pid \d+", done.stdout)) == ["0", "1"]
    assert "done: 64 steps, 0 membership change(s)" in done.stdout


def test_every_example_is_in_the_examples_readme_with_a_command_that_names_it() -> None:
    readme = (ROOT / "examples" / "README.md").read_text()
    for example in sorted((ROOT / "examples").glob("*.py")):
        assert f"examples/{example.name}" in readme, f"examples/README.md does not name {example.name}"

"""Crash, restart, same result: kill -9 a worker of a real run and compare with an uninterrupted one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from procs import children as _children
from procs import wait_for as _wait_for
from safetensors.torch import load_file
from shared_runs import SYNTHETIC_RUN

# 384 images per rank, 24 steps per epoch, a checkpoint every 5 steps.
FLAGS = ["--dataset", "synthetic", "--synthetic-samples", "768", "--batch-size", "16", "--epochs", "2",
         "--checkpoint-every", "5", "--no-progress"]
CONFIG = dict(dataset="synthetic", synthetic_samples=768, batch_size=16, epochs=2, checkpoint_every=5,
              progress=False)


def _train_workers(pid: int) -> list[int]:
    """``ddpkit train``'s own workers: the children of its forkserver (a child of ``pid``)."""
    servers = [child for child, line in _children(pid) if "forkserver import main" in line]
    return sorted(worker for server in servers for worker, _ in _children(server))


def _kill_worker_and_finish(cmd: list[str], out: Path, when: Callable[[], bool], is_worker: Callable[[str], bool],
                            index: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=out.parent)
    try:
        _wait_for(when)
        workers = sorted(pid for pid, line in _children(proc.pid) if is_worker(line)) + _train_workers(proc.pid)
        assert len(workers) == 2, _children(proc.pid)
        os.kill(workers[index], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def reference(synthetic_run) -> dict[str, torch.Tensor]:
    assert CONFIG == SYNTHETIC_RUN  # the session's run of this job (tests/conftest.py) is the reference
    return load_file(synthetic_run / "model.safetensors")


def _assert_same_weights(out: Path, reference: dict[str, torch.Tensor]) -> None:
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(reference)
    for k in reference:
        assert torch.equal(got[k], reference[k]), k


def _started(out: Path) -> Callable[[], bool]:
    return lambda: (out / "config.json").is_file()


def _checkpointed(out: Path, step: int) -> Callable[[], bool]:
    return lambda: (out / "checkpoints" / f"step-{step:08d}.safetensors").is_file()


@pytest.mark.slow("a killed run and its restart, against the reference run")
@pytest.mark.parametrize("point, victim", [("before-first-checkpoint", 1), ("mid-epoch", 0), ("second-epoch", 1)])
def test_kill_under_ddpkit_launch_resumes_bit_identical(tmp_path: Path, reference, point, victim) -> None:
    out = tmp_path / "run"
    when = {"before-first-checkpoint": _started(out), "mid-epoch": _checkpointed(out, 10),
            "second-epoch": _checkpointed(out, 30)}[point]
    cmd = [sys.executable, "-m", "ddpkit", "launch", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "-m", "ddpkit", "train", *FLAGS, "--output-dir", str(out)]
    done = _kill_worker_and_finish(cmd, out, when, lambda line: "ddpkit train" in line, victim)
    assert done.returncode == 0, done.stderr
    assert "restarting the worker group (restart 1 of 1)" in done.stderr
    assert "restart 1: " in done.stdout  # the workers said how they continue
    _assert_same_weights(out, reference)
    assert not list((out / "checkpoints").glob(".*tmp*"))


@pytest.mark.slow("a killed run and its restart, against the reference run")
def test_kill_under_ddpkit_train_max_restarts_resumes_bit_identical(tmp_path: Path, reference) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ddpkit", "train", *FLAGS, "--max-restarts", "1", "--output-dir", str(out)]
    done = _kill_worker_and_finish(cmd, out, _checkpointed(out, 15), lambda line: False, 1)
    assert done.returncode == 0, done.stderr
    assert "restarting the workers (restart 1 of 1)" in done.stdout
    assert "restart 1: resuming from" in done.stdout
    _assert_same_weights(out, reference)


@pytest.mark.slow("a training run, stopped by SIGTERM and watched after")
def test_sigterm_to_ddpkit_train_stops_every_worker_and_writes_nothing_after(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ddpkit", "train", *FLAGS, "--epochs", "50", "--output-dir", str(out)]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        _wait_for(_checkpointed(out, 5))
        workers = _train_workers(proc.pid)
        assert len(workers) == 2
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert time.monotonic() - start < 10
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "received SIGTERM: stopped all workers" in proc.stderr.read()
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)

    def snapshot() -> dict[str, float]:
        return {str(p): p.stat().st_mtime for p in out.rglob("*")}

    before = snapshot()
    time.sleep(1.0)
    assert snapshot() == before
    assert not (out / "summary.json").exists()


@pytest.mark.slow("a killed run and its restart, against the reference run")
@pytest.mark.parametrize("stage", ["2", "3"])
def test_a_killed_zero_run_restarts_bit_identical_to_plain_ddp(tmp_path: Path, reference, stage: str) -> None:
    # At world 2 stages 0 to 3 train the same bits, and the checkpoint holds the unsharded model and optimizer
    # state: the uninterrupted stage-0 run is the reference.
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ddpkit", "launch", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "-m", "ddpkit", "train", *FLAGS, "--zero", stage, "--output-dir", str(out)]
    done = _kill_worker_and_finish(cmd, out, _checkpointed(out, 10), lambda line: "ddpkit train" in line, 1)
    assert done.returncode == 0, done.stderr
    assert "restarting the worker group (restart 1 of 1)" in done.stderr
    _assert_same_weights(out, reference)


@pytest.mark.slow("two runs of two workers (the straight one and the resumed half)")
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_run_resumed_under_powersgd_goes_on_with_its_error_feedback_bit_identical(
        tmp_path: Path, backend: str, mpi_why: str | None) -> None:
    # PowerSGD keeps an error per rank and bucket, its warm start's Q and its generator: the checkpoint carries
    # every rank's, and the buckets (the first assignment reduces in another order than the rebuilt one). Resumed
    # from the checkpoint of step 15 (its files as the straight run wrote them), the run ends in the same bits; a
    # resumed run that starts PowerSGD afresh ends about 5 off.
    import shutil

    from procs import base_env

    if backend == "mpi" and mpi_why:
        from mpi_harness import skip_or_fail

        skip_or_fail(mpi_why)
    flags = [*FLAGS, "--nproc-per-node", "2", "--backend", backend, "--comm-hook", "powersgd", "--powersgd-rank", "2", "--powersgd-start",
             "4", "--keep-checkpoints", "100"]
    straight = tmp_path / "straight"
    done = subprocess.run([sys.executable, "-m", "ddpkit", "train", *flags, "--output-dir", str(straight)],
                          env=base_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    for late in (p for p in (run / "checkpoints").glob("step-*.safetensors") if int(p.stem.split("-")[1]) > 15):
        late.unlink()
    (run / "model.safetensors").unlink()
    done = subprocess.run([sys.executable, "-m", "ddpkit", "train", "--resume", "--output-dir", str(run)],
                          env=base_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stdout and "step-00000015" in done.stdout, done.stdout
    assert "PowerSGD resumed at iteration 15 with each rank's error feedback and warm start" in done.stdout
    _assert_same_weights(run, load_file(straight / "model.safetensors"))

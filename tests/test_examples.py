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

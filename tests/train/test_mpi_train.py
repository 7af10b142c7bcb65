"""``ddpkit train`` on the mpi backend: its own workers (one mpirun job), or started by mpirun itself, equal to
the same run on gloo bit for bit at two processes (every reduction adds two numbers), through a checkpoint and
--resume, and with the parameter servers beside the mpirun job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from procs import base_env
from safetensors.torch import load_file

from ddpkit.runtime import mpirun

pytestmark = pytest.mark.slow("whole training runs on mpi and on gloo, about 40 s")

TRAIN = ["--dataset", "synthetic", "--synthetic-samples", "1024", "--epochs", "2", "--no-progress",
         "--nproc-per-node", "2"]


@pytest.fixture(autouse=True)
def _mpi(needs_mpi: None) -> None:
    """Every test here runs on the mpi backend."""


def _train(out: Path, *args: str, under_mpirun: bool = False) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "ddpkit", "train", "--output-dir", str(out), *TRAIN, *args]
    if under_mpirun:
        argv = mpirun.command(mpirun.find(), 2, argv)
    done = subprocess.run(argv, env=base_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _same_weights(a: Path, b: Path) -> None:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert x.keys() == y.keys() and x
    assert all(torch.equal(x[k], y[k]) for k in x), [k for k in x if not torch.equal(x[k], y[k])]


def test_train_on_mpi_equals_train_on_gloo(tmp_path: Path):
    _train(tmp_path / "gloo", "--backend", "gloo")
    _train(tmp_path / "mpi", "--backend", "mpi")
    _train(tmp_path / "mpirun", "--backend", "mpi", under_mpirun=True)
    for run in ("mpi", "mpirun"):
        _same_weights(tmp_path / "gloo", tmp_path / run)
        ours = json.loads((tmp_path / run / "summary.json").read_text())
        theirs = json.loads((tmp_path / "gloo" / "summary.json").read_text())
        assert ours["test_accuracy"] == theirs["test_accuracy"]


def test_checkpoints_and_resume_on_mpi_as_on_gloo(tmp_path: Path):
    for backend in ("gloo", "mpi"):
        _train(tmp_path / backend, "--backend", backend, "--checkpoint-every", "8", "--epochs", "1")
        done = _train(tmp_path / backend, "--backend", backend, "--checkpoint-every", "8", "--epochs", "2",
                      "--resume")
        assert "resuming from" in done.stdout + done.stderr
    _same_weights(tmp_path / "gloo", tmp_path / "mpi")


def test_parameter_servers_beside_an_mpi_job(tmp_path: Path):
    _train(tmp_path / "gloo", "--backend", "gloo", "--strategy", "ps-sync", "--num-servers", "1")
    _train(tmp_path / "mpi", "--backend", "mpi", "--strategy", "ps-sync", "--num-servers", "1")
    _same_weights(tmp_path / "gloo", tmp_path / "mpi")


def test_local_sgd_on_mpi_as_on_gloo(tmp_path: Path):
    for backend in ("gloo", "mpi"):
        _train(tmp_path / backend, "--backend", backend, "--strategy", "local-sgd")
    _same_weights(tmp_path / "gloo", tmp_path / "mpi")


def test_streaming_diloco_on_mpi_as_on_gloo(tmp_path: Path):
    # int8 pseudo-gradients: every rank decodes every rank's codes and adds them in rank order, on either backend.
    for backend in ("gloo", "mpi"):
        _train(tmp_path / backend, "--backend", backend, "--sync-every", "4", "--fragments", "2",
               "--fragment-delay", "1", "--outer-codec", "int8")
    _same_weights(tmp_path / "gloo", tmp_path / "mpi")


def test_ssp_trains_on_mpi(tmp_path: Path):
    """Stale-synchronous training is not reproducible on any backend (which gradients arrive late depends on
    timing: two gloo runs end with other weights), so the mpi run has to learn as well as gloo's does."""
    accuracy = {}
    for backend in ("gloo", "mpi"):
        _train(tmp_path / backend, "--backend", backend, "--strategy", "ssp", "--staleness", "1")
        accuracy[backend] = json.loads((tmp_path / backend / "summary.json").read_text())["test_accuracy"]
    assert accuracy["mpi"] >= 0.95 and accuracy["gloo"] >= 0.95, accuracy

"""``ddpkit train --strategy ps-sync|ps-async --on-failure continue``: the parameter servers' strategies through deaths.

Real processes: ``ddpkit train`` starts its workers and servers through ``ddpkit launch --on-failure continue``;
the test SIGKILLs a worker and a server from outside once the first epoch is written, and compares the run with
the same run without a death.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from event_files import expected_from_metrics, read_board
from procs import ROOT, base_env, named

pytestmark = pytest.mark.alone("a parameter server's job, and faults sent while it trains")

MNIST = ROOT.parent / "shared" / "data" / "mnist"


def _args(out: Path | None, strategy: str, epochs: int, workers: int = 3, mode: tuple[str, ...] = (
        "--ps-replication", "2", "--on-failure", "continue")) -> list[str]:
    servers = () if strategy in ("ssp", "diloco") else ("--num-servers", "2")
    return [sys.executable, "-m", "ddpkit", "train", "--strategy", strategy, *servers, *mode,
            "--nproc-per-node", str(workers), "--epochs", str(epochs), "--dataset", "mnist", "--data-dir", str(MNIST),
            "--no-progress", *(("--output-dir", str(out)) if out else ())]


def _find(root: int, *, rank: int | None = None, server: int | None = None) -> int:
    name = f"ddpkit-server{server}" if server is not None else f"ddpkit-rank{rank}"
    found = named(root, name)
    assert len(found) == 1, f"{len(found)} processes named {name} under {root}"
    return found[0]


def _with_and_without_deaths(tmp_path: Path, args: list[str], kills: list[dict[str, int]]) -> tuple[dict, dict, str]:
    """The run without a death, then the same run with ``kills`` (``_find``'s arguments) SIGKILLed once its first
    epoch was written: both summaries and the second run's stderr."""
    plain = subprocess.run([*args, "--output-dir", str(tmp_path / "plain")], env=base_env(), capture_output=True,
                           text=True, timeout=600, cwd=ROOT)
    assert plain.returncode == 0, plain.stderr[-3000:]
    out = tmp_path / "killed"
    proc = subprocess.Popen([*args, "--output-dir", str(out)], env=base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first epoch"
        time.sleep(0.05)
    for kill in kills:
        os.kill(_find(proc.pid, **kill), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    return (json.loads((tmp_path / "plain" / "summary.json").read_text()),
            json.loads((out / "summary.json").read_text()), stderr)


@pytest.mark.skipif(not MNIST.is_dir(), reason="needs ../shared/data/mnist")
@pytest.mark.slow("two runs of three workers and two servers on MNIST, one with a worker's and a server's death")
def test_ps_async_trains_on_through_a_worker_and_a_server_death_to_the_same_accuracy(tmp_path: Path) -> None:
    reference, summary, stderr = _with_and_without_deaths(tmp_path, _args(None, "ps-async", 3),
                                                          [{"rank": 2}, {"server": 0}])
    assert "member 2 (rank 2 at the start) died" in stderr and "parameter server 0 died" in stderr
    assert summary["world_size"] == 2 and summary["servers_gone"] == [0]
    # Rank 2's data after its death is not trained (asynchronous servers): a little less data, the same model.
    assert summary["test_accuracy"] > reference["test_accuracy"] - 0.02, (summary, reference)


@pytest.mark.slow("two ddpkit train runs of two workers and two servers on MNIST, one in the mode")
@pytest.mark.skipif(not MNIST.is_dir(), reason="needs ../shared/data/mnist")
def test_ps_sync_in_the_mode_equals_the_default_modes_run(tmp_path: Path) -> None:
    # The servers make DDP's update in both; rank 0 evaluates with its own buffers in both.
    from safetensors.torch import load_file

    warmup = ("--warmup-epochs", "0.5")  # the learning rate of every step is the default mode's too
    for name, mode in (("default", warmup), ("continue", (*warmup, "--ps-replication", "2", "--on-failure",
                                                          "continue"))):
        done = subprocess.run(_args(tmp_path / name, "ps-sync", 1, workers=2, mode=mode), env=base_env(),
                              capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
    default, survive = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("default", "continue"))
    assert survive["test_accuracy"] == default["test_accuracy"] > 0.9
    assert survive["world_size"] == 2 and survive["servers_gone"] == []
    a, b = load_file(tmp_path / "default" / "model.safetensors"), load_file(tmp_path / "continue" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def _same_weights_in_both_modes(tmp_path: Path, strategy: str, flags: tuple[str, ...],
                                continued: tuple[str, ...] = ()) -> dict:
    """``ddpkit train`` of two workers for an epoch in the default mode and in the mode (with ``continued`` too): the
    same weights, bit for bit; the mode's summary."""
    from safetensors.torch import load_file

    for name, mode in (("default", flags), ("continue", (*flags, *continued, "--on-failure", "continue"))):
        done = subprocess.run(_args(tmp_path / name, strategy, 1, workers=2, mode=mode), env=base_env(),
                              capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
    a, b = load_file(tmp_path / "default" / "model.safetensors"), load_file(tmp_path / "continue" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    default, survive = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("default", "continue"))
    shared = ("lr", "base_lr", "global_batch_size", "replicas", "engine", "strategy", "amp", "grad_accum", "epochs",
              "steps", "test_samples", "resumed_from_epoch")  # the default mode's keys hold in the mode too
    assert {k: survive[k] for k in shared} == {k: default[k] for k in shared}
    return survive


@pytest.mark.skipif(not MNIST.is_dir(), reason="needs ../shared/data/mnist")
@pytest.mark.slow("two ddpkit train runs of two SSP workers on MNIST, one in the mode, both compiled")
def test_ssp_without_staleness_in_the_mode_equals_the_default_modes_run(tmp_path: Path) -> None:
    # --compile and --tensorboard hold in the mode too (both were silently dropped there until 2026-12-01): the
    # compiled forward's bits are the default mode's compiled ones, and the first member writes its epochs.
    board = tmp_path / "tb"
    _same_weights_in_both_modes(tmp_path, "ssp", ("--staleness", "0", "--warmup-epochs", "0.5", "--compile"),
                                ("--tensorboard", str(board)))
    points = read_board(board)
    assert points == expected_from_metrics(tmp_path / "continue") | {"train/loss_step": points["train/loss_step"]}
    assert [step for step, _ in points["train/loss_step"]] == list(range(10, 126, 10))  # 125 steps of 32 a worker


@pytest.mark.skipif(not MNIST.is_dir(), reason="needs ../shared/data/mnist")
@pytest.mark.slow("two runs of three SSP workers on MNIST, one with a worker's death")
def test_ssp_trains_on_through_a_workers_death_to_the_same_accuracy(tmp_path: Path) -> None:
    mode = ("--staleness", "2", "--warmup-epochs", "0.3", "--on-failure", "continue")
    reference, summary, stderr = _with_and_without_deaths(tmp_path, _args(None, "ssp", 3, mode=mode), [{"rank": 1}])
    assert "member 1 (rank 1 at the start) died" in stderr
    assert summary["world_size"] == 2 and summary["started_with"] == 3
    # Rank 1's data after its death is not trained: a little less data, the same model.
    assert summary["test_accuracy"] > reference["test_accuracy"] - 0.02, (summary, reference)


@pytest.mark.skipif(not MNIST.is_dir(), reason="needs ../shared/data/mnist")
@pytest.mark.slow("two ddpkit train runs of two DiLoCo workers on MNIST, one in the mode")
def test_diloco_in_the_mode_equals_the_default_modes_run(tmp_path: Path) -> None:
    d = _same_weights_in_both_modes(tmp_path, "diloco", ("--sync-every", "8"))["diloco"]
    assert d["samples_in_model"] == d["samples_planned"] > 0 and d["samples_lost"] == 0 and not d["changes"]


@pytest.mark.skipif(not MNIST.is_dir(), reason="needs ../shared/data/mnist")
@pytest.mark.slow("a run of three DiLoCo workers on MNIST through a worker's death")
def test_diloco_trains_on_through_a_workers_death_and_counts_the_samples_it_lost(tmp_path: Path) -> None:
    out = tmp_path / "killed"
    args = _args(out, "diloco", 2, mode=("--sync-every", "10", "--on-failure", "continue"))
    proc = subprocess.Popen(args, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first epoch"
        time.sleep(0.05)
    os.kill(_find(proc.pid, rank=1), signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert "member 1 (rank 1 at the start) died" in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["started_with"] == 3 and summary["test_accuracy"] > 0.9
    d = summary["diloco"]
    # Rank 1's second epoch is lost, give or take its inner steps around the epoch's end: those since its last
    # outer step are lost with it, and the kill may come a few steps into the second epoch (32 samples a step).
    per_worker = d["samples_planned"] // 6
    assert per_worker - 10 * 32 <= d["samples_lost"] <= per_worker + 10 * 32
    assert d["samples_in_model"] + d["samples_lost"] == d["samples_planned"]
    assert "DiLoCo: worker(s) [1] left at step" in stdout and f"{d['samples_lost']} lost" in stdout

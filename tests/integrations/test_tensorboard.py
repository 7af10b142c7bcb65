"""ddpkit train --tensorboard: the event files read back equal metrics.jsonl, once per epoch, across a resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from procs import ROOT, base_env

from ddpkit.integrations.tensorboard import SCALARS, check
from ddpkit.runtime.options import ConfigError

pytest.importorskip("tensorboard", reason="TensorBoard is an optional extra: pip install 'ddpkit[tensorboard]'")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

JOB = ["--dataset", "synthetic", "--synthetic-samples", "256", "--batch-size", "32", "--no-progress"]


def _train(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "ddpkit", "train", *JOB, *args], cwd=ROOT, env=base_env(),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return done


def _board(directory: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(directory))  # purges points hidden by a restart marker, as TensorBoard does
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _expected(run: Path) -> dict[str, list[tuple[int, float]]]:
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {tag: [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in history] for key, tag in SCALARS.items()}


def _epochs(board: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    return {tag: points for tag, points in board.items() if tag != "train/loss_step"}


@pytest.mark.slow("a training run, then its resume, each in fresh processes")
def test_events_equal_the_metrics_once_per_epoch_across_a_resume(tmp_path):
    run, board = tmp_path / "run", tmp_path / "tb"
    _train("--epochs", "3", "--output-dir", str(run), "--tensorboard", str(board))
    first = _board(board)
    assert _epochs(first) == _expected(run)
    assert [step for step, _ in first["test/accuracy"]] == [4, 8, 12]
    assert [step for step, _ in first["train/loss_step"]] == [10]  # every STEP_EVERY = 10 steps, rank 0's loss

    # The newest checkpoint lost: the resumed run trains epoch 3 again and writes the history again; the
    # points of the first attempt are hidden, so each epoch shows once.
    newest = sorted((run / "checkpoints").glob("step-*.safetensors"))[-1]
    newest.unlink()
    (run / "model.safetensors").unlink()
    _train("--epochs", "4", "--output-dir", str(run), "--tensorboard", str(board), "--resume")
    after = _board(board)
    assert _epochs(after) == _expected(run)
    assert [step for step, _ in after["train/loss"]] == [4, 8, 12, 16]
    assert after["test/loss"][:3] == first["test/loss"]  # epoch 3 again, bit for bit
    # Step 10 trained again after the resume at step 8: shown once, with the same loss as the first time.
    assert after["train/loss_step"] == first["train/loss_step"]


def test_bad_directory_and_missing_package_are_refused_before_training(tmp_path, monkeypatch):
    afile = tmp_path / "board"
    afile.write_text("")
    done = subprocess.run([sys.executable, "-m", "ddpkit", "train", *JOB, "--tensorboard", str(afile)], cwd=ROOT,
                          env=base_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and f"--tensorboard {str(afile)!r} is a file" in done.stderr
    assert "Traceback" not in done.stderr
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)  # as on a machine without tensorboard
    with pytest.raises(ConfigError, match=r"needs the tensorboard package.*pip install 'ddpkit\[tensorboard\]'"):
        check(tmp_path / "tb")

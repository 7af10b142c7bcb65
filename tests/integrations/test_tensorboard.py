"""ddpkit train --tensorboard: the event files read back equal metrics.jsonl, once per epoch, across a resume."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from event_files import epochs_of, expected_from_metrics, read_board
from procs import ROOT, base_env

from ddpkit.integrations.tensorboard import MemberBoard, check
from ddpkit.runtime.options import ConfigError

pytest.importorskip("tensorboard", reason="TensorBoard is an optional extra: pip install 'ddpkit[tensorboard]'")

JOB = ["--dataset", "synthetic", "--synthetic-samples", "256", "--batch-size", "32", "--no-progress"]


def _train(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "ddpkit", "train", *JOB, *args], cwd=ROOT, env=base_env(),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.slow("a training run, then its resume, each in fresh processes")
def test_events_equal_the_metrics_once_per_epoch_across_a_resume(tmp_path):
    run, board = tmp_path / "run", tmp_path / "tb"
    _train("--epochs", "3", "--output-dir", str(run), "--tensorboard", str(board))
    first = read_board(board)
    assert epochs_of(first) == expected_from_metrics(run)
    assert [step for step, _ in first["test/accuracy"]] == [4, 8, 12]
    assert [step for step, _ in first["train/loss_step"]] == [10]  # every STEP_EVERY = 10 steps, rank 0's loss

    # The newest checkpoint lost: the resumed run trains epoch 3 again and writes the history again; the
    # points of the first attempt are hidden, so each epoch shows once.
    newest = sorted((run / "checkpoints").glob("step-*.safetensors"))[-1]
    newest.unlink()
    (run / "model.safetensors").unlink()
    _train("--epochs", "4", "--output-dir", str(run), "--tensorboard", str(board), "--resume")
    after = read_board(board)
    assert epochs_of(after) == expected_from_metrics(run)
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


def _record(step: int, loss: float, seconds: float) -> dict:
    return {"epoch": step // 12, "step": step, "train_loss": loss, "test_loss": loss, "test_accuracy": 0.5,
            "lr": 0.1, "samples_per_s": 100.0, "epoch_time_s": seconds}


def test_under_the_mode_the_member_that_becomes_first_writes_what_the_dead_one_left_unwritten(tmp_path):
    # --on-failure continue: the first member writes. Member A applies steps 1-24 and dies after step 24, the end
    # of epoch 2, before it wrote that epoch; member B, first from step 25 on, takes over at its first point.
    history = [_record(12, 1.0, 0.5), _record(24, 0.8, 0.6)]
    a = MemberBoard(tmp_path, resumed_at=None)
    for step in range(1, 25):
        a.applied(True, step)
        if step % 10 == 0:
            a.step(True, history[: step // 12], step, 3.0 - step / 10)
        if step == 12:
            a.epoch(True, history[:1])
    a.close()
    time.sleep(1.1)  # event files are named by the second they were opened in
    b = MemberBoard(tmp_path, resumed_at=None)
    mine = [dict(r, epoch_time_s=r["epoch_time_s"] + 1) for r in history]  # B timed the epochs itself
    for step in range(1, 37):
        b.applied(step > 24, step)
        if step % 10 == 0:
            b.step(step > 24, mine, step, 1.5)  # (not first: nothing written)
    mine.append(_record(36, 0.5, 0.7))
    b.epoch(True, mine)
    b.close()
    board = read_board(tmp_path)
    # Each epoch once: A's first, then B's from the step A was last first at (the epoch A did not write).
    assert board["perf/epoch_time_s"] == [(12, 0.5), (24, pytest.approx(1.6)), (36, pytest.approx(0.7))]
    assert [step for step, _ in board["train/loss"]] == [12, 24, 36]
    assert board["train/loss_step"] == [(10, 2.0), (20, 1.0), (30, 1.5)]  # A's own losses, then B's


def test_event_files_that_cannot_be_written_warn_and_training_goes_on(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    board = MemberBoard(tmp_path / "file" / "tb", resumed_at=None)  # a folder under a file: never writable
    board.step(True, [], 10, 1.0)
    board.step(True, [], 20, 1.0)  # the per-step points ended with the first failure: no second line
    board.epoch(True, [_record(12, 1.0, 0.5)])
    MemberBoard(tmp_path / "file" / "tb", resumed_at=5).epoch(True, [_record(12, 1.0, 0.5)])  # a take-over's
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all("could not write TensorBoard events" in line for line in lines)
    assert lines[0].endswith("training goes on, without per-step points") and lines[1].endswith("training goes on")

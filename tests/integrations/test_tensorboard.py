"""ddpkit train --tensorboard: the event files read back equal metrics.jsonl, once per epoch, across a resume."""

from __future__ import annotations

import subprocess
import sys

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
    _train("--epochs", "3", "--checkpoint-every", "5", "--output-dir", str(run), "--tensorboard", str(board))
    first = read_board(board)
    assert epochs_of(first) == expected_from_metrics(run)
    assert [step for step, _ in first["test/accuracy"]] == [4, 8, 12]
    assert [step for step, _ in first["train/loss_step"]] == [10]  # every STEP_EVERY = 10 steps, rank 0's loss

    # The newest checkpoint lost: the run resumes from step 10's (in epoch 3), trains the rest of epoch 3 again
    # and writes its epochs again; the points of the first attempt after step 10 are hidden, so each epoch shows
    # once, and step 10's own point, written before its checkpoint, stays (it was hidden and lost until
    # 2026-12-01: a resume from a step a multiple of 10, as every --checkpoint-every 50 one is).
    newest = sorted((run / "checkpoints").glob("step-*.safetensors"))[-1]
    newest.unlink()
    (run / "model.safetensors").unlink()
    assert sorted((run / "checkpoints").glob("step-*.safetensors"))[-1].name == "step-00000010.safetensors"
    _train("--epochs", "4", "--output-dir", str(run), "--tensorboard", str(board), "--resume")
    after = read_board(board)
    assert epochs_of(after) == expected_from_metrics(run)
    assert [step for step, _ in after["train/loss"]] == [4, 8, 12, 16]
    assert after["test/loss"][:3] == first["test/loss"]  # epoch 3 again, bit for bit
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


def test_under_the_mode_the_member_that_becomes_first_writes_the_run_as_it_holds_it(tmp_path):
    # --on-failure continue: the first member writes. Member A applies steps 1-24 and dies after step 24, the end
    # of epoch 2, before it wrote that epoch; member B, first from step 25 on, takes over at its first point: a
    # restart marker at its origin (0), then its own epochs and step points.
    history = [_record(12, 1.0, 0.5), _record(24, 0.8, 0.6)]
    a = MemberBoard(tmp_path)
    for step in range(1, 24):
        a.applied(step, 3.0 - step / 10)
        a.write(True, history[: step // 12])
    a.close()
    b = MemberBoard(tmp_path)  # (its file is named a second after A's: the marker must be read after A's points)
    mine = [dict(r, epoch_time_s=r["epoch_time_s"] + 1) for r in history]  # B timed the epochs itself
    for step in range(1, 37):
        b.applied(step, 1.5)
        b.write(step > 24, mine[: step // 12])  # (not first: nothing written)
        if step == 30:  # a state transfer brings an epoch B did not end itself
            mine.append(_record(36, 0.5, 0.7))
    b.close()
    board = read_board(tmp_path)
    assert board["perf/epoch_time_s"] == [(12, 1.5), (24, pytest.approx(1.6)), (36, pytest.approx(0.7))]
    assert [step for step, _ in board["train/loss"]] == [12, 24, 36]  # each epoch once, B's
    assert board["train/loss_step"] == [(10, 1.5), (20, 1.5), (30, 1.5)]  # B's own, each step once


def test_a_resumed_writer_keeps_what_came_before_its_origin(tmp_path):
    first = MemberBoard(tmp_path)
    for step in range(1, 25):
        first.applied(step, 2.0)
        first.write(True, [_record(12, 1.0, 0.5)] if step >= 12 else [])
    first.close()
    resumed = MemberBoard(tmp_path)  # a run resumed from the checkpoint of step 12: its steps 13 on, again
    history = [_record(12, 1.0, 0.5)]
    for step in range(13, 25):
        resumed.applied(step, 3.0)
        resumed.write(True, history + ([_record(24, 0.9, 0.5)] if step == 24 else []))
    resumed.close()
    board = read_board(tmp_path)
    assert board["train/loss_step"] == [(10, 2.0), (20, 3.0)] and [s for s, _ in board["train/loss"]] == [12, 24]
    assert board["train/loss"][1] == (24, pytest.approx(0.9))


def test_event_files_that_cannot_be_written_warn_and_training_goes_on(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    board = MemberBoard(tmp_path / "file" / "tb")  # a folder under a file: never writable
    for step in range(1, 25):
        board.applied(step, 1.0)
        board.write(True, [_record(12, 1.0, 0.5)] if step >= 12 else [])  # the take-over is tried at each point
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "could not write TensorBoard events" in lines[0], lines
    assert lines[0].endswith("training goes on, without TensorBoard events from this worker")

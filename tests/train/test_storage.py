"""Storage faults under ddpkit train: a full disk, a read-only folder, the run directory removed, a foreign file.

The disk faults are real: small tmpfs mounts (root is needed to mount; the
tests skip with the reason elsewhere). The last good checkpoint must never be
lost or overwritten, and every error names the file and the cause.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from procs import base_env
from torch import nn

import ddpkit
from ddpkit.train.checkpoint import CheckpointError
from ddpkit.train.state import TrainState, checkpoint_files

TRAIN = ["--dataset", "synthetic", "--synthetic-samples", "1024", "--no-progress"]


@contextlib.contextmanager
def _tmpfs(where: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'mount failed'}): needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _train(out: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpkit", "train", "--output-dir", str(out), *TRAIN, *extra],
                          env=base_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow("a training run on a tiny filesystem")
def test_a_full_disk_warns_once_keeps_the_last_good_one_and_fails_at_the_final_save_in_one_line(tmp_path: Path):
    with _tmpfs(tmp_path / "disk", "600k") as disk:
        out = disk / "run"
        done = _train(out, "--epochs", "3", "--checkpoint-every", "10")
        assert done.returncode == 1, done.stdout
        warnings = [line for line in done.stdout.splitlines() if line.startswith("ddpkit train: warning:")]
        kept = checkpoint_files(out / "checkpoints")
        # One warning for the first checkpoint that could not be written, then a count at the end.
        assert len(warnings) == 1 and "no space left on the device" in warnings[0], done.stdout
        assert "training goes on" in warnings[0] and f"a restart would resume from {kept[-1][1]}" in warnings[0]
        counted = [line for line in done.stdout.splitlines() if "checkpoint(s) of this run could not be written" in line]
        assert len(counted) == 1 and int(counted[0].split()[2]) > 1 and str(kept[-1][1]) in counted[0]
        # The final save fails in one line: the file, the cause, the newest checkpoint; no traceback.
        assert done.stderr.strip().splitlines() == [
            f"ddpkit train: error: could not write {out / 'model.safetensors'}: no space left on the device; the "
            f"newest checkpoint is {kept[-1][1]}: make room, then the same command with --resume finishes the run "
            "from it"], done.stderr
        payload = ddpkit.load_checkpoint(kept[-1][1])  # verifies every checksum
        assert payload["step"] == kept[-1][0]
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [p.name for _, p in kept]  # no temporary
        assert "epoch 3/3" in done.stdout  # training went on to the end


def test_a_read_only_output_directory_is_refused_before_any_worker(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        done = _train(ro / "run", "--epochs", "1")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"ddpkit train: error: --output-dir {str(ro / 'run')!r} cannot be written (Read-only file system: {ro}): "
        "choose a writable directory"]


@pytest.mark.slow("a training run whose folder is removed mid-run")
def test_a_run_directory_removed_mid_run_stops_the_run_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit", "train", "--output-dir", str(out), *TRAIN,
                             "--epochs", "40", "--checkpoint-every", "5"], env=base_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not checkpoint_files(out / "checkpoints"):
            assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint came"
            time.sleep(0.1)
        while proc.poll() is None:  # until it is gone: a checkpoint written while the tree goes refills its folder
            try:
                shutil.rmtree(out)
                break
            except OSError:
                time.sleep(0.01)
        assert not out.exists(), "the run ended before its folder could be removed"
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert f"the run directory {out} was removed while the run was going on: stopping here" in err
    assert not out.exists()  # nothing made it again


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "step-00000009.safetensors"
    other = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    TrainState(model=other, optimizer=None).save(tmp_path, 9)
    state = TrainState(model=nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), optimizer=None)
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} is not of this model: its tensor '0.weight' "
                                              r"has shape \[8, 4\], this model's \[3, 4\]"):
        state.load(ddpkit.load_checkpoint(path), source=path)
    missing = TrainState(model=nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(2, 2)), optimizer=None)
    with pytest.raises(CheckpointError, match="it has no tensor '2.weight'"):
        missing.load(ddpkit.load_checkpoint(path), source=path)
    assert torch.equal(ddpkit.load_checkpoint(path)["model"]["0.weight"], other[0].weight.detach())  # untouched


@pytest.mark.slow("two training runs, then a resume")
def test_resume_over_a_foreign_newest_checkpoint_names_the_file(tmp_path: Path) -> None:
    run, stranger = tmp_path / "run", tmp_path / "stranger"
    assert _train(run, "--epochs", "1").returncode == 0
    assert _train(stranger, "--epochs", "1", "--model", "mlp").returncode == 0
    newest = checkpoint_files(stranger / "checkpoints")[-1][1]
    planted = run / "checkpoints" / "step-99999999.safetensors"
    shutil.copy(newest, planted)
    done = _train(run, "--epochs", "2", "--resume")
    assert done.returncode == 2
    assert f"({planted.name}) was started with different settings that would change its result" in done.stderr
    assert "model: 'mlp' -> 'convnet'" in done.stderr


@pytest.mark.slow("a training run, then its resume")
def test_resume_falls_back_past_a_malformed_newest_checkpoint_warning_with_its_name(tmp_path: Path) -> None:
    # A file of another origin, malformed (its skeleton nested past any parser's depth): a CheckpointError like
    # any damage, so the run resumes from the one before, saying which file it skipped.
    from safetensors.torch import save_file

    run = tmp_path / "run"
    assert _train(run, "--epochs", "1").returncode == 0
    good = checkpoint_files(run / "checkpoints")[-1][1]
    planted = run / "checkpoints" / "step-99999999.safetensors"
    save_file({"0:w": torch.ones(1)}, planted, metadata={"ddpkit": "[" * 100_000 + "]" * 100_000})
    done = _train(run, "--epochs", "2", "--resume")
    assert done.returncode == 0, done.stderr
    assert f"skipping checkpoint {planted}" in done.stderr and "is corrupt" in done.stderr
    assert f"resuming from {good}" in done.stdout + done.stderr

"""The run directory's resume rules: what may change, what may not, and the data compared by content."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from ddpkit.runtime.options import ConfigError
from ddpkit.train import rundir
from ddpkit.train.train_config import TrainConfig
from ddpkit.train.state import TrainState


def _idx(path: Path, magic: int, dims: list[int], data: bytes) -> None:
    import struct

    path.write_bytes(struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in dims) + data)


def _mnist_folder(where: Path, images: int = 8010, fill: int = 0) -> Path:
    """A t10k-only MNIST folder: enough images for the 8000/rest split, made up."""
    where.mkdir(parents=True)
    _idx(where / "t10k-images-idx3-ubyte", 2051, [images, 2, 2], bytes([fill]) * (images * 4))
    _idx(where / "t10k-labels-idx1-ubyte", 2049, [images], bytes(images))
    return where


def _started_run(tmp_path: Path, **settings) -> tuple[Path, TrainConfig]:
    """A run directory as ``ddpkit train`` leaves it after its first checkpoint (written here, in one process)."""
    config = TrainConfig(output_dir=tmp_path / "run", epochs=2, **settings)
    claim = rundir.claim(config.to_dict(), 2)
    model = nn.Linear(2, 2)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       extra={"epoch": 1, "config": config.to_dict(), "world_size": 2})
    state.save(claim.out / rundir.CHECKPOINT_DIR, 7)
    return claim.out, config


def _resume(config: TrainConfig, **changes) -> rundir.Claim:
    settings = {**config.to_dict(), "resume": True, **changes}
    return rundir.claim(settings, 2)


def test_the_same_data_folder_spelled_another_way_resumes(tmp_path: Path, monkeypatch) -> None:
    data = _mnist_folder(tmp_path / "data" / "mnist")
    monkeypatch.chdir(tmp_path / "data")
    out, config = _started_run(tmp_path, dataset="mnist", data_dir=Path("mnist"))
    claim = _resume(config, data_dir=str(data.resolve()), output_dir=str(out))
    assert claim.checkpoint is not None and claim.checkpoint.name == "step-00000007.safetensors"


def test_the_same_files_in_another_folder_resume_and_other_files_do_not(tmp_path: Path, capsys) -> None:
    data = _mnist_folder(tmp_path / "mnist")
    out, config = _started_run(tmp_path, dataset="mnist", data_dir=data)
    copy = tmp_path / "elsewhere"
    shutil.copytree(data, copy)
    shutil.rmtree(data)  # moved: the old path is gone, the run's recorded fingerprint decides
    assert _resume(config, data_dir=str(copy), output_dir=str(out)).checkpoint is not None
    assert "(the same files)" in capsys.readouterr().out
    other = _mnist_folder(tmp_path / "other", fill=7)
    with pytest.raises(ConfigError, match=r"data_dir: .*mnist' -> .*other'"):
        _resume(config, data_dir=str(other), output_dir=str(out))


def test_operational_settings_may_change_and_are_named_in_one_line(tmp_path: Path, capsys) -> None:
    out, config = _started_run(tmp_path)
    claim = _resume(config, output_dir=str(out), checkpoint_every=20, keep_checkpoints=5, progress=False,
                    max_restarts=2, epochs=4)
    assert claim.checkpoint is not None
    lines = [line for line in capsys.readouterr().out.splitlines() if "changed settings" in line]
    assert lines == [f"ddpkit train: resuming {str(out)!r} with changed settings: checkpoint_every 50 -> 20, "
                     "keep_checkpoints 3 -> 5, max_restarts 0 -> 2, progress True -> False"]


def test_settings_that_change_the_result_are_refused_each_named(tmp_path: Path) -> None:
    out, config = _started_run(tmp_path)
    with pytest.raises(ConfigError) as refused:
        _resume(config, output_dir=str(out), lr=0.5, seed=3, batch_size=16, model="mlp", optimizer="adamw",
                amp="bf16", strategy="local-sgd", local_sgd=4)
    message = str(refused.value)
    for detail in ("lr: 0.02 -> 0.5", "seed: 0 -> 3", "batch_size: 32 -> 16", "model: 'convnet' -> 'mlp'",
                   "optimizer: 'sgd' -> 'adamw'", "amp: 'off' -> 'bf16'", "strategy: 'ddp' -> 'local-sgd'",
                   "local_sgd: None -> 4"):
        assert detail in message, message
    assert "resume with the original values" in message
    changeable = message.split("only operational settings (", 1)[1].split(")", 1)[0]
    assert "nproc_per_node" not in changeable and "--nproc-per-node only to the same world size" in message


def test_resume_takes_the_runs_own_settings_and_flags_given_override_them(tmp_path: Path) -> None:
    import json
    from argparse import Namespace

    from ddpkit.cli import _saved_settings

    out, config = _started_run(tmp_path, lr=0.05, seed=4, batch_size=16)
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    saved = _saved_settings(Namespace(resume=True, output_dir=out, config_file=None), TrainConfig)
    assert saved["lr"] == 0.05 and saved["seed"] == 4 and "resume" not in saved
    assert _saved_settings(Namespace(resume=False, output_dir=out, config_file=None), TrainConfig) == {}
    (tmp_path / "bad.json").write_text('{"lr": 0.1, "learning_rate": 3}')
    with pytest.raises(ConfigError, match="--config .*bad.json: learning_rate is not a setting of ddpkit train"):
        _saved_settings(Namespace(resume=False, output_dir=None, config_file=tmp_path / "bad.json"), TrainConfig)
    (tmp_path / "cut.json").write_text('{"lr": 0.')
    with pytest.raises(ConfigError, match="--config .*cut.json: cannot read its settings"):
        _saved_settings(Namespace(resume=False, output_dir=None, config_file=tmp_path / "cut.json"), TrainConfig)


@pytest.mark.slow("three short ddpkit train runs of two processes: straight, stopped, resumed")
def test_resume_with_the_output_dir_alone_is_bit_identical(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from procs import base_env, wait_for
    from safetensors.torch import load_file

    flags = ["--dataset", "synthetic", "--synthetic-samples", "512", "--batch-size", "16", "--lr", "0.01",
             "--seed", "3", "--checkpoint-every", "4", "--no-progress"]
    train = [sys.executable, "-m", "ddpkit", "train"]
    straight = subprocess.run([*train, *flags, "--epochs", "3", "--output-dir", str(tmp_path / "straight")],
                              env=base_env(), capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr[-3000:]
    run = tmp_path / "run"
    proc = subprocess.Popen([*train, *flags, "--epochs", "3", "--output-dir", str(run)], env=base_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: (run / "metrics.jsonl").is_file(), timeout=240)  # the first epoch is checkpointed
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    resumed = subprocess.run([*train, "--resume", "--output-dir", str(run)], env=base_env(), capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed" in resumed.stdout and "changed settings" not in resumed.stdout
    a, b = load_file(tmp_path / "straight" / "model.safetensors"), load_file(run / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)

"""The run directory's resume rules: what may change, what may not, and the data compared by content."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from ddpkit.runtime.options import ConfigError
from ddpkit.train import rundir
from ddpkit.train.config import TrainConfig
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

"""Sharded checkpoints of stage 3 verified as whole checkpoints are: every damaged, truncated, foreign or missing
file (a rank's, or the index) is a one-line ``CheckpointError`` naming it, from ``consolidate_sharded`` in one
process and from ``load_sharded`` on every rank, and the files have the mode of a whole checkpoint.

One checkpoint is saved at world 2 on the rank pool; each case damages a copy of it the way a disk, a copy or a
user would, and checks both readers.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.runtime.durable import CheckpointError


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def _save(directory: str, seed: int) -> None:
    model = ddpkit.DDP(_net(), zero_stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(seed + ddpkit.rank())
    nn.functional.cross_entropy(model(torch.randn(4, 6, generator=g)), torch.randint(0, 3, (4,), generator=g)
                                ).backward()
    opt.step()
    ddpkit.save_sharded(model, directory, opt)


def _load(directory: str) -> str:
    """What ``load_sharded`` says on this rank (``"loaded"`` when it loads)."""
    model = ddpkit.DDP(_net(), zero_stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    try:
        ddpkit.load_sharded(model, directory, opt)
    except (CheckpointError, FileNotFoundError) as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


@pytest.fixture(scope="module")
def saved(dist2, tmp_path_factory) -> tuple[Path, Path]:
    """A checkpoint, and a second one of the same model from other data (the source of foreign files)."""
    root = tmp_path_factory.mktemp("sharded")
    dist2.run(_save, str(root / "good"), 0)
    dist2.run(_save, str(root / "other"), 7)
    return root / "good", root / "other"


def _flip(path: Path, at: int) -> None:
    """Flip one bit (the exponent's highest of a float32 at a tensor's start, when ``at`` points there)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def _data_start(path: Path) -> int:
    """Where a safetensors file's tensor bytes begin (after its length and JSON header)."""
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def _flip_a_tensor(rank: int) -> Callable[[Path], str]:
    def damage(d: Path) -> str:
        f = d / f"rank-{rank}-of-2.safetensors"
        _flip(f, _data_start(f) + 3)
        return f"{f} is damaged: tensor"
    return damage


def _truncate(d: Path) -> str:
    f = d / "rank-1-of-2.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    return f"{f} is damaged: "


def _truncate_index(d: Path) -> str:
    f = d / "index.json"
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    return f"index {f} is damaged or truncated: not JSON"


def _edit_index(d: Path) -> str:
    f = d / "index.json"
    index = json.loads(f.read_text())
    index["params"][0]["shape"][0] += 1  # what a flipped digit would do: valid JSON, another checkpoint
    f.write_text(json.dumps(index))
    return f"index {f} is damaged: its content does not match its digest"


def _foreign(other: Path) -> Callable[[Path], str]:
    def damage(d: Path) -> str:
        shutil.copy(other / "rank-0-of-2.safetensors", d / "rank-0-of-2.safetensors")  # same size, other bytes
        return f"{d / 'rank-0-of-2.safetensors'} is damaged: tensor"
    return damage


def _missing(d: Path) -> str:
    (d / "rank-1-of-2.safetensors").unlink()
    return f"{d / 'rank-1-of-2.safetensors'} is missing"


def _not_safetensors(d: Path) -> str:
    f = d / "rank-0-of-2.safetensors"
    f.write_bytes(b"x" * f.stat().st_size)
    return f"{f} is damaged or not a safetensors file"


CASES = {"a bit in rank 0's tensors": _flip_a_tensor(0), "a bit in rank 1's tensors": _flip_a_tensor(1),
         "a truncated rank file": _truncate, "a truncated index": _truncate_index, "an edited index": _edit_index,
         "a missing rank file": _missing, "a rank file that is not safetensors": _not_safetensors}


@pytest.mark.parametrize("case", [*CASES, "a foreign rank file"])
def test_a_damaged_checkpoint_is_refused_by_name_by_every_reader(saved, dist2, tmp_path, case) -> None:
    good, other = saved
    copy = tmp_path / "copy"
    shutil.copytree(good, copy)
    said = (CASES[case] if case in CASES else _foreign(other))(copy)
    with pytest.raises(CheckpointError) as refused:
        ddpkit.consolidate_sharded(copy)
    assert said in str(refused.value) and "\n" not in str(refused.value)
    for rank, answer in enumerate(dist2.run(_load, str(copy))):  # every rank refuses, none is left waiting
        assert answer.startswith("CheckpointError: ") and said in answer, (rank, answer)


def test_the_good_checkpoint_loads_and_consolidates(saved, dist2) -> None:
    good, _ = saved
    assert dist2.run(_load, str(good)) == ["loaded", "loaded"]
    whole = ddpkit.consolidate_sharded(good)
    assert set(whole) == {"model", "optimizer"} and whole["model"]["0.weight"].shape == (8, 6)
    index = json.loads((good / "index.json").read_text())
    assert sorted(index["files"]) == ["rank-0-of-2.safetensors", "rank-1-of-2.safetensors"]


def test_every_file_has_a_whole_checkpoints_mode(saved, tmp_path) -> None:
    good, _ = saved
    whole = tmp_path / "whole.safetensors"
    ddpkit.save_checkpoint(whole, {"w": torch.ones(2)})
    mode = stat.S_IMODE(whole.stat().st_mode)
    assert mode == 0o666 & ~_umask()
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in good.iterdir()} == {
        "index.json": mode, "rank-0-of-2.safetensors": mode, "rank-1-of-2.safetensors": mode}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _save_with_a_full_disk_on_rank_1(directory: str) -> str:
    """What ``save_sharded`` says on this rank when rank 1's disk is full (its writer fails as safetensors' does)."""
    import errno

    import ddpkit.parallel.zero.sharded_checkpoints as shards

    if ddpkit.rank() == 1:
        def full(tensors, path):  # type: ignore[no-untyped-def]
            raise OSError(errno.ENOSPC, "No space left on device")

        shards.save_file = full
    try:
        _save(directory, 0)
    except CheckpointError as e:
        return str(e)
    finally:
        from safetensors.torch import save_file

        shards.save_file = save_file
    return "saved"


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank_at_once(dist2, tmp_path) -> None:
    # Not a rank raising alone while the others wait in the next collective until the timeout (1,800 s).
    said = dist2.run(_save_with_a_full_disk_on_rank_1, str(tmp_path / "ckpt"), timeout=60)
    assert said[0] == said[1] and "rank 1 could not write" in said[0] and "No space left on device" in said[0], said
    assert not (tmp_path / "ckpt" / "index.json").exists()  # never said to be whole


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


def _save_with_buffers(directory: str) -> dict[str, torch.Tensor]:
    model = ddpkit.DDP(_bn_net(), zero_stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))  # a tensor rate, as torch's take
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + ddpkit.rank())
        nn.functional.cross_entropy(model(torch.randn(4, 6, generator=g)), torch.randint(0, 3, (4,), generator=g)
                                    ).backward()
        opt.step()
        opt.zero_grad()
    ddpkit.save_sharded(model, directory, opt)
    return {n: b.clone() for n, b in model.module.named_buffers()}


def _load_with_buffers(directory: str) -> tuple[dict[str, torch.Tensor], object, str]:
    model = ddpkit.DDP(_bn_net(), zero_stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.5))
    ddpkit.load_sharded(model, directory, opt)
    smaller = ddpkit.DDP(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8)), zero_stage=3)
    try:
        ddpkit.load_sharded(smaller, directory)
        said = "loaded"
    except ValueError as e:
        said = str(e)
    return {n: b.clone() for n, b in model.module.named_buffers()}, opt.param_groups[0]["lr"], said


def test_buffers_and_a_tensor_learning_rate_go_through_a_sharded_checkpoint(dist2, tmp_path) -> None:
    # The buffers (BatchNorm's statistics) were not saved: a load left the model's own, and the consolidated state
    # dict failed a plain module's strict load on their missing keys. A tensor learning rate failed the save on
    # rank 0 (not JSON), leaving the others waiting and a directory without an index behind it.
    saved = dist2.run(_save_with_buffers, str(tmp_path / "ck"))[0]
    assert int(saved["1.num_batches_tracked"]) == 2
    for buffers, lr, said in dist2.run(_load_with_buffers, str(tmp_path / "ck")):
        assert all(torch.equal(buffers[n], saved[n]) for n in saved)
        assert isinstance(lr, torch.Tensor) and torch.equal(lr, torch.tensor(0.01))
        assert said.startswith("the sharded checkpoint in") and "their parameters differ first at position 4, " \
            "where the model has nothing more and the checkpoint '2.weight' of shape [3, 8]" in said
    whole = ddpkit.consolidate_sharded(tmp_path / "ck")
    plain = _bn_net()
    plain.load_state_dict(whole["model"])  # strict: every key, buffers included
    assert torch.equal(plain[1].running_mean, saved["1.running_mean"])
    (tmp_path / "ck" / "index.json").unlink()
    with pytest.raises(ddpkit.WorkerError, match="holds a sharded checkpoint \\(an unfinished one"):
        dist2.run(_save_with_buffers, str(tmp_path / "ck"))

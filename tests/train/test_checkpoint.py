"""ddpkit.save_checkpoint / load_checkpoint: round trip, safety, atomicity, prefixes."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import ddpkit
from ddpkit.models import build_model
from ddpkit.train.checkpoint import CheckpointError, load_model_state, save_weights
from ddpkit.train.encoding import encode_state


def _state() -> dict:
    model = build_model("convnet")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),  # int keys, tuples (betas), floats
        "epoch": 3,
        "rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "np_rng": np.random.get_state(),
        "half": torch.randn(3, dtype=torch.bfloat16),
        "misc": [None, True, 1.5, float("inf"), "x", (1, 2)],
    }


def _assert_same(a, b) -> None:
    # OrderedDict comes back as dict (same items, same order); everything else keeps its type.
    assert type(a) is type(b) or isinstance(a, dict), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_round_trip_is_exact(tmp_path: Path) -> None:
    state = _state()
    ddpkit.save_checkpoint(tmp_path / "c.safetensors", state)
    loaded = ddpkit.load_checkpoint(tmp_path / "c.safetensors")
    _assert_same(state, loaded)
    # The restored states are usable as such.
    random.setstate(loaded["py_rng"])
    np.random.set_state(loaded["np_rng"])
    torch.set_rng_state(loaded["rng"])
    opt = torch.optim.AdamW(build_model("convnet").parameters())
    opt.load_state_dict(loaded["optimizer"])
    assert not list(tmp_path.glob(".*tmp*")), "temporary file left behind"


def test_sparse_tensors_come_back_sparse_as_from_torch_save(tmp_path: Path) -> None:
    # An uncoalesced one (index 0 twice) stays uncoalesced, as torch.save keeps it.
    loose = torch.sparse_coo_tensor(torch.tensor([[0, 0, 2]]), torch.tensor([1.0, 2.0, 3.0]), (4,),
                                    check_invariants=True)
    tight = torch.sparse_coo_tensor(torch.tensor([[0, 1], [2, 0]]), torch.tensor([5, 6]), (2, 3),
                                    check_invariants=True).coalesce()
    ddpkit.save_checkpoint(tmp_path / "c", {"loose": loose, "tight": tight})
    loaded = ddpkit.load_checkpoint(tmp_path / "c")
    torch.save({"loose": loose, "tight": tight}, tmp_path / "t.pt")
    reference = torch.load(tmp_path / "t.pt", weights_only=True)
    for name in ("loose", "tight"):
        got, want = loaded[name], reference[name]
        assert got.layout == torch.sparse_coo and got.dtype == want.dtype and got.shape == want.shape
        assert got.is_coalesced() == want.is_coalesced()
        assert torch.equal(got._indices(), want._indices()) and torch.equal(got._values(), want._values())
    with pytest.raises(CheckpointError, match="sparse_csr tensor at /csr: convert it first"):
        ddpkit.save_checkpoint(tmp_path / "d", {"csr": torch.eye(2).to_sparse_csr()})
    assert not (tmp_path / "d").exists()
    # A crafted file (its checksums made to match) whose indices lie outside the shape is refused, not loaded.
    skeleton, tensors, _ = encode_state({"x": loose})
    skeleton["__dict__"][0][1]["__sparse_coo__"][2] = [1]
    with pytest.raises(CheckpointError, match="is corrupt: bad skeleton .*size is inconsistent with indices"):
        ddpkit.load_checkpoint(_crafted(tmp_path / "e", skeleton, tensors))


def _crafted(path: Path, skeleton: dict, tensors: dict) -> Path:
    """A checkpoint file of this skeleton whose checksums match it, as a damaged or hostile writer could make."""
    from safetensors.torch import save

    from ddpkit.train.checkpoint import _FORMAT, _checksums

    meta = json.dumps({"format": _FORMAT, "state": skeleton})
    path.write_bytes(save(tensors, metadata={"ddpkit": meta, "ddpkit_checksums": _checksums(meta, tensors)}))
    return path


def nn_param(data: torch.Tensor, requires_grad: bool = True) -> torch.nn.Parameter:
    return torch.nn.Parameter(data, requires_grad=requires_grad)


def test_parameters_and_requires_grad_come_back_as_from_torch_save(tmp_path: Path) -> None:
    leaf = torch.randn(3, requires_grad=True)
    state = {"trained": nn_param(torch.randn(2, 2)), "frozen": nn_param(torch.arange(3), requires_grad=False),
             "leaf": leaf, "computed": leaf * 2, "plain": torch.ones(2),
             "sparse": torch.eye(2).to_sparse().requires_grad_()}
    ddpkit.save_checkpoint(tmp_path / "c", state)
    loaded = ddpkit.load_checkpoint(tmp_path / "c")
    torch.save(state, tmp_path / "t.pt")
    reference = torch.load(tmp_path / "t.pt", weights_only=True)
    for name, want in reference.items():
        got = loaded[name]
        assert (type(got), got.requires_grad, got.is_leaf) == (type(want), want.requires_grad, want.is_leaf), name
        assert torch.equal(got.detach().to_dense(), want.detach().to_dense()), name
    assert type(loaded["trained"]) is torch.nn.Parameter and loaded["leaf"].requires_grad  # what was compared


def test_tensors_that_share_memory_are_stored_once_and_come_back_sharing_it_with_their_strides(tmp_path: Path) -> None:
    emb = torch.nn.Embedding(500, 32)
    head = torch.nn.Linear(32, 500, bias=False)
    head.weight = emb.weight  # tied, as a language model's embedding and output layer
    big = torch.randn(40, 40)
    z = torch.randn(4, dtype=torch.complex64)
    state = {"model": torch.nn.ModuleDict({"emb": emb, "head": head}).state_dict(), "row": big[3],
             "col": big[:, 5], "block": big[10:20, 10:20].t(), "param": torch.nn.Parameter(big[30:32]),
             "z": z, "conj": z.conj(), "alone": torch.randn(3),
             "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)}
    ddpkit.save_checkpoint(tmp_path / "c", state)
    torch.save(state, tmp_path / "t.pt")
    loaded = ddpkit.load_checkpoint(tmp_path / "c")
    # Views of one storage in several dtypes, which torch.save refuses, come back too.
    ddpkit.save_checkpoint(tmp_path / "r", {"z": z, "real": z.real, "bytes": z[1:3].view(torch.uint8)})
    mixed = ddpkit.load_checkpoint(tmp_path / "r")
    assert torch.equal(mixed["real"], z.real) and torch.equal(mixed["bytes"], z[1:3].view(torch.uint8))
    assert mixed["z"].untyped_storage().data_ptr() == mixed["real"].untyped_storage().data_ptr()
    reference = torch.load(tmp_path / "t.pt", weights_only=True)
    for name in ("row", "col", "block", "param", "z", "conj", "alone", "channels_last"):
        got, want = loaded[name], reference[name]
        assert type(got) is type(want) and got.stride() == want.stride() and torch.equal(got, want), name
    tied = loaded["model"]
    assert torch.equal(tied["emb.weight"], state["model"]["emb.weight"])
    assert tied["emb.weight"].data_ptr() == tied["head.weight"].data_ptr()  # as torch.load's
    with torch.no_grad():
        loaded["row"][5] = 123.0  # the views share their memory, as torch.load's do
        reference["row"][5] = 123.0
    assert loaded["col"][3] == reference["col"][3] == 123.0
    # Stored once: the tied matrix is not written twice, and no more than torch.save writes.
    assert (tmp_path / "c").stat().st_size < (tmp_path / "t.pt").stat().st_size
    assert (tmp_path / "c").stat().st_size < 2 * 500 * 32 * 4
    # A crafted file whose view reaches past its stored bytes is refused as corrupt, in one line.
    skeleton, tensors, _ = encode_state({"a": big[0], "b": big[1]})
    skeleton["__dict__"][1][1]["size"] = [10**6]
    with pytest.raises(CheckpointError, match="is corrupt: bad skeleton"):
        ddpkit.load_checkpoint(_crafted(tmp_path / "e", skeleton, tensors))


def test_map_location_takes_torch_loads_forms(tmp_path: Path) -> None:
    state = {"w": nn_param(torch.randn(2, 3)), "i": torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,))}
    ddpkit.save_checkpoint(tmp_path / "c", state)
    torch.save(state, tmp_path / "t.pt")
    kept: list = []
    forms = ["cpu", torch.device("cpu"), None, {"cpu": "cpu"}, {"cuda:1": "cuda:0"}, lambda s, where: None,
             lambda s, where: kept.append(where) or s]
    for form in forms:
        for file in ("c", "t.pt"):
            got = ddpkit.load_checkpoint(tmp_path / file, map_location=form)
            assert got["w"].device.type == "cpu" and type(got["w"]) is torch.nn.Parameter, (form, file)
            assert torch.equal(got["w"], state["w"]) and torch.equal(got["i"].to_dense(), state["i"].to_dense())
    assert kept and set(kept) == {"cpu"}  # the saved location, as torch.load hands it
    for form in ("meta", {"cpu": "meta"}):
        got = ddpkit.load_checkpoint(tmp_path / "c", map_location=form)
        assert got["w"].device.type == "meta" and got["w"].shape == (2, 3) and got["i"].device.type == "meta"
    with pytest.raises(TypeError, match="map_location returned int for tensor .* must return a storage"):
        ddpkit.load_checkpoint(tmp_path / "c", map_location=lambda s, where: 3)
    with pytest.raises(IsADirectoryError, match="is a folder: pass a checkpoint file in it"):
        ddpkit.load_checkpoint(tmp_path)
    with pytest.raises(TypeError, match="map_location=3: pass a device"):
        ddpkit.load_checkpoint(tmp_path / "c", map_location=3)
    with pytest.raises(ValueError, match="map_location='gpu' is not a device"):
        ddpkit.load_checkpoint(tmp_path / "c", map_location="gpu")
    if not torch.cuda.is_available():
        for file in ("c", "t.pt"):
            with pytest.raises(ValueError, match="map_location='cuda:0': this machine has no CUDA device"):
                ddpkit.load_checkpoint(tmp_path / file, map_location="cuda:0")

def test_rejects_objects_that_are_not_plain_data(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot checkpoint object"):
        ddpkit.save_checkpoint(tmp_path / "c", {"x": object()})
    assert not (tmp_path / "c").exists()


def test_truncated_and_corrupt_files_give_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    ddpkit.save_checkpoint(path, _state())
    data = path.read_bytes()
    for cut in (4, 100, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated|corrupt"):
            ddpkit.load_checkpoint(path)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"not json at all!" + data[24:])
    with pytest.raises(CheckpointError, match="corrupt"):
        ddpkit.load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ddpkit.load_checkpoint(tmp_path / "missing")


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_torch_save_files_load_weights_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    sd = build_model("mlp").state_dict()
    torch.save(sd, tmp_path / "plain.pt")
    _assert_same(sd, ddpkit.load_checkpoint(tmp_path / "plain.pt"))
    torch.save({"x": _Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="weights_only"):
        ddpkit.load_checkpoint(tmp_path / "evil.pt")
    (tmp_path / "evil.pkl").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError):
        ddpkit.load_checkpoint(tmp_path / "evil.pkl")
    # A damaged zip is damaged, not unsafe: the message says what failed.
    (tmp_path / "cut.pt").write_bytes((tmp_path / "plain.pt").read_bytes()[:300])
    with pytest.raises(CheckpointError, match="cut.pt is a torch.save file that torch.load cannot read: "):
        ddpkit.load_checkpoint(tmp_path / "cut.pt")
    assert not (tmp_path / "pwned").exists()


def test_module_prefix_either_way(tmp_path: Path) -> None:
    src = build_model("convnet")
    prefixed = {f"module.{k}": v for k, v in src.state_dict().items()}
    plain_model = build_model("convnet")
    load_model_state(plain_model, prefixed)
    _assert_same(src.state_dict(), plain_model.state_dict())

    class Wrapper(torch.nn.Module):  # stands for DDP: its keys carry "module."
        def __init__(self, m):
            super().__init__()
            self.module = m

    wrapped = Wrapper(build_model("convnet"))
    load_model_state(wrapped, src.state_dict())
    _assert_same(src.state_dict(), wrapped.module.state_dict())
    save_weights(tmp_path / "w.safetensors", prefixed)
    flat = load_file(tmp_path / "w.safetensors")
    assert sorted(flat) == sorted(src.state_dict())
    _assert_same(dict(sorted(flat.items())), dict(sorted(ddpkit.load_checkpoint(tmp_path / "w.safetensors").items())))


def _save_then_read(path: str) -> list:
    # Rank 1 passes a different state: only rank 0's is written.
    state = {"rank": ddpkit.rank(), "w": torch.full((3,), float(ddpkit.rank()))}
    ddpkit.save_checkpoint(path, state)
    # Every rank may read at once: save returned only after the file was on disk.
    loaded = ddpkit.load_checkpoint(path)
    return [loaded["rank"], loaded["w"].tolist()]


def _save_to_a_folder(path: str) -> str:
    os.makedirs(path, exist_ok=True)  # a folder where the file should go: rank 0 fails
    try:
        ddpkit.save_checkpoint(path, {"x": 1})
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_collective_save(dist2, tmp_path: Path) -> None:
    assert dist2.run(_save_then_read, str(tmp_path / "c.safetensors")) == [[0, [0.0] * 3]] * 2
    errors = dist2.run(_save_to_a_folder, str(tmp_path / "dir"))
    # Every rank raises the same error: the file and rank 0's cause.
    assert errors[0] == errors[1] == f"could not write {tmp_path / 'dir'}: a folder is in the way"


def test_a_failed_write_keeps_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "ckpt.safetensors"
    ddpkit.save_checkpoint(path, {"w": torch.ones(3), "epoch": 1})
    before = path.read_bytes()

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(CheckpointError, match="ckpt.safetensors: no space left on the device"):
        ddpkit.save_checkpoint(path, {"w": torch.zeros(3), "epoch": 2})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert ddpkit.load_checkpoint(path)["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]


def _foreign(path: Path, meta: str | None, sums: str | None = None, tensors: dict | None = None,
             sign: bool = False) -> Path:
    """A safetensors file with ddpkit's metadata keys set to what a test gives (another origin's, or damage);
    ``sign``: with the checksums of what it holds, as ddpkit would write them."""
    from safetensors.torch import save_file

    from ddpkit.train.checkpoint import _checksums

    tensors = tensors if tensors is not None else {"0:w": torch.ones(2)}
    if sign:
        sums = _checksums(meta, tensors)
    metadata = {k: v for k, v in (("ddpkit", meta), ("ddpkit_checksums", sums)) if v is not None}
    save_file(tensors, path, metadata=metadata)
    return path


DEEP = "[" * 100_000 + "]" * 100_000
"""JSON nested past any parser's recursion limit."""


@pytest.mark.parametrize("meta, sums, what", [
    (DEEP, None, "a skeleton nested very deep"),
    ('{"format": 2, "state": ' + "[" * 5000 + "]" * 5000 + "}", "sign", "a state nested very deep, signed"),
    ('{"format": 2, "state": ' + "[" * 5000 + "]" * 5000 + "}", None, "a state nested very deep"),
    ("[1, 2, 3]", None, "a skeleton that is not an object"),
    ('"just a string"', None, "a skeleton that is a string"),
    ("{not json", None, "a skeleton that is not JSON"),
    ('{"format": 2, "state": {"__tensor__": "0:w"}}', DEEP, "checksums nested very deep"),
    ('{"format": 2, "state": {"__tensor__": "0:w"}}', "[]", "checksums that are not an object"),
    ('{"format": 2, "state": {"__tensor__": "0:w"}}', "{broken", "checksums that are not JSON"),
    ('{"format": "2", "state": {}}', None, "a format that is not a number"),
    ('{"format": 2, "state": {"__dict__": [[1, 2, 3]]}}', None, "a dict entry of three"),
    ('{"format": 2, "state": {"__view__": "0:w", "dtype": "float32", "offset": "x", "size": [1], "stride": [1]}}',
     None, "a view with a bad offset"),
])
def test_a_malformed_or_foreign_file_is_a_checkpoint_error_in_one_line(tmp_path: Path, meta, sums, what) -> None:
    # --resume falls back past a CheckpointError, never past a RecursionError or an AttributeError.
    path = _foreign(tmp_path / "bad.safetensors", meta, None if sums == "sign" else sums, sign=sums == "sign")
    with pytest.raises(CheckpointError) as raised:
        ddpkit.load_checkpoint(path)
    message = str(raised.value)
    assert "bad.safetensors" in message and "\n" not in message and len(message) < 400, (what, message)


@pytest.mark.parametrize("name", ["qint8", "quint8", "qint32", "quint4x2", "bits8", "not_a_dtype", "Tensor"])
def test_only_dtypes_a_checkpoint_holds_are_accepted(tmp_path: Path, name: str) -> None:
    path = _foreign(tmp_path / "q.safetensors", json.dumps({"format": 3, "state": {
        "__view__": "0:w", "dtype": name, "offset": 0, "size": [1], "stride": [1]}}), sign=True)
    with pytest.raises(CheckpointError, match=f"dtype {name!r}"):
        ddpkit.load_checkpoint(path)
    with pytest.raises(CheckpointError, match=f"dtype {name!r}"):
        ddpkit.load_checkpoint(_foreign(tmp_path / "d.safetensors", json.dumps(
            {"format": 2, "state": {"__dtype__": name}}), sign=True))


def test_a_quantized_tensor_is_refused_at_save_with_the_fix(tmp_path: Path) -> None:
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(CheckpointError, match="dequantize"):
        ddpkit.save_checkpoint(tmp_path / "q", {"q": q})
    assert not (tmp_path / "q").exists()


def test_tensors_sharing_an_address_but_not_a_storage_save_and_load(tmp_path: Path) -> None:
    # Two tensors made from NumPy arrays that start at one address but span different lengths: two storages.
    # Grouped by address they were saved as views of the first's storage, and could not be read back.
    base = np.arange(12, dtype=np.float32)
    whole, head = torch.from_numpy(base), torch.from_numpy(base[:4])
    assert whole.data_ptr() == head.data_ptr() and whole.untyped_storage().nbytes() != head.untyped_storage().nbytes()
    path = tmp_path / "np.safetensors"
    ddpkit.save_checkpoint(path, {"head": head, "whole": whole, "tail": torch.from_numpy(base[8:])})
    back = ddpkit.load_checkpoint(path)
    assert torch.equal(back["whole"], whole) and torch.equal(back["head"], head)
    assert torch.equal(back["tail"], torch.arange(8, 12, dtype=torch.float32))


def test_a_newer_format_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "future.safetensors"
    save_file({"0:w": torch.ones(1)}, path, metadata={"ddpkit": '{"format": 99, "state": {}}'})
    with pytest.raises(CheckpointError, match="format 99, newer than this ddpkit reads"):
        ddpkit.load_checkpoint(path)


def test_a_save_killed_midway_leaves_the_old_file_and_its_temporary_goes_at_the_next_save(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "ckpt.safetensors"
    ddpkit.save_checkpoint(path, {"w": torch.ones(3), "step": 1})
    # A process saving ~400 MB over the same path, killed once its temporary exists.
    code = (
        "import sys, torch, ddpkit\n"
        "ddpkit.save_checkpoint(sys.argv[1], {'w': torch.zeros(100_000_000), 'step': 2})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)])
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".ckpt.safetensors.tmp-*")):
        assert proc.poll() is None and time.monotonic() < deadline, "the save never started"
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.glob(".ckpt.safetensors.tmp-*")), "the killed save left no temporary"
    assert ddpkit.load_checkpoint(path)["step"] == 1  # the old file is whole; loading also clears the stale temporary
    assert not list(tmp_path.glob(".ckpt.safetensors.tmp-*"))
    ddpkit.save_checkpoint(path, {"w": torch.ones(3), "step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]


def test_a_header_length_starting_with_0x80_is_still_safetensors(tmp_path: Path) -> None:
    # The first byte of a safetensors file is the low byte of its header length;
    # 0x80 there once sent the file to torch.load as if it were a pickle.
    from safetensors.torch import save

    for pad in range(300):
        data = save({"w": torch.ones(2)}, metadata={"x": "y" * pad})
        if data[0] == 0x80:
            break
    else:
        pytest.fail("no metadata length gave a header length ending in 0x80")
    path = tmp_path / "w.safetensors"
    path.write_bytes(data)
    assert torch.equal(ddpkit.load_checkpoint(path)["w"], torch.ones(2))


def test_train_state_counts_optimizer_steps_and_restores_everything(tmp_path: Path) -> None:
    def build() -> tuple:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        return model, opt, ddpkit.DistributedSampler(range(10), num_replicas=1, rank=0)

    torch.manual_seed(0)
    model, opt, sampler = build()
    state = ddpkit.TrainState(model=model, optimizer=opt, sampler=sampler, extra={"epoch": 3})

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(5, 3)).sum().backward()
        opt.step()

    for _ in range(3):
        step()
    assert state.step == 3  # counted by the optimizer's step hook
    it = iter(sampler)
    next(it), next(it)  # two samples of this epoch handed out
    assert state.save(tmp_path).name == "step-00000003.safetensors"
    expected = [p.detach().clone() for p in model.parameters()]
    moments = opt.state_dict()["state"][0]["exp_avg"].clone()
    after = torch.rand(3)  # the RNG's next draw after the save
    rest = list(it)
    step()
    step()
    state.save(tmp_path)
    (tmp_path / "step-00000005.safetensors").write_bytes(b"damaged on disk")

    torch.manual_seed(123)
    model2, opt2, sampler2 = build()
    fresh = ddpkit.TrainState(model=model2, optimizer=opt2, sampler=sampler2)
    with pytest.warns(UserWarning, match="skipping checkpoint .*step-00000005"):
        assert fresh.restore(tmp_path) == 3
    for a, b in zip(model2.parameters(), expected):
        assert torch.equal(a, b)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], moments)
    assert fresh.extra == {"epoch": 3} and fresh.step == 3
    assert torch.equal(torch.rand(3), after)
    assert list(sampler2) == rest  # the epoch continues with the next sample

    for k in (6, 7, 8):
        fresh.save(tmp_path, k)
    assert [p.name for p in sorted(tmp_path.glob("step-*"))] == [f"step-0000000{k}.safetensors" for k in (6, 7, 8)]
    assert ddpkit.TrainState(model=model2).restore(tmp_path / "nothing-here") == 0

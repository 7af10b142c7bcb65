"""ddpkit.data.datasets: digits, the MNIST IDX reader and its errors, synthetic data."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from ddpkit.data.datasets import DatasetError, load_dataset, read_idx

MNIST_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mnist"


def _idx(magic: int, dims: tuple[int, ...], payload: bytes | None = None) -> bytes:
    n = int(np.prod(dims))
    body = payload if payload is not None else bytes(i % 10 for i in range(n))
    return struct.pack(">i", magic) + struct.pack(f">{len(dims)}i", *dims) + body


def _write_t10k(folder: Path, n: int = 10_000, labels_n: int | None = None, gz: bool = True) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    ext = ".gz" if gz else ""
    wrap = gzip.compress if gz else (lambda b: b)
    (folder / f"t10k-images-idx3-ubyte{ext}").write_bytes(wrap(_idx(2051, (n, 28, 28))))
    (folder / f"t10k-labels-idx1-ubyte{ext}").write_bytes(wrap(_idx(2049, (labels_n or n,))))


def test_digits_is_fixed_80_20_and_28x28() -> None:
    a, b = load_dataset("digits"), load_dataset("digits")
    assert (len(a.train), len(a.test)) == (1438, 359)
    assert a.train.images.shape[1:] == (1, 28, 28) and a.train.labels.dtype == torch.int64
    assert torch.equal(a.test.images, b.test.images) and torch.equal(a.train.labels, b.train.labels)
    assert abs(float(a.train.images.mean())) < 1e-4


@pytest.mark.parametrize("gz", [True, False])
def test_t10k_only_gives_8000_2000(tmp_path: Path, gz: bool) -> None:
    _write_t10k(tmp_path, gz=gz)
    s = load_dataset("mnist", data_dir=tmp_path)
    assert (len(s.train), len(s.test)) == (8000, 2000)
    assert s.train.images.shape[1:] == (1, 28, 28)


def test_malformed_files_give_clear_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    (bad).mkdir()
    (bad / "x").write_bytes(_idx(2049, (5, 28, 28)))
    with pytest.raises(DatasetError, match="bad magic number 2049 \\(expected 2051\\)"):
        read_idx(bad / "x", 2051)
    (bad / "y").write_bytes(_idx(2051, (5, 28, 28))[:-7])
    with pytest.raises(DatasetError, match="truncated data"):
        read_idx(bad / "y", 2051)
    (bad / "z.gz").write_bytes(gzip.compress(_idx(2051, (5, 28, 28)))[:-20])
    with pytest.raises(DatasetError, match="truncated"):
        read_idx(bad / "z.gz")
    _write_t10k(tmp_path / "mismatch", n=9000, labels_n=8999)
    with pytest.raises(DatasetError, match="9000 images but .* 8999 labels"):
        load_dataset("mnist", data_dir=tmp_path / "mismatch")


def test_missing_or_empty_data_dir(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset("mnist", data_dir=tmp_path / "nope")
    with pytest.raises(DatasetError, match="is empty"):
        load_dataset("mnist", data_dir=tmp_path)
    with pytest.raises(DatasetError, match="needs --data-dir"):
        load_dataset("mnist")
    with pytest.raises(DatasetError, match="unknown dataset 'cifar'"):
        load_dataset("cifar")


def test_synthetic_shape_and_size() -> None:
    s = load_dataset("synthetic", synthetic_samples=64, synthetic_shape=(3, 16, 16))
    assert s.train.images.shape == (64, 3, 16, 16) and len(s.test) == 16
    assert s.train.labels.max() < 10


@pytest.mark.skipif(not MNIST_DIR.is_dir(), reason="real MNIST files absent")
def test_real_mnist_t10k() -> None:
    s = load_dataset("mnist", data_dir=MNIST_DIR)
    assert (len(s.train), len(s.test)) == (8000, 2000)
    assert s.test.labels.bincount().tolist() == [207, 230, 198, 207, 194, 169, 202, 215, 187, 191]


SHAKESPEARE_DIR = MNIST_DIR.parent / "tinyshakespeare"


@pytest.mark.skipif(not SHAKESPEARE_DIR.is_dir(), reason="needs ../shared/data/tinyshakespeare")
def test_tiny_shakespeare_is_cut_into_samples_whose_targets_are_the_next_characters() -> None:
    splits = load_dataset("shakespeare", data_dir=SHAKESPEARE_DIR)
    text = (SHAKESPEARE_DIR / "input.txt").read_text()
    train, test = splits.train, splits.test
    assert train.vocab_size == test.vocab_size == 65 and train.block_size == 64
    assert len(train) == (int(0.9 * len(text)) - 1) // 64 and len(test) == (len(text) - int(0.9 * len(text)) - 1) // 64
    decode = "".join
    assert decode(train.symbols[i] for i in train.images[1]) == text[64:128]
    assert decode(train.symbols[i] for i in train.labels[1]) == text[65:129]
    assert decode(test.symbols[i] for i in test.images[0]) == text[int(0.9 * len(text)):][:64]
    first = load_dataset("shakespeare", data_dir=SHAKESPEARE_DIR / "input.txt", train_samples=10, test_samples=3)
    assert len(first.train) == 10 and len(first.test) == 3 and torch.equal(first.train.images, train.images[:10])


def test_a_text_that_is_missing_or_too_short_is_named(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"tiny Shakespeare is not at .*input.txt: point --data-dir"):
        load_dataset("shakespeare", data_dir=tmp_path)
    with pytest.raises(DatasetError, match="--dataset shakespeare needs --data-dir"):
        load_dataset("shakespeare")
    (tmp_path / "input.txt").write_text("to be or not to be")
    with pytest.raises(DatasetError, match="holds 18 characters: too few for samples of 64"):
        load_dataset("shakespeare", data_dir=tmp_path)
    with pytest.raises(DatasetError, match="train_samples=0 must be at least 1"):
        load_dataset("digits", train_samples=0)

"""The datasets ``ddpkit train`` offers, behind one interface: :func:`load_dataset`.

* ``digits`` (default): the 1,797 8x8 handwritten digits that ship inside
  scikit-learn, scaled to 28x28 (bilinear) so MNIST models run unchanged, and
  split 80/20 by a fixed permutation (1,438 train, 359 test). Needs no download.
* ``mnist``: the original IDX files in ``data_dir``, gzip-compressed or raw
  (``train-images-idx3-ubyte[.gz]``, ``train-labels-idx1-ubyte[.gz]``,
  ``t10k-images-idx3-ubyte[.gz]``, ``t10k-labels-idx1-ubyte[.gz]``). With all
  four: the official 60,000/10,000 split. With only the t10k pair: a fixed
  split, the first 8,000 images for training and the last 2,000 for testing.
  ``download=True`` fetches the files first (rank 0 of each node; needs network).
* ``synthetic``: random images of a configurable shape and count whose labels
  a fixed random linear map decides (so it is learnable), for benchmarks.
* ``shakespeare``: tiny Shakespeare (``input.txt`` in ``data_dir``, 1.1 M
  characters), character by character for ``--model gpt``: the first 90 %
  for training, the last 10 % for validation, each cut into samples of
  ``block_size`` + 1 characters that do not overlap (the input is the first
  ``block_size``, the target each one's next); the symbols are the text's
  characters in sorted order (65). A :class:`TokenDataset`.

Every dataset is held in memory as one float tensor of normalised images
``(N, C, H, W)`` and one int64 tensor of labels: a training step indexes a
whole batch at once (``dataset[indices]``), with no per-sample collation.
A malformed IDX file raises :class:`DatasetError` naming the file and the defect
(bad magic number, truncated data, image/label count mismatch).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import math
import struct
import urllib.request
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ddpkit.runtime.options import ConfigError

__all__ = [
    "DATASETS",
    "DatasetError",
    "Splits",
    "TensorDataset",
    "TokenDataset",
    "load_dataset",
    "read_idx",
]

DATASETS = ("digits", "mnist", "synthetic", "shakespeare")
"""Names ``ddpkit train --dataset`` accepts."""

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
"""The usual MNIST normalisation, computed over the 60,000 training images."""

MNIST_MIRROR = "https://ossci-datasets.s3.amazonaws.com/mnist/"
_IMAGES_MAGIC, _LABELS_MAGIC = 2051, 2049
_T10K_TRAIN = 8000


class DatasetError(ConfigError):
    """A dataset cannot be found or read: the message names the path and the fix."""


class TensorDataset(Dataset):
    """Images and labels held as two tensors; ``dataset[i]`` or ``dataset[list_of_i]``.

    Args:
        images: Float tensor ``(N, C, H, W)``, already normalised.
        labels: Int64 tensor ``(N,)``.
        num_classes: Number of label values.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, num_classes: int = 10) -> None:
        if len(images) != len(labels):
            raise DatasetError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = labels
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):  # int, slice, list or tensor of indices
        return self.images[index], self.labels[index]

    @property
    def in_channels(self) -> int:
        return self.images.shape[1]

    @property
    def image_size(self) -> int:
        return self.images.shape[2]


class TokenDataset(TensorDataset):
    """Samples of a text: ``images`` the input symbols ``(N, T)`` (int64), ``labels`` the next ones ``(N, T)``.

    Args:
        inputs: the symbols of every sample.
        targets: each symbol's successor.
        symbols: the characters the symbol numbers stand for, in order.
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, symbols: str) -> None:
        if inputs.shape != targets.shape or inputs.dim() != 2:
            raise DatasetError(f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} must both be "
                               "(samples, block_size)")
        super().__init__(inputs, targets, num_classes=len(symbols))
        self.symbols = symbols

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    @property
    def block_size(self) -> int:
        return self.images.shape[1]


@dataclass(frozen=True)
class Splits:
    """A dataset's training and test parts."""

    train: TensorDataset
    test: TensorDataset


# ---------------------------------------------------------------- IDX reader


def _read_bytes(path: Path) -> bytes:
    raw = path.read_bytes()
    if not raw.startswith(b"\x1f\x8b"):
        return raw
    try:
        return gzip.decompress(raw)
    except EOFError as e:
        raise DatasetError(
            f"{path}: the gzip stream is truncated ({len(raw)} bytes): download the file again"
        ) from e
    except (gzip.BadGzipFile, zlib.error, OSError) as e:
        raise DatasetError(f"{path}: corrupt gzip data ({e}): download the file again") from e


def read_idx(path: str | Path, expect_magic: int | None = None) -> np.ndarray:
    """Read one IDX file (gzip or raw) into a uint8 array of its declared shape.

    Args:
        path: The file.
        expect_magic: 2051 for images, 2049 for labels; None accepts any uint8 IDX.

    Raises:
        DatasetError: bad magic number, a header or data shorter than declared,
            trailing bytes, or corrupt gzip data.
    """
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4:
        raise DatasetError(f"{path}: {len(data)} bytes is too short for an IDX header")
    (magic,) = struct.unpack(">i", data[:4])
    ndim = data[3]
    if data[:3] != b"\x00\x00\x08" or ndim == 0 or (expect_magic and magic != expect_magic):
        want = f" (expected {expect_magic})" if expect_magic else ""
        raise DatasetError(
            f"{path}: bad magic number {magic}{want}: not an MNIST IDX uint8 file"
        )
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DatasetError(f"{path}: truncated header ({len(data)} bytes, need {header})")
    dims = struct.unpack(f">{ndim}i", data[4:header])
    expected = math.prod(dims)
    got = len(data) - header
    if got < expected:
        raise DatasetError(
            f"{path}: truncated data: header declares {'x'.join(map(str, dims))} = {expected} "
            f"bytes, file holds {got}: download the file again"
        )
    if got > expected:
        raise DatasetError(
            f"{path}: {got - expected} unexpected bytes after the {expected} declared: "
            "the file is corrupt, download it again"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _find(data_dir: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (data_dir / name).is_file():
            return data_dir / name
    return None


def _read_pair(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray]:
    images = read_idx(images_path, _IMAGES_MAGIC)
    labels = read_idx(labels_path, _LABELS_MAGIC)
    if images.ndim != 3:
        raise DatasetError(f"{images_path}: expected 3 dimensions (N, H, W), got {images.shape}")
    if len(images) != len(labels):
        raise DatasetError(
            f"count mismatch: {images_path} holds {len(images)} images but {labels_path} "
            f"holds {len(labels)} labels: use files from the same split"
        )
    if labels.size and labels.max() > 9:
        raise DatasetError(f"{labels_path}: label {int(labels.max())} is outside 0..9")
    return images, labels


def _mnist_tensors(images: np.ndarray, labels: np.ndarray) -> TensorDataset:
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    x = (x - MNIST_MEAN) / MNIST_STD
    return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


def download_mnist(data_dir: str | Path, mirror: str = MNIST_MIRROR) -> None:
    """Fetch the four MNIST files into ``data_dir`` (skipping those present). Needs network."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    for stem in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        if _find(data_dir, stem):
            continue
        target = data_dir / f"{stem}.gz"
        tmp = target.with_suffix(".gz.part")
        try:
            with urllib.request.urlopen(mirror + target.name, timeout=60) as r:
                tmp.write_bytes(r.read())
        except OSError as e:
            raise DatasetError(
                f"could not download {mirror + target.name} ({e}): put the MNIST IDX files in "
                f"{data_dir} by hand"
            ) from e
        tmp.replace(target)


def load_mnist(data_dir: str | Path) -> Splits:
    """MNIST from IDX files in ``data_dir``: the official split, or t10k only -> 8000/2000.

    Raises:
        DatasetError: missing or empty directory, missing files, malformed files.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DatasetError(
            f"--data-dir {str(data_dir)!r} does not exist: point it at a folder holding the "
            "MNIST IDX files (t10k-images-idx3-ubyte.gz, ...), or add --download"
        )
    train = [_find(data_dir, s) for s in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")]
    test = [_find(data_dir, s) for s in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")]
    if not all(test):
        state = "is empty" if not any(data_dir.iterdir()) else "lacks the t10k files"
        raise DatasetError(
            f"--data-dir {str(data_dir)!r} {state}: it needs t10k-images-idx3-ubyte[.gz] and "
            "t10k-labels-idx1-ubyte[.gz] (plus train-*-ubyte[.gz] for the full split), "
            "or add --download"
        )
    test_x, test_y = _read_pair(*test)  # type: ignore[arg-type]
    if all(train):
        train_x, train_y = _read_pair(*train)  # type: ignore[arg-type]
        return Splits(_mnist_tensors(train_x, train_y), _mnist_tensors(test_x, test_y))
    if len(test_x) <= _T10K_TRAIN:
        raise DatasetError(
            f"{test[0]}: only {len(test_x)} images, the t10k-only split needs more than "
            f"{_T10K_TRAIN}"
        )
    return Splits(
        _mnist_tensors(test_x[:_T10K_TRAIN], test_y[:_T10K_TRAIN]),
        _mnist_tensors(test_x[_T10K_TRAIN:], test_y[_T10K_TRAIN:]),
    )


# ---------------------------------------------------------------- digits, synthetic


def _digits_csv() -> Path:
    # The very file sklearn.datasets.load_digits() reads, found without
    # importing scikit-learn (which would cost every worker most of a second).
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise DatasetError("--dataset digits needs scikit-learn: pip install scikit-learn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        raise DatasetError(f"scikit-learn's digits file is missing at {path}: reinstall scikit-learn")
    return path


def load_digits(image_size: int = 28) -> Splits:
    """scikit-learn's 8x8 digits, scaled to ``image_size``, fixed 80/20 split."""
    table = np.loadtxt(_digits_csv(), delimiter=",", dtype=np.float32)
    x = torch.from_numpy(table[:, :64].reshape(-1, 1, 8, 8) / 16.0)
    x = torch.nn.functional.interpolate(
        x, size=(image_size, image_size), mode="bilinear", align_corners=False
    )
    y = torch.from_numpy(table[:, 64].astype(np.int64))
    # A fixed permutation (its own generator, independent of --seed) so every
    # run, rank and world size sees the same split.
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_train = round(0.8 * len(y))
    tr, te = order[:n_train], order[n_train:]
    mean, std = x[tr].mean(), x[tr].std()
    x = (x - mean) / std
    return Splits(TensorDataset(x[tr], y[tr]), TensorDataset(x[te], y[te]))


def load_synthetic(
    samples: int = 2048, shape: Sequence[int] = (1, 28, 28), num_classes: int = 10, seed: int = 0
) -> Splits:
    """Noisy images of ``num_classes`` random patterns: ``samples`` for training, ``samples // 4`` for test.

    Each class has a fixed random pattern; an image is its class's pattern
    plus unit Gaussian noise of the same scale, so a ConvNet learns it within
    an epoch or two while a single step does not.
    """
    if samples < 1:
        raise DatasetError(f"synthetic samples={samples} must be at least 1")
    if len(shape) != 3 or min(shape) < 1 or shape[1] != shape[2]:
        raise DatasetError(f"synthetic shape={tuple(shape)} must be (C, S, S) with positive sizes")
    g = torch.Generator().manual_seed(seed)
    n_test = max(1, samples // 4)
    patterns = torch.randn(num_classes, *shape, generator=g)
    y = torch.randint(0, num_classes, (samples + n_test,), generator=g)
    x = patterns[y] + torch.randn(samples + n_test, *shape, generator=g)
    return Splits(
        TensorDataset(x[:samples], y[:samples], num_classes),
        TensorDataset(x[samples:], y[samples:], num_classes),
    )


SHAKESPEARE_BLOCK = 64
"""Characters of context of a ``shakespeare`` sample (the GPT's ``block_size``)."""


def _shakespeare_file(data_dir: str | Path) -> Path:
    folder = Path(data_dir)
    path = folder if folder.is_file() else folder / "input.txt"
    if not path.is_file():
        raise DatasetError(f"tiny Shakespeare is not at {path}: point --data-dir at the folder of its input.txt "
                           "(e.g. ../shared/data/tinyshakespeare)")
    return path


def load_shakespeare(data_dir: str | Path, block_size: int = SHAKESPEARE_BLOCK) -> Splits:
    """Tiny Shakespeare's characters (see the module notes): 90 % to train on, 10 % to validate on."""
    path = _shakespeare_file(data_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"cannot read {path} as UTF-8 text: {e}") from None
    symbols = "".join(sorted(set(text)))
    cut = int(0.9 * len(text))
    if block_size < 1 or min(cut, len(text) - cut) < block_size + 1:
        raise DatasetError(f"{path} holds {len(text)} characters: too few for samples of {block_size} + 1 in both "
                           "parts (90 % / 10 %)")
    lookup = np.zeros(max(map(ord, symbols)) + 1, dtype=np.int64)
    lookup[[ord(c) for c in symbols]] = np.arange(len(symbols))
    codes = torch.from_numpy(lookup[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)])

    def samples(part: torch.Tensor) -> TokenDataset:
        n = (len(part) - 1) // block_size
        return TokenDataset(part[: n * block_size].view(n, block_size).clone(),
                            part[1 : n * block_size + 1].view(n, block_size).clone(), symbols)

    return Splits(samples(codes[:cut]), samples(codes[cut:]))


def source_files(name: str, data_dir: str | Path | None) -> list[Path]:
    """The files a data set is read from (none for ``synthetic``, made from its settings)."""
    if name == "digits":
        return [_digits_csv()]
    if name == "mnist" and data_dir is not None:
        stems = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte")
        return [f for f in (_find(Path(data_dir), s) for s in stems) if f is not None]
    if name == "shakespeare" and data_dir is not None:
        return [_shakespeare_file(data_dir)]
    return []


def fingerprint(name: str, data_dir: str | Path | None) -> str:
    """A digest of a data set's source files (their names and bytes): the same data under another path has the
    same fingerprint, other data has another."""
    digest = hashlib.blake2b(name.encode(), digest_size=16)
    for path in source_files(name, data_dir):
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def load_dataset(
    name: str,
    *,
    data_dir: str | Path | None = None,
    download: bool = False,
    synthetic_samples: int = 2048,
    synthetic_shape: Sequence[int] = (1, 28, 28),
    train_samples: int | None = None,
    test_samples: int | None = None,
) -> Splits:
    """Load a dataset by name.

    Args:
        name: ``digits``, ``mnist``, ``synthetic`` or ``shakespeare``.
        data_dir: Folder of the MNIST IDX files (``mnist``) or of tiny Shakespeare's ``input.txt``
            (``shakespeare``); required by both.
        download: Fetch missing MNIST files into ``data_dir`` first (needs network).
        synthetic_samples: Training samples of ``synthetic`` (test: a quarter of it).
        synthetic_shape: ``(C, S, S)`` of ``synthetic`` images.
        train_samples: keep only the first this many training samples (default all).
        test_samples: keep only the first this many test samples (default all).

    Raises:
        DatasetError: unknown name, missing ``data_dir``, unreadable files.

    Example:
        >>> splits = load_dataset("digits")
        >>> len(splits.train), len(splits.test)
        (1438, 359)
    """
    splits = _load(name, data_dir, download, synthetic_samples, synthetic_shape)
    for limit, what in ((train_samples, "train_samples"), (test_samples, "test_samples")):
        if limit is not None and limit < 1:
            raise DatasetError(f"{what}={limit} must be at least 1")
    return Splits(_first(splits.train, train_samples), _first(splits.test, test_samples))


def _first(part: TensorDataset, limit: int | None) -> TensorDataset:
    """``part``'s first ``limit`` samples (all of them when None or more)."""
    if limit is None or limit >= len(part):
        return part
    if isinstance(part, TokenDataset):
        return TokenDataset(part.images[:limit], part.labels[:limit], part.symbols)
    return TensorDataset(part.images[:limit], part.labels[:limit], part.num_classes)


def _load(name: str, data_dir: str | Path | None, download: bool, synthetic_samples: int,
          synthetic_shape: Sequence[int]) -> Splits:
    if name == "digits":
        return load_digits()
    if name == "synthetic":
        return load_synthetic(synthetic_samples, synthetic_shape)
    if name == "shakespeare":
        if data_dir is None:
            raise DatasetError("--dataset shakespeare needs --data-dir: the folder of tiny Shakespeare's input.txt "
                               "(e.g. ../shared/data/tinyshakespeare)")
        return load_shakespeare(data_dir)
    if name == "mnist":
        if data_dir is None:
            raise DatasetError(
                "--dataset mnist needs --data-dir: a folder holding the MNIST IDX files "
                "(e.g. ../shared/data/mnist)"
            )
        if download:
            download_mnist(data_dir)
        return load_mnist(data_dir)
    raise DatasetError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")

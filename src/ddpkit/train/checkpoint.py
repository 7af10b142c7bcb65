"""Checkpoints: atomic save on rank 0, safe load, state dicts with or without ``module.``.

File format: one `safetensors <https://github.com/huggingface/safetensors>`_
file. Every tensor of the (nested) state is a safetensors entry; everything
else (dicts, lists, tuples, ints, floats, bools, strings, None) is a JSON
skeleton stored in the file's metadata under ``"ddpkit"``, where each tensor
appears as ``{"__tensor__": name}`` (tensors that share memory as views of one
stored span: :mod:`ddpkit.train.encoding`). Loading therefore never unpickles
anything: a checkpoint cannot execute code. Files written by ``torch.save``
are read with ``torch.load(weights_only=True)``, which refuses arbitrary objects.

Saving (:func:`save_checkpoint`) is collective when a process group exists:
every rank calls it, rank 0 writes the file to a temporary name beside the
target, fsyncs it, renames it over the target and fsyncs the folder, and then
all ranks meet (one all-reduce that also carries rank 0's success), so every
rank returns only once the file is on disk, and a failed write raises on
every rank instead of leaving the others waiting, with one message naming
the file and the cause (no space left, a read-only file system, a folder
removed, ...). A crash at any point leaves either the old file or the new
one, never a torn one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from ddpkit.runtime.devices import comm_tensor
from ddpkit.runtime.durable import (
    CheckpointError,
    describe_write_error,
    digest,
    one_line,
    remove_stale_temporaries,
    tensor_digest,
    write_atomic,
)
from ddpkit.train.encoding import decode, encode_state

__all__ = [
    "CheckpointError",
    "load_checkpoint",
    "load_model_state",
    "save_checkpoint",
    "save_json",
    "save_weights",
    "strip_prefix",
]

_META_KEY = "ddpkit"
_SUM_KEY = "ddpkit_checksums"
_FORMAT = 3
"""1: tensors and skeleton. 2: plus checksums of every tensor and of the skeleton."""


def _checksums(meta: str | None, tensors: Mapping[str, torch.Tensor]) -> str:
    sums = {name: tensor_digest(t) for name, t in tensors.items()}
    return json.dumps({"skeleton": digest(meta.encode()) if meta is not None else None, "tensors": sums})


def _to_bytes(state: Any) -> bytes:
    skeleton, tensors, views = encode_state(state)
    # Format 3 only where tensors share memory (views), so that other files stay readable by format-2 readers.
    meta = json.dumps({"format": _FORMAT if views else 2, "state": skeleton}, allow_nan=True)
    return _st_save(tensors, metadata={_META_KEY: meta, _SUM_KEY: _checksums(meta, tensors)})


def _verify(path: Path, meta: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> None:
    """Check the stored checksums; a file without any (format 1, foreign) passes as it is."""
    if _SUM_KEY not in meta:
        if _META_KEY in meta:
            skeleton = json.loads(meta[_META_KEY])
            version = skeleton.get("format", 1) if isinstance(skeleton, dict) else None
            if isinstance(version, int) and 2 <= version <= _FORMAT:
                raise CheckpointError(f"checkpoint {path} is damaged: its checksums are missing")
        return
    try:
        stored = json.loads(meta[_SUM_KEY])
        sums, skeleton = dict(stored["tensors"]), stored["skeleton"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {path} is damaged: unreadable checksums ({one_line(e)})") from e
    if skeleton is not None and digest(meta.get(_META_KEY, "").encode()) != skeleton:
        raise CheckpointError(
            f"checkpoint {path} is damaged: its metadata (step, settings, structure) does not match "
            "its checksum"
        )
    if set(sums) != set(tensors):
        raise CheckpointError(
            f"checkpoint {path} is damaged: it holds {len(tensors)} tensors, its checksums name {len(sums)}"
        )
    for name, t in tensors.items():
        if tensor_digest(t) != sums[name]:
            shown = name.split(":", 1)[-1] or name
            raise CheckpointError(
                f"checkpoint {path} is damaged: tensor {shown!r} does not match its checksum "
                "(its bytes changed after it was written)"
            )


def _collective_write(path: str | os.PathLike, make_bytes, within: str | os.PathLike | None = None) -> None:
    """Rank 0 writes ``make_bytes()`` to ``path`` (atomically); every rank returns once it is on disk, or raises.

    ``within``: a folder that must still exist (a run directory): when it is gone, the write fails (``gone``)
    instead of creating it again.
    """
    path = Path(path)
    group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    is_writer = not group or dist.get_rank() == 0
    error: BaseException | None = None
    if is_writer:
        try:
            if within is not None and not Path(within).is_dir():
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(within))
            write_atomic(path, make_bytes())
        except BaseException as e:  # noqa: BLE001 - reported to every rank below
            error = e
    failed = error is not None
    if group:
        # Reached by every rank whatever happened on rank 0: it is the barrier
        # that says "on disk", and it carries rank 0's success so that a failed
        # write raises everywhere instead of hanging the other ranks.
        ok = comm_tensor([0 if failed else 1], torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        failed = ok.item() == 0
        if failed:
            # Only on failure, on every rank: rank 0's cause, so every rank raises the same error.
            cause = [(describe_write_error(error), _gone(error)) if error is not None else None]
            dist.broadcast_object_list(cause, src=0)
            text, gone = cause[0]
            raise CheckpointError(f"could not write {path}: {text}", gone=gone) from error
    if error is not None:
        raise CheckpointError(f"could not write {path}: {describe_write_error(error)}", gone=_gone(error)) from error


def _gone(error: BaseException | None) -> bool:
    return isinstance(error, OSError) and error.errno == errno.ENOENT


def save_checkpoint(path: str | os.PathLike, state: Any, *, within: str | os.PathLike | None = None) -> None:
    """Write ``state`` to ``path`` atomically from rank 0; every rank returns once it is on disk.

    Every rank must call it (it holds one collective); only rank 0's ``state``
    is written, so the others may pass the same object or anything else.

    Args:
        path: Target file; its folder is created if needed.
        state: Nested dicts/lists/tuples of tensors, numpy arrays and plain data.

    Raises:
        CheckpointError: on every rank, when rank 0 could not write the file:
            ``state`` holds an object that is not plain data (the original
            ``TypeError`` is chained on rank 0), or the disk refused the write
            (the message names the file and the cause). With ``within`` (a
            folder that must exist), its ``gone`` says that folder was removed.

    Example::

        ddpkit.save_checkpoint("run/ckpt.safetensors",
                               {"model": ddpkit.unwrap(model).state_dict(),
                                "optimizer": optimizer.state_dict(), "epoch": epoch})
    """
    _collective_write(path, lambda: _to_bytes(state), within)


def save_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` from rank 0, atomically; a collective, raising on every rank on failure."""
    _collective_write(path, lambda: (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def save_weights(path: str | os.PathLike, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Write a flat ``name -> tensor`` state dict as plain safetensors (rank 0, atomic, collective).

    The file loads with ``safetensors.torch.load_file`` anywhere; ``module.``
    prefixes are stripped so names are the plain module's.
    """

    def make() -> bytes:
        flat = {
            k: v.detach().to("cpu", copy=True).contiguous()
            for k, v in strip_prefix(state_dict).items()
        }
        return _st_save(flat, metadata={_SUM_KEY: _checksums(None, flat)})

    _collective_write(path, make)


# ---------------------------------------------------------------- load


def _safetensors_metadata(data: bytes, path: Path) -> dict[str, str]:
    if len(data) < 8:
        raise CheckpointError(f"checkpoint {path} is truncated ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CheckpointError(
            f"checkpoint {path} is truncated or not a safetensors file "
            f"(header of {n} bytes, file of {len(data)})"
        )
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: unreadable header ({one_line(e)})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint {path} is corrupt: header is not a JSON object")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"checkpoint {path} is corrupt: its metadata is not a map of strings")
    return meta


def _device(where: Any) -> torch.device:
    """``where`` (a str or torch.device) as a device this machine has; ValueError naming it and the fix otherwise."""
    try:
        device = torch.device(where)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"map_location={where!r} is not a device ({e}): pass 'cpu', 'cuda', 'cuda:1', ...") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"map_location={where!r}: this machine has no CUDA device (torch.cuda.is_available() is "
                         "False): load with map_location='cpu'")
    return device


def _check_map_location(map_location: Any) -> None:
    """torch.load's forms: None, a device (str or torch.device), a dict of saved to new locations, a callable."""
    if map_location is None or callable(map_location) or isinstance(map_location, Mapping):
        return  # a dict's entry for the saved location is checked where it is used
    if isinstance(map_location, (str, torch.device)):
        _device(map_location)
    else:
        raise TypeError(f"map_location={map_location!r}: pass a device ('cpu', 'cuda:0', a torch.device), a dict "
                        "of saved to new locations ({'cuda:1': 'cuda:0'}) or a callable (storage, location), as "
                        "for torch.load")


def _placed(tensors: dict[str, torch.Tensor], map_location: Any) -> dict[str, torch.Tensor]:
    """The loaded tensors (saved from the CPU: location ``"cpu"``) where ``map_location`` puts them, as torch.load."""
    if callable(map_location):
        placed = {}
        for name, t in tensors.items():
            storage = map_location(t.untyped_storage(), "cpu")
            if storage is None:
                placed[name] = t
            elif isinstance(storage, (torch.UntypedStorage, torch.TypedStorage)):
                storage = storage.untyped() if isinstance(storage, torch.TypedStorage) else storage
                placed[name] = torch.empty(0, dtype=t.dtype, device=storage.device).set_(
                    storage, t.storage_offset(), t.shape, t.stride())
            else:
                raise TypeError(f"map_location returned {type(storage).__name__} for tensor {name!r}: it must return "
                                "a storage (or None to keep the tensor on the CPU), as for torch.load")
        return placed
    if isinstance(map_location, Mapping):
        map_location = map_location.get("cpu")
    if map_location is None or _device(map_location).type == "cpu":
        return tensors
    return {k: v.to(map_location) for k, v in tensors.items()}


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """Read a checkpoint written by :func:`save_checkpoint` (or a ``torch.save`` of tensors).

    Never unpickles arbitrary objects: safetensors plus a JSON skeleton, or
    ``torch.load(weights_only=True)`` for ``torch.save`` files. A plain
    safetensors file (e.g. ``model.safetensors``) loads as a flat dict.

    Args:
        path: The file.
        map_location: Where the tensors go, as for ``torch.load`` (default
            ``"cpu"``): a device (``"cuda:0"``, a ``torch.device``), a dict of
            saved to new locations (a checkpoint's tensors are saved from the
            CPU: ``{"cpu": "cuda:0"}``), or a callable ``(storage, location)``
            that returns the storage to use (or None).

    Every tensor and the structure are checked against the checksums stored
    at save time (files of format 2 or later and ``model.safetensors``), so a file
    whose bytes changed on disk is refused rather than trained on. Stale
    temporaries of interrupted saves beside it are removed.

    Raises:
        FileNotFoundError: no such file (IsADirectoryError: a folder).
        ValueError, TypeError: ``map_location`` is not a device this machine
            has, or not one of the forms above.
        CheckpointError: the file is truncated, damaged (a checksum does not
            match; the message names the tensor) or not a checkpoint.
    """
    path = Path(path)
    remove_stale_temporaries(path.parent)
    if path.is_dir():
        raise IsADirectoryError(f"checkpoint {path} is a folder: pass a checkpoint file in it (TrainState.restore "
                                "takes a folder and reads its newest valid checkpoint)")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    data = path.read_bytes()
    # A safetensors file starts with its header's length (8 bytes, whose first
    # may be any value, 0x80 included) and then the JSON header's "{"; a
    # torch.save file is a zip ("PK") or, in the legacy format, a pickle (0x80).
    looks_safetensors = data[8:9] == b"{"
    _check_map_location(map_location)
    if not looks_safetensors and (data[:2] == b"PK" or data[:1] == b"\x80"):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:  # what weights_only refuses: objects other than tensors and plain data
            raise CheckpointError(
                f"checkpoint {path} is a torch.save file that cannot be loaded safely "
                f"(weights_only=True): {e}"
            ) from e
        except Exception as e:  # a damaged file, or a location torch.load cannot place
            raise CheckpointError(f"checkpoint {path} is a torch.save file that torch.load cannot read: {e}") from e
    meta = _safetensors_metadata(data, path)
    try:
        tensors = _st_load(data)
    except SafetensorError as e:
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated: {one_line(e)}") from e
    with _as_corrupt(path):
        _verify(path, meta, tensors)
        skeleton = _skeleton(path, meta) if _META_KEY in meta else None
    tensors = _placed(tensors, map_location)
    if skeleton is None:
        return tensors
    with _as_corrupt(path):  # RuntimeError: a sparse tensor's indices out of it, a view out of its bytes
        return decode(skeleton["state"], tensors)


def _skeleton(path: Path, meta: Mapping[str, str]) -> dict[str, Any]:
    """The skeleton a file's metadata holds, its format checked."""
    skeleton = json.loads(meta[_META_KEY])
    if not isinstance(skeleton, dict) or "state" not in skeleton:
        raise CheckpointError(f"checkpoint {path} is corrupt: its skeleton is not a ddpkit checkpoint's")
    version = skeleton.get("format")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(f"checkpoint {path} is corrupt: its format is {version!r}, not a number")
    if version > _FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {version!r}, newer than this ddpkit reads ({_FORMAT}): "
            "load it with the ddpkit version that wrote it"
        )
    return skeleton


@contextlib.contextmanager
def _as_corrupt(path: Path) -> Iterator[None]:
    """Whatever reading a damaged or foreign file raises, as a :class:`CheckpointError` of one line: so that a
    resume falls back past it to the previous good checkpoint, as for any other damage."""
    try:
        yield
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError) as e:  # RecursionError too
        raise CheckpointError(f"checkpoint {path} is corrupt: bad skeleton ({type(e).__name__}: {one_line(e)})") from e


# ---------------------------------------------------------------- module. prefixes


def strip_prefix(state_dict: Mapping[str, Any], prefix: str = "module.") -> dict[str, Any]:
    """Return ``state_dict`` with ``prefix`` removed from every key that starts with it."""
    return {k.removeprefix(prefix): v for k, v in state_dict.items()}


def load_model_state(
    model: torch.nn.Module, state_dict: Mapping[str, Any], strict: bool = True, wants_prefix: bool | None = None,
) -> Any:
    """``model.load_state_dict`` that accepts keys with or without a ``module.`` prefix.

    Works whether ``model`` is a plain module or a DDP/DataParallel wrapper
    (whose own keys carry ``module.``) and whichever way ``state_dict`` was saved.
    ``wants_prefix``: whether ``model``'s own keys carry ``module.`` (``None``: read from its state dict).

    Returns:
        What ``load_state_dict`` returns (missing and unexpected keys).
    """
    plain = strip_prefix(state_dict)
    if wants_prefix is None:
        wants_prefix = any(k.startswith("module.") for k in model.state_dict())
    if wants_prefix:
        plain = {f"module.{k}": v for k, v in plain.items()}
    return model.load_state_dict(plain, strict=strict)

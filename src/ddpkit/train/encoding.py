"""A checkpoint's content: any nested state as named tensors plus a JSON skeleton that says where each goes.

Every tensor (and NumPy array) of the state becomes a named entry of the
safetensors file; everything else (dicts, with str or int keys, lists, tuples,
ints, floats, bools, strings, None, dtypes) is the skeleton, where a tensor
appears as ``{"__tensor__": name}``. A sparse COO tensor is its indices and
values, and comes back sparse (coalesced or not), as from ``torch.save``.
As there too, an ``nn.Parameter`` comes back a Parameter and a tensor that
requires grad comes back requiring it (a sparse one does not, as in torch),
and tensors that share memory (tied weights, views of one tensor) are
stored once and come back sharing it: the bytes they span are one entry,
each tensor ``{"__view__": entry, "dtype", "offset", "size", "stride"}`` on
it. Where ``torch.save`` writes the whole storage, only the span the tensors
cover is written. Nothing is ever unpickled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["CheckpointError", "decode", "encode", "encode_state"]


class CheckpointError(ValueError):
    """A checkpoint cannot be read (corrupt, truncated, not a checkpoint) or written.

    ``gone`` is True when the folder it was to be written in no longer exists (removed while the run was going on).
    """

    def __init__(self, message: str, gone: bool = False) -> None:
        super().__init__(message)
        self.gone = gone


def encode_state(state: Any) -> tuple[Any, dict[str, torch.Tensor], bool]:
    """``state``'s skeleton, its named tensors, and whether some of them share memory (stored as views).

    Raises:
        TypeError: as :func:`encode`.
    """
    tensors: dict[str, torch.Tensor] = {}
    storages: dict[tuple, list[tuple[dict, torch.Tensor]]] = {}
    skeleton = encode(state, tensors, "", storages)
    shared = [group for group in storages.values() if len(group) > 1]
    for k, group in enumerate(shared):
        _store_once(group, tensors, k)
    return skeleton, tensors, bool(shared)


def _store_once(group: list[tuple[dict, torch.Tensor]], tensors: dict[str, torch.Tensor], k: int) -> None:
    """Turn the entries of tensors that share one storage into views of one stored span of its bytes."""
    starts = [t.storage_offset() * t.element_size() for _, t in group]
    ends = [(t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
            for _, t in group]
    low = min(starts) // 16 * 16  # every element size divides 16: each view's offset stays whole
    base = group[0][1]
    raw = torch.empty(0, dtype=torch.uint8, device=base.device).set_(base.untyped_storage())
    name = f"shared{k}:{group[0][0]['__tensor__'].split(':', 1)[1]}"
    tensors[name] = raw[low:max(ends)].to("cpu", copy=True)
    for (entry, t), start in zip(group, starts):
        del tensors[entry.pop("__tensor__")]
        entry.update({"__view__": name, "dtype": str(t.dtype).removeprefix("torch."),
                      "offset": (start - low) // t.element_size(), "size": list(t.shape), "stride": list(t.stride())})


def encode(obj: Any, tensors: dict[str, torch.Tensor], path: str, storages: dict | None = None) -> Any:
    """``obj``'s skeleton; its tensors are added to ``tensors`` (detached CPU copies), each named after its place
    ``path`` in the state. With ``storages``, each strided tensor that holds memory is also listed there under its
    storage, with its entry in the skeleton (:func:`encode_state` stores those that share one once).

    Raises:
        TypeError: an object a checkpoint does not hold (naming its place), a sparse layout other than COO.
    """
    if isinstance(obj, torch.Tensor) and obj.layout == torch.sparse_coo:
        # A sparse tensor is stored as its indices and values, and comes back sparse (coalesced or not), as
        # torch.save's does.
        sparse = obj.detach()
        return {"__sparse_coo__": [encode(sparse._indices(), tensors, f"{path}/indices", storages),
                                   encode(sparse._values(), tensors, f"{path}/values", storages), list(obj.shape),
                                   sparse.is_coalesced()]}
    if isinstance(obj, torch.Tensor) and obj.layout != torch.strided:
        raise TypeError(f"cannot checkpoint a {obj.layout} tensor at {path or '<root>'}: convert it first "
                        "(t.to_dense(), or t.to_sparse() for the COO layout, which checkpoints keep)")
    if isinstance(obj, torch.Tensor):
        name = f"{len(tensors)}:{path}"
        # clone(): safetensors refuses tensors that share storage (tied weights, views).
        tensors[name] = obj.detach().to("cpu", copy=True).contiguous()
        if isinstance(obj, torch.nn.Parameter):
            entry = {"__tensor__": name, "parameter": obj.requires_grad}
        else:
            entry = {"__tensor__": name, "requires_grad": True} if obj.requires_grad else {"__tensor__": name}
        # A conjugate or negative view reads its storage through a flag a view of the bytes would drop: stored alone.
        if storages is not None and obj.numel() and obj.device.type != "meta" and not (obj.is_conj() or obj.is_neg()):
            storage = obj.untyped_storage()
            storages.setdefault((obj.device, storage.data_ptr()), []).append((entry, obj.detach()))
        return entry
    if isinstance(obj, np.ndarray):
        name = f"{len(tensors)}:{path}"
        tensors[name] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"__ndarray__": name}
    if isinstance(obj, Mapping):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"checkpoint dict key {k!r} at {path or '<root>'} must be str or int")
            items.append([k, encode(v, tensors, f"{path}/{k}", storages)])
        return {"__dict__": items}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, tensors, f"{path}/{i}", storages) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, tensors, f"{path}/{i}", storages) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    raise TypeError(
        f"cannot checkpoint {type(obj).__name__} at {path or '<root>'}: a checkpoint holds "
        "tensors, arrays and plain data (dict, list, tuple, str, int, float, bool, None)"
    )


def decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state ``encode`` made the skeleton ``obj`` of, its tensors taken from ``tensors``.

    Raises:
        CheckpointError: a skeleton that is not one (an unknown dtype or entry).
    """
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj or "__view__" in obj:
            tensor = tensors[obj["__tensor__"]] if "__tensor__" in obj else _view(obj, tensors)
            if "parameter" in obj:
                return torch.nn.Parameter(tensor, requires_grad=bool(obj["parameter"]))
            return tensor.requires_grad_() if obj.get("requires_grad") else tensor
        if "__sparse_coo__" in obj:
            # Checked: indices out of the shape (a damaged or crafted file) raise here instead of crashing later.
            indices, values, shape, coalesced = obj["__sparse_coo__"]
            indices, values = decode(indices, tensors), decode(values, tensors)
            return torch.sparse_coo_tensor(indices, values, shape, is_coalesced=coalesced,
                                           check_invariants=indices.device.type != "meta")  # meta holds no data
        if "__ndarray__" in obj:
            return tensors[obj["__ndarray__"]].numpy()
        if "__dict__" in obj:
            return {k: decode(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(decode(v, tensors) for v in obj["__tuple__"])
        if "__dtype__" in obj:
            dtype = getattr(torch, obj["__dtype__"], None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"unknown dtype {obj['__dtype__']!r} in checkpoint")
            return dtype
        raise CheckpointError(f"unexpected object {sorted(obj)} in checkpoint skeleton")
    return obj


def _view(entry: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A tensor stored as a view of a shared span: every view of one span shares its memory, as after torch.load."""
    span = tensors[entry["__view__"]]
    dtype = getattr(torch, entry["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {entry['dtype']!r} in checkpoint")
    # Out-of-range offsets or sizes (a damaged or crafted file) raise a RuntimeError here, reported as corrupt.
    return torch.empty(0, dtype=dtype, device=span.device).set_(span.untyped_storage(), entry["offset"],
                                                                entry["size"], entry["stride"])

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
it (a lone tensor laid out densely in another order, such as channels_last,
is stored so too and keeps its strides). Where ``torch.save`` writes the
whole storage, only the span the tensors cover is written. Nothing is ever
unpickled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ddpkit.runtime.durable import CheckpointError

__all__ = ["DTYPES", "CheckpointError", "decode", "encode", "encode_state"]

DTYPES = frozenset(d for d in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None),
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
) if d is not None)
"""What a checkpoint holds: plain numbers safetensors stores (quantized and bit-packed types, whose meaning lies
outside their bytes, are refused when saved and when read)."""


def encode_state(state: Any) -> tuple[Any, dict[str, torch.Tensor], bool]:
    """``state``'s skeleton, its named tensors (detached CPU copies), and whether some share memory (views).

    Raises:
        TypeError: an object a checkpoint does not hold (naming its place), a sparse layout other than COO.
    """
    found: list[tuple[str, dict, torch.Tensor]] = []
    skeleton = encode(state, found, "")
    groups: dict[Any, list[tuple[str, dict, torch.Tensor]]] = {}
    for name, entry, t in found:
        groups.setdefault(_storage(entry, t) or name, []).append((name, entry, t))
    tensors: dict[str, torch.Tensor] = {}
    views = False
    for k, group in enumerate(groups.values()):
        name, entry, t = group[0]
        # A lone tensor laid out densely but not in row-major order (channels_last, a transpose) keeps its strides,
        # as torch.save keeps them; any other is copied (safetensors refuses tensors that share storage).
        if len(group) > 1 or ("__tensor__" in entry and not t.is_contiguous() and _dense(t)):
            _store_once(group, tensors, k)
            views = True
        else:
            tensors[name] = t.to("cpu", copy=True).contiguous()
    return skeleton, tensors, views


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a span of memory without gaps or overlaps, in whatever order of dimensions."""
    covered = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != covered:
            return False
        covered *= size
    return True


def _storage(entry: dict, t: torch.Tensor) -> tuple | None:
    """The memory the tensor of ``entry`` reads, as a key; None where it is to be stored alone.

    A conjugate or negative view reads its storage through a flag that a view of the bytes would drop.
    """
    if "__tensor__" not in entry or t.numel() == 0 or t.device.type == "meta" or t.is_conj() or t.is_neg():
        return None
    # The storage itself, not its address: two storages may start at one address and span different lengths
    # (tensors made from overlapping NumPy arrays), and a view of the shorter could not hold the longer.
    storage = t.untyped_storage()
    return t.device, storage.data_ptr(), storage.nbytes()


def _store_once(group: list[tuple[str, dict, torch.Tensor]], tensors: dict[str, torch.Tensor], k: int) -> None:
    """Store the tensors that share one storage as views of one span of its bytes: the span they cover."""
    starts = [t.storage_offset() * t.element_size() for _, _, t in group]
    ends = [(t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
            for _, _, t in group]
    low = min(starts) // 16 * 16  # every element size divides 16: each view's offset stays whole
    base = group[0][2]
    raw = torch.empty(0, dtype=torch.uint8, device=base.device).set_(base.untyped_storage())
    name = f"shared{k}:{group[0][0].split(':', 1)[1]}"
    tensors[name] = raw[low:max(ends)].to("cpu", copy=True)
    for (_, entry, t), start in zip(group, starts):
        del entry["__tensor__"]
        entry.update({"__view__": name, "dtype": str(t.dtype).removeprefix("torch."),
                      "offset": (start - low) // t.element_size(), "size": list(t.shape), "stride": list(t.stride())})


def encode(obj: Any, found: list[tuple[str, dict, torch.Tensor]], path: str) -> Any:
    """``obj``'s skeleton; each tensor's name (after its place ``path`` in the state), entry in the skeleton and
    the tensor itself (detached) are added to ``found``, from which :func:`encode_state` makes the stored tensors.

    Raises:
        TypeError: an object a checkpoint does not hold (naming its place), a sparse layout other than COO.
    """
    if isinstance(obj, torch.Tensor) and obj.layout == torch.sparse_coo:
        # A sparse tensor is stored as its indices and values, and comes back sparse (coalesced or not), as
        # torch.save's does.
        sparse = obj.detach()
        return {"__sparse_coo__": [encode(sparse._indices(), found, f"{path}/indices"),
                                   encode(sparse._values(), found, f"{path}/values"), list(obj.shape),
                                   sparse.is_coalesced()]}
    if isinstance(obj, torch.Tensor) and obj.layout != torch.strided:
        raise TypeError(f"cannot checkpoint a {obj.layout} tensor at {path or '<root>'}: convert it first "
                        "(t.to_dense(), or t.to_sparse() for the COO layout, which checkpoints keep)")
    if isinstance(obj, torch.Tensor) and obj.dtype not in DTYPES:
        raise TypeError(f"cannot checkpoint a {str(obj.dtype).removeprefix('torch.')} tensor at {path or '<root>'}: "
                        "a checkpoint holds plain numbers; store t.dequantize() (and its scale and zero point)"
                        if obj.is_quantized else
                        f"cannot checkpoint a {obj.dtype} tensor at {path or '<root>'}: convert it to one of "
                        f"{', '.join(sorted(str(d).removeprefix('torch.') for d in DTYPES))}")
    if isinstance(obj, torch.Tensor):
        name = f"{len(found)}:{path}"
        if isinstance(obj, torch.nn.Parameter):
            entry = {"__tensor__": name, "parameter": obj.requires_grad}
        else:
            entry = {"__tensor__": name, "requires_grad": True} if obj.requires_grad else {"__tensor__": name}
        found.append((name, entry, obj.detach()))
        return entry
    if isinstance(obj, np.ndarray):
        name = f"{len(found)}:{path}"
        found.append((name, {"__ndarray__": name}, torch.from_numpy(np.ascontiguousarray(obj).copy())))
        return found[-1][1]
    if isinstance(obj, Mapping):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"checkpoint dict key {k!r} at {path or '<root>'} must be str or int")
            items.append([k, encode(v, found, f"{path}/{k}")])
        return {"__dict__": items}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, found, f"{path}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, found, f"{path}/{i}") for i, v in enumerate(obj)]
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
            return _dtype(obj["__dtype__"])
        raise CheckpointError(f"unexpected object {sorted(obj)} in checkpoint skeleton")
    return obj


def _view(entry: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A tensor stored as a view of a shared span: every view of one span shares its memory, as after torch.load."""
    span = tensors[entry["__view__"]]
    dtype = _dtype(entry["dtype"])
    # Out-of-range offsets or sizes (a damaged or crafted file) raise a RuntimeError here, reported as corrupt.
    return torch.empty(0, dtype=dtype, device=span.device).set_(span.untyped_storage(), entry["offset"],
                                                                entry["size"], entry["stride"])


def _dtype(name: Any) -> torch.dtype:
    """The dtype a skeleton names (``"float32"``); CheckpointError for any name not of :data:`DTYPES`."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint: it holds only "
                              f"{', '.join(sorted(str(d).removeprefix('torch.') for d in DTYPES))}")
    return dtype

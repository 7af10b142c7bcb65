"""Inputs split across devices and outputs joined back: DataParallel's scatter and gather, and DDP's helpers.

Nested structures (tuples, lists, namedtuples, dicts) are walked; tensors are
cut along ``dim`` (scatter) or concatenated along it (gather), as torch's
``scatter_kwargs`` and ``gather`` do.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["gather", "padded", "scatter", "to_device"]


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it moved to ``device`` (non-blocking), the nesting kept."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_device(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device)) for k, v in obj.items())
    return obj


def padded(inputs: list[Any], kwargs: list[Any]) -> tuple[tuple, tuple]:
    """Per-device inputs and kwargs of equal length, ``()`` and ``{}`` filling in (torch's scatter_kwargs)."""
    n = max(len(inputs), len(kwargs))
    return tuple(inputs) + ((),) * (n - len(inputs)), tuple(kwargs) + ({},) * (n - len(kwargs))


def scatter(obj: Any, devices: Sequence[torch.device], dim: int) -> list[Any]:
    """One piece of ``obj`` per device, cut along ``dim`` (``torch.chunk``'s sizes); the shortest split decides
    how many there are. Tensors inside tuples, lists, namedtuples and dicts are cut too; anything else is
    given to every device as it is."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.shape[dim] == 0:
            raise ValueError(
                f"DataParallel got an input of shape {tuple(obj.shape)} with nothing to split along dim={dim}: "
                "pass a non-empty batch (or call the module itself for a single sample)"
            )
        return [chunk.to(device) for chunk, device in zip(obj.chunk(len(devices), dim), devices)]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return [type(obj)(*parts) for parts in zip(*(scatter(v, devices, dim) for v in obj))]
    if isinstance(obj, (list, tuple)) and obj:
        return [type(obj)(parts) for parts in zip(*(scatter(v, devices, dim) for v in obj))]
    if isinstance(obj, Mapping) and obj:
        keys = list(obj)
        return [type(obj)(zip(keys, parts)) for parts in zip(*(scatter(obj[k], devices, dim) for k in keys))]
    return [obj for _ in devices]


def gather(outputs: list[Any], device: torch.device, dim: int) -> Any:
    """The replicas' ``outputs`` joined along ``dim`` on ``device``, the nesting kept (scalars stacked, with torch's
    warning). Dataclasses are joined field by field.

    Raises:
        TypeError: a value of any other type (an int, a string, an object), which no concatenation joins (torch's
            gather raises, or builds the type from a ``map`` object); replica 0's value alone would drop the
            others' part of the batch.
    """
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if dim == 0 and all(o.dim() == 0 for o in outputs):  # (torch's condition)
            # Scalars (a loss per replica) become a vector, one entry per replica.
            warnings.warn("Was asked to gather along dimension 0, but all input tensors were scalars; will instead "
                          "unsqueeze and return a vector.", stacklevel=2)
            return torch.stack([o.to(device) for o in outputs])
        return torch.cat([o.to(device) for o in outputs], dim)
    if first is None:
        return None
    if isinstance(first, Mapping):
        return type(first)((k, gather([o[k] for o in outputs], device, dim)) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(gather(list(parts), device, dim) for parts in zip(*outputs)))
    if isinstance(first, (list, tuple)):
        return type(first)(gather(list(parts), device, dim) for parts in zip(*outputs))
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        joined = {f.name: gather([getattr(o, f.name) for o in outputs], device, dim)
                  for f in dataclasses.fields(first) if f.init}
        return dataclasses.replace(first, **joined)
    raise TypeError(
        f"DataParallel: the replicas returned {type(first).__name__} values "
        f"({', '.join(map(repr, outputs[:4]))[:200]}), "
        "which cannot be joined across devices: return tensors, None, or tuples, lists, dicts, namedtuples and "
        "dataclasses of them (a number as torch.tensor(value))"
    )

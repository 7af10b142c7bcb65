"""Inputs split across devices and outputs joined back: DataParallel's scatter and gather, and DDP's helpers.

Nested structures (tuples, lists, namedtuples, dicts) are walked; tensors are
cut along ``dim`` (scatter) or concatenated along it (gather), as torch's
``scatter_kwargs`` and ``gather`` do.
"""

from __future__ import annotations

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
    """The replicas' ``outputs`` joined along ``dim`` on ``device``, the nesting kept (scalars stacked)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            # Scalars (a loss per replica) become a vector, one entry per replica.
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
    return first

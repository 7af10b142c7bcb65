"""The tensors in what a module takes and gives (any structure torch's pytree handles, and dataclasses, as
FSDP2 finds them): stage 3 casts a unit's floating inputs to the compute dtype and hooks the outputs that need a
gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["cast_floats", "tensors_in"]


def _flatten(value: Any) -> tuple[list[Any], Any]:
    """``value``'s leaves as torch's pytree sees them, and dataclasses' fields too (as torch's DDP finds the
    tensors in an output)."""
    leaves, spec = tree_flatten(value)
    if not any(dataclasses.is_dataclass(v) and not isinstance(v, type) for v in leaves):
        return leaves, spec
    out = []
    for v in leaves:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            for f in dataclasses.fields(v):
                out.extend(_flatten(getattr(v, f.name))[0])
        else:
            out.append(v)
    return out, None


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a module's output (any structure torch's pytree handles, and dataclasses)."""
    return [t for t in _flatten(value)[0] if isinstance(t, torch.Tensor)]


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating tensors (in any structure torch's pytree handles) cast to ``dtype``."""
    leaves, spec = tree_flatten(value)
    leaves = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in leaves]
    return tree_unflatten(leaves, spec)

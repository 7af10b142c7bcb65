"""The parts of ``ZeroRedundancyOptimizer`` that are plain functions: torch's partition, the checks of its
arguments, and stage 2's state put together from segments and taken apart again."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["checked_params", "copy_settings", "load_segment_state", "merge_segment_state", "partition", "to_device"]


def partition(param_groups: list[dict[str, Any]], world_size: int) -> list[list[dict[str, Any]]]:
    """torch's ZeRO partition of ``param_groups`` over ``world_size`` ranks (see the module notes).

    Returns:
        For each rank, one group per group of ``param_groups``: a shallow copy
        of the group with ``params`` the parameters that rank owns.
    """
    sizes = [0] * world_size
    per_rank: list[list[dict[str, Any]]] = [[] for _ in range(world_size)]
    for group in param_groups:
        owned: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        for param in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            rank = sizes.index(min(sizes))
            owned[rank].append(param)
            sizes[rank] += param.numel()
        for rank, params in enumerate(owned):
            part = copy.copy(group)
            part["params"] = params
            per_rank[rank].append(part)
    return per_rank


def checked_params(params: Any) -> list[Any]:
    """``params`` as a list (of tensors, or of groups), with torch's checks and a clearer word."""
    if isinstance(params, torch.Tensor):
        raise TypeError(f"params should be an iterable of Tensors or dicts, but got {torch.typename(params)}: "
                        "pass model.parameters() or a list of parameter groups")
    try:
        items = list(params)
    except TypeError:
        raise TypeError(f"params should be an iterable of Tensors or dicts, but got {torch.typename(params)}") from None
    if not items:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list: pass the model's parameters")
    if all(isinstance(p, dict) for p in items):
        for group in items:
            if "params" not in group:
                raise ValueError(f"a parameter group without a 'params' key: {sorted(group)}; each group is a dict "
                                 "with 'params' and, optionally, its own settings")
        tensors = [p for g in items for p in ([g["params"]] if isinstance(g["params"], torch.Tensor)
                                               else list(g["params"]))]
    elif all(isinstance(p, torch.Tensor) for p in items):
        tensors = items
    else:
        raise TypeError("params should be an iterable of Tensors or an iterable of dicts (parameter groups), "
                        "not a mix of both")
    kinds = {torch.typename(p) for p in tensors}
    if any(p.is_sparse for p in tensors) or len(kinds) > 1:
        raise ValueError(f"ZeroRedundancyOptimizer only supports parameters of one dense type, got "
                         f"{', '.join(sorted(kinds))}{' (sparse)' if any(p.is_sparse for p in tensors) else ''}: "
                         "give each dtype/device its own optimizer")
    return items


def to_device(value: Any, device: torch.device) -> Any:
    """A copy of ``value`` (tensors, dicts, lists, tuples) with every tensor on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, copy=True)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def copy_settings(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
    """Every setting but ``params`` of each group of ``source`` into the same group of ``target``."""
    for src, dst in zip(source, target, strict=True):
        for key, value in src.items():
            if key != "params":
                dst[key] = value


def merge_segment_state(consolidated: Sequence[tuple[dict[str, Any], list[tuple[int, int, int]]]],
                        params: Sequence[torch.Tensor]) -> dict[int, Any]:
    """Stage 2: each parameter's state put together from its segments' (elementwise state concatenated).

    Args:
        consolidated: per rank, its local optimizer's state dict and, for each of its local parameters,
            ``(index over all parameters, start, stop)`` of the segment it is.
        params: every parameter of the optimizer, in index order.

    Raises:
        RuntimeError: a parameter with state for some of its segments only.
        ValueError: a state tensor that is not one value per element (the optimizer is not elementwise).
    """
    pieces: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}
    for local, segments in consolidated:
        for k, (i, start, stop) in enumerate(segments):
            if k in local["state"]:
                pieces.setdefault(i, []).append((start, stop, local["state"][k]))
    state: dict[int, Any] = {}
    for i, parts in pieces.items():
        parts.sort(key=lambda part: part[0])
        param = params[i]
        if sum(stop - start for start, stop, _ in parts) != param.numel():
            raise RuntimeError(f"parameter {i}: optimizer state for part of it only (an optimizer step on "
                               "some ranks only?); every rank must step together")
        merged = {}
        for key, first in parts[0][2].items():
            values = [part[2][key] for part in parts]
            if isinstance(first, torch.Tensor) and first.dim() > 0:
                if any(v.numel() != stop - start for v, (start, stop, _) in zip(values, parts)):
                    raise ValueError(f"optimizer state {key!r} is not elementwise (one value per element of "
                                     "its parameter), so it cannot be sharded by zero_stage=2: use zero_stage=0 "
                                     "with ZeroRedundancyOptimizer (stage 1) for this optimizer")
                merged[key] = torch.cat([v.reshape(-1) for v in values]).view(param.shape)
            else:
                merged[key] = first
        state[i] = merged
    return state


def load_segment_state(value: dict[str, Any], param: torch.Tensor, start: int, stop: int,
                       device: torch.device) -> dict[str, Any]:
    """Stage 2: a segment's part (elements ``start:stop`` of ``param``) of the parameter's saved state ``value``.

    Raises:
        ValueError: a state tensor whose size is not the parameter's.
    """
    loaded = {}
    for key, item in value.items():
        if isinstance(item, torch.Tensor) and item.dim() > 0:
            if item.numel() != param.numel():
                raise ValueError(f"load_state_dict: optimizer state {key!r} has {item.numel()} elements, "
                                 f"its parameter {param.numel()}: not the state of this model")
            loaded[key] = item.detach().reshape(-1)[start:stop].to(device, copy=True)
        elif isinstance(item, torch.Tensor):
            loaded[key] = item.detach().cpu().clone()
        else:
            loaded[key] = copy.deepcopy(item)
    return loaded

"""ZeRO stage 3's model whole: ``state_dict()`` gathers each unit's parameters, ``load_state_dict()`` cuts whole
parameters to this rank's segments (the hooks :func:`ddpkit.parallel.zero.stage3.sharded_parameters` puts on the
module)."""

from __future__ import annotations

from typing import Any

import torch

from ddpkit.parallel.zero.units import Unit, all_gather_flat
from ddpkit.runtime import events

__all__ = ["full_tensors", "indexed_params", "per_element", "shard_optimizer_state", "shard_state",
           "whole_optimizer_state", "whole_state"]


@torch.no_grad()
def full_tensors(engine: Any, unit: Unit) -> list[torch.Tensor]:
    """The unit's parameters, whole and in their own dtype (a collective: every rank, unit by unit)."""
    flat = torch.empty(unit.chunk * engine.world_size, dtype=unit.shard.dtype, device=unit.shard.device)
    if engine.world_size == 1:
        flat.copy_(unit.shard)
    else:
        events.collective("{} zero-3 unit {} all-gather for the state dict", engine.owner, unit.index,
                          nbytes=unit.shard.numel() * unit.shard.element_size())
        all_gather_flat(flat, unit.shard, engine.group)
    return [flat[q.offset: q.offset + q.numel].view(q.shape) for q in unit.params]


def whole_state(engine: Any, state: dict[str, Any], prefix: str) -> None:
    """Replace each parameter's segment in ``state`` by the whole parameter (a collective, unit by unit: the
    memory of the whole model, on every rank, is the state dict's own)."""
    for u in engine.units:
        for q, whole in zip(u.params, full_tensors(engine, u)):
            keys = [prefix + name for name in q.names if prefix + name in state]
            if keys:
                whole = whole.clone()
                for key in keys:  # a tied weight: one tensor under each of its names, as DDP's state dict
                    state[key] = whole


def shard_state(engine: Any, state: dict[str, Any], prefix: str) -> None:
    """Cut each whole parameter in ``state`` to this rank's segment, so that loading copies it into the shard."""
    for u in engine.units:
        low = engine.rank * u.chunk
        for q in u.params:
            seg = engine.segment(q, u.chunk)
            for key in (prefix + name for name in q.names):  # a tied weight is loaded under each of its names
                value = state.get(key)
                if not isinstance(value, torch.Tensor) or value.shape != q.shape:
                    continue  # absent, or of another shape: the load names it
                flat = value.reshape(-1)
                state[key] = flat[seg[0] + low - q.offset: seg[1] + low - q.offset] if seg else flat[:0]


def per_element(value: Any, param: torch.Tensor) -> bool:
    """Whether an optimizer state value has one element per element of ``param`` (``exp_avg``, not ``step``)."""
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == param.shape


def indexed_params(engine: Any, optimizer: torch.optim.Optimizer) -> list[tuple[int, Unit, Any]]:
    """``(index in the optimizer's state dict, unit, unit parameter)`` for each parameter the optimizer steps."""
    where = {id(q.param): (u, q) for u in engine.units for q in u.params}
    found, index = [], 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in where:
                raise ValueError(f"{engine.owner}(zero_stage=3): the optimizer steps a tensor of shape "
                                 f"{list(p.shape)} that is not one of the model's parameters")
            found.append((index, *where[id(p)]))
            index += 1
    return found


@torch.no_grad()
def whole_optimizer_state(engine: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each per-element state tensor whole (the parameter's shape), as an
    unsharded optimizer's: it loads into one at any world size. A collective (every rank, unit by unit)."""
    saved = optimizer.state_dict()
    state = {i: dict(s) for i, s in saved["state"].items()}  # torch's state dict holds the live per-param dicts
    by_unit: dict[int, list[tuple[int, Any]]] = {}
    for index, unit, q in indexed_params(engine, optimizer):
        by_unit.setdefault(unit.index, []).append((index, q))
    for u in engine.units:
        members = by_unit.get(u.index, [])
        keys = sorted({k for i, q in members for k, v in state.get(i, {}).items() if per_element(v, q.param)})
        for key in keys:  # the same keys on every rank: every rank steps every parameter (maybe empty)
            chunk = torch.zeros(u.chunk, dtype=u.shard.dtype, device=u.shard.device)
            for i, q in members:
                seg = engine.segment(q, u.chunk)
                if seg and key in state.get(i, {}):
                    chunk[seg[0]: seg[1]].copy_(state[i][key])
            flat = torch.empty(u.chunk * engine.world_size, dtype=chunk.dtype, device=chunk.device)
            if engine.world_size == 1:
                flat.copy_(chunk)
            else:
                events.collective("{} zero-3 unit {} all-gather of the optimizer's {}", engine.owner, u.index, key,
                                  nbytes=chunk.numel() * chunk.element_size())
                all_gather_flat(flat, chunk, engine.group)
            for i, q in members:
                if key in state.get(i, {}):
                    state[i][key] = flat[q.offset: q.offset + q.numel].view(q.shape).clone()
    return {**saved, "state": state}


def shard_optimizer_state(engine: Any, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`whole_optimizer_state`: a whole (unsharded) optimizer state dict with each per-element
    tensor cut to this rank's segment, to load into ``optimizer``."""
    state = {i: dict(s) for i, s in saved["state"].items()}
    for index, unit, q in indexed_params(engine, optimizer):
        low = engine.rank * unit.chunk
        seg = engine.segment(q, unit.chunk)
        for key, value in state.get(index, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == q.shape:
                flat = value.reshape(-1)
                state[index][key] = flat[seg[0] + low - q.offset: seg[1] + low - q.offset] if seg else flat[:0]
    return {**saved, "state": state}

"""ZeRO stage 3's model whole: ``state_dict()`` gathers each unit's parameters, ``load_state_dict()`` cuts whole
parameters to this rank's segments (the hooks :func:`ddpkit.parallel.zero.stage3.sharded_parameters` puts on the
module)."""

from __future__ import annotations

from typing import Any

import torch

from ddpkit.parallel.zero.units import Unit
from ddpkit.runtime import events
from ddpkit.runtime.compat import all_gather_tensor

__all__ = ["full_tensors", "shard_state", "whole_state"]


@torch.no_grad()
def full_tensors(engine: Any, unit: Unit) -> list[torch.Tensor]:
    """The unit's parameters, whole and in their own dtype (a collective: every rank, unit by unit)."""
    flat = torch.empty(unit.chunk * engine.world_size, dtype=unit.shard.dtype, device=unit.shard.device)
    if engine.world_size == 1:
        flat.copy_(unit.shard)
    else:
        events.collective("{} zero-3 unit {} all-gather for the state dict", engine.owner, unit.index,
                          nbytes=unit.shard.numel() * unit.shard.element_size())
        all_gather_tensor(flat, unit.shard, group=engine.group)
    return [flat[q.offset: q.offset + q.numel].view(q.shape) for q in unit.params]


def whole_state(engine: Any, state: dict[str, Any], prefix: str) -> None:
    """Replace each parameter's segment in ``state`` by the whole parameter (a collective, unit by unit: the
    memory of the whole model, on every rank, is the state dict's own)."""
    for u in engine.units:
        for q, whole in zip(u.params, full_tensors(engine, u)):
            key = prefix + q.name
            if key in state:
                state[key] = whole.clone()


def shard_state(engine: Any, state: dict[str, Any], prefix: str) -> None:
    """Cut each whole parameter in ``state`` to this rank's segment, so that loading copies it into the shard."""
    for u in engine.units:
        low = engine.rank * u.chunk
        for q in u.params:
            value = state.get(prefix + q.name)
            if not isinstance(value, torch.Tensor) or value.shape != q.shape:
                continue  # absent, or of another shape: the load names it
            seg = engine.segment(q, u.chunk)
            flat = value.reshape(-1)
            state[prefix + q.name] = flat[seg[0] + low - q.offset: seg[1] + low - q.offset] if seg else flat[:0]

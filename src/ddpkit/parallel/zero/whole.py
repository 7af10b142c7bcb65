"""ZeRO stage 3's model and optimizer state whole: gathered from the ranks' shards, or cut back into them.

``state_dict()`` of the wrapped model or of any submodule holds every
parameter whole (a post-hook on each module that registers parameters gathers
them, one collective per module: call it on every rank); ``load_state_dict()``
cuts whole parameters to this rank's rows first (a pre-hook), with or without
``assign=True``. :func:`full_state` gathers a whole model's (and optimizer's)
state unit by unit into one rank's CPU memory, never whole on a device.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ddpkit.parallel.zero.flat import all_gather_flat
from ddpkit.parallel.zero.gathering import pack_part
from ddpkit.parallel.zero.placement import local_of, shard_tensor
from ddpkit.parallel.zero.units import Unit, UnitParam
from ddpkit.runtime import events

__all__ = ["full_state", "gather_whole", "indexed_params", "install_state_dict_hooks", "per_element",
           "shard_optimizer_state", "whole_optimizer_state"]


def _sharded(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and hasattr(value, "to_local") and hasattr(value, "placements")


@torch.no_grad()
def gather_whole(engine: Any, u: Unit, members: list[UnitParam], tensors: list[torch.Tensor] | None = None,
                 ) -> list[torch.Tensor]:
    """``members`` (parameters of unit ``u``) whole, in their own dtype, or ``tensors`` laid out as they are (this
    rank's rows of a tensor per member, e.g. an optimizer state). A collective: every rank, the same members."""
    first = local_of(members[0].param) if tensors is None else tensors[0]
    if first.is_meta:
        return [torch.empty(q.shape, dtype=first.dtype, device="meta") for q in members]
    if engine.world_size == 1:
        return [(local_of(q.param) if tensors is None else t).detach().reshape(q.shape).clone()
                for q, t in zip(members, tensors or members)]
    # The members as a unit of their own: one all-gather for them all.
    part_unit = Unit(u.index, u.name, u.module, [
        UnitParam(q.name, q.owners, q.shape, q.rows_per_rank, off, q.names)
        for q, off in zip(members, _offsets(members))], max(sum(q.piece for q in members), 1), u.full)
    part = pack_part(part_unit, engine.rank, first.dtype, tensors)
    out = torch.empty(engine.world_size * part.numel(), dtype=part.dtype, device=part.device)
    events.collective("{} zero-3 unit {} all-gather of whole tensors", engine.owner, u.index,
                      nbytes=part.numel() * part.element_size())
    all_gather_flat(out, part, engine.group)
    rows = out.view(engine.world_size, part.numel())
    wholes = []
    for q in part_unit.params:
        if q.replicated:
            wholes.append(rows[0, q.offset].clone())
        else:
            wholes.append(rows[:, q.offset: q.offset + q.piece].reshape(-1)[: q.numel].view(q.shape).clone())
    return wholes


def _offsets(members: list[UnitParam]) -> list[int]:
    out, at = [], 0
    for q in members:
        out.append(at)
        at += q.piece
    return out


def install_state_dict_hooks(engine: Any) -> None:
    """Hooks on every module that registers a sharded parameter: its ``state_dict()`` entries whole, and whole
    tensors given to its ``load_state_dict()`` cut to this rank's rows."""
    by_module: dict[int, tuple[nn.Module, list[tuple[Unit, str, UnitParam, int]]]] = {}
    for u in engine.units:
        for q in u.params:
            for j, (m, attr) in enumerate(q.owners):
                by_module.setdefault(id(m), (m, []))[1].append((u, attr, q, j))
    for m, entries in by_module.values():
        m.register_state_dict_post_hook(functools.partial(_whole_entries, engine, entries))
        m.register_load_state_dict_pre_hook(functools.partial(_shard_entries, engine, entries))


def _whole_entries(engine: Any, entries: list[tuple[Unit, str, UnitParam, int]], module: nn.Module,
                   state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """A module's state-dict post-hook: its parameters' entries whole (a collective)."""
    if engine.sharded_state_dict or engine.mesh is None:
        return  # without a mesh (a world of one) the parameters are whole already
    todo: list[tuple[str, Unit, UnitParam]] = []
    for u, attr, q, j in entries:
        key = prefix + attr
        if not _sharded(state.get(key)):
            continue
        # A weight tied to one whose entry is whole already (the same state dict): the same tensor, as DDP's.
        name = q.names[j]
        root = prefix[: len(prefix) - len(name) + len(attr)] if prefix.endswith(name[: len(name) - len(attr)]) \
            else None
        twin = None
        if root is not None:
            twin = next((state[root + n] for n in q.names if n != name and root + n in state
                         and not _sharded(state[root + n]) and state[root + n].shape == q.shape), None)
        if twin is not None:
            state[key] = twin
        else:
            todo.append((key, u, q))
    if not todo:
        return
    wholes = gather_whole(engine, todo[0][1], [q for _, _, q in todo])
    for (key, _, _), whole in zip(todo, wholes):
        state[key] = whole


def _shard_entries(engine: Any, entries: list[tuple[Unit, str, UnitParam, int]], module: nn.Module,
                   state: dict[str, Any], prefix: str, local_metadata: Any, *args: Any) -> None:
    """A module's load-state-dict pre-hook: whole parameters in ``state`` cut to this rank's rows, so that the
    load copies them into the shards (or, with ``assign=True``, makes them the shards)."""
    assign = bool(local_metadata.get("assign_to_params_buffers", False))
    for _, attr, q, _ in entries:
        key = prefix + attr
        value = state.get(key)
        if not isinstance(value, torch.Tensor) or _sharded(value) or value.shape != q.shape:
            continue  # absent, sharded already, or of another shape: the load names it
        if engine.mesh is None:
            continue
        if not assign:
            value = value.to(local_of(q.param).device)
        state[key] = shard_tensor(value, q, engine.mesh, engine.rank)


def per_element(value: Any, q: UnitParam, key: str = "") -> bool:
    """Whether an optimizer state value has one element per element of parameter ``q`` (``exp_avg``, not
    ``step``)."""
    if not isinstance(value, torch.Tensor):
        return False
    if _sharded(value):
        return True
    return value.shape == q.shape and (value.dim() >= 1 or key != "step")


def indexed_params(engine: Any, optimizer: torch.optim.Optimizer) -> list[tuple[int, Unit, UnitParam]]:
    """``(index in the optimizer's state dict, unit, unit parameter)`` for each parameter the optimizer steps."""
    where = {id(q.param): (u, q) for u in engine.units for q in u.params}
    found, index = [], 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in where:
                raise ValueError(f"{engine.owner}(zero_stage=3): the optimizer steps a tensor of shape "
                                 f"{list(p.shape)} that is not one of the model's parameters (build the optimizer "
                                 "after wrapping, over model.parameters())")
            found.append((index, *where[id(p)]))
            index += 1
    return found


@torch.no_grad()
def whole_optimizer_state(engine: Any, optimizer: torch.optim.Optimizer, to: int | None = None,
                          cpu: bool = False) -> dict[str, Any] | None:
    """``optimizer.state_dict()`` with each per-element state tensor whole (the parameter's shape), as an
    unsharded optimizer's: it loads into one at any world size. A collective (every rank, unit by unit).

    ``to``: only that rank gets it (the others ``None``), each unit's tensors let go as soon as they are copied
    (with ``cpu``: to the CPU), so no rank holds the whole state on a device.
    """
    saved = optimizer.state_dict()
    state = {i: dict(s) for i, s in saved["state"].items()}  # torch's state dict holds the live per-param dicts
    mine = to is None or to == engine.rank
    by_unit: dict[int, list[tuple[int, UnitParam]]] = {}
    for index, unit, q in indexed_params(engine, optimizer):
        by_unit.setdefault(unit.index, []).append((index, q))
    for u in engine.units:
        members = by_unit.get(u.index, [])
        keys = sorted({k for i, q in members for k, v in state.get(i, {}).items() if per_element(v, q, k)})
        for key in keys:  # the same keys on every rank: every rank steps every parameter (maybe empty rows)
            having = [(i, q) for i, q in members if per_element(state.get(i, {}).get(key), q, key)]
            wholes = gather_whole(engine, u, [q for _, q in having],
                                  [local_of(state[i][key]) for i, _ in having])
            for (i, _), whole in zip(having, wholes):
                if mine:
                    state[i][key] = whole.cpu() if cpu else whole
    if not mine:
        return None
    for s in state.values():  # the rest (AdamW's step) as it is, on the CPU when asked
        for k, v in s.items():
            if cpu and isinstance(v, torch.Tensor) and not _sharded(v):
                s[k] = v.cpu()
    return {**saved, "state": state}


def shard_optimizer_state(engine: Any, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`whole_optimizer_state`: a whole (unsharded) optimizer state dict with each per-element
    tensor cut to this rank's rows (copies: nothing of the whole tensors is kept), to load into ``optimizer``."""
    state = {i: dict(s) for i, s in saved["state"].items()}
    for index, unit, q in indexed_params(engine, optimizer):
        for key, value in state.get(index, {}).items():
            if per_element(value, q, key) and not _sharded(value):
                state[index][key] = shard_tensor(value.to(local_of(q.param).device), q, engine.mesh, engine.rank)
    return {**saved, "state": state}


@torch.no_grad()
def full_state(engine: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, to: int = 0,
               ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``model``'s state dict (and ``optimizer``'s, unsharded) whole on rank ``to``'s CPU, gathered unit by unit
    (``(None, None)`` on the other ranks). A collective. ``model`` is the module ``engine`` shards, or a wrapper
    whose ``state_dict()`` holds it (DDP's: keys ``module.*``)."""
    with engine.sharded_state():
        state = model.state_dict()  # the shards, as DTensors: no collective, nothing whole
    mine = to == engine.rank
    prefix = _prefix_of(engine, state)
    for u in engine.units:
        members = [q for q in u.params if any(prefix + n in state for n in q.names)]
        if not members:
            continue
        wholes = gather_whole(engine, u, members)
        for q, whole in zip(members, wholes):
            copy = whole.cpu() if mine else None
            for name in q.names:  # a tied weight: one tensor under each of its names
                if prefix + name in state:
                    state[prefix + name] = copy
            del whole
    optim = whole_optimizer_state(engine, optimizer, to=to, cpu=True) if optimizer is not None else None
    if not mine:
        return None, None
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}, optim


def _prefix_of(engine: Any, state: dict[str, Any]) -> str:
    """What a wrapper puts before the sharded module's keys in ``state`` (``"module."`` for DDP's)."""
    names = [q.names[0] for u in engine.units for q in u.params]
    for key in state:
        if key.endswith(names[0]):
            prefix = key[: len(key) - len(names[0])]
            if all(prefix + n in state for n in names):
                return prefix
    raise ValueError(f"{engine.owner}(zero_stage=3): the state dict given does not hold the sharded model's "
                     "parameters")

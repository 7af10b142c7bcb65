"""Sharded checkpoints of a ZeRO-3 model: each rank writes its own shards, and a later job reads them back at any
world size, without the whole model ever on one rank.

:func:`save_sharded` writes, into a new directory,

* ``rank-R-of-W.safetensors`` on every rank ``R``: for each unit ``k`` its
  parameter shard (``unit.k``) and, with an optimizer, the shard of each
  per-element state tensor (``unit.k.optim.KEY``, e.g. AdamW's ``exp_avg``),
  laid out as the parameter shard is;
* ``index.json`` (rank 0, written last: a directory without it is an
  unfinished save): the world size, each unit's name, chunk and parameters
  (name, shape, offset), and the optimizer's param groups and its other state
  (AdamW's ``step``: the same on every rank).

:func:`load_sharded` reads them back into a ZeRO-3 model (and optimizer) of
the same units: each rank reads, with safetensors' slices, only the ranges of
the old shards that overlap its own, so a job saved at 4 ranks resumes at 2 or
3. The checkpoint is checked against the model (units, parameters, shapes)
before anything is read, and refused naming the first difference.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ddpkit.parallel.zero.stage3 import ShardedParameters, engine_of
from ddpkit.parallel.zero.whole import indexed_params, per_element

__all__ = ["INDEX", "load_sharded", "save_sharded"]

INDEX = "index.json"
"""The file that makes a directory a finished sharded checkpoint."""


def _engine(model: nn.Module) -> ShardedParameters:
    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    engine = engine_of(getattr(inner, "_orig_mod", inner))
    if engine is None:
        raise ValueError(f"{type(model).__name__} does not shard its parameters: sharded checkpoints are for "
                         "DistributedDataParallel(module, zero_stage=3); save its state_dict() otherwise")
    return engine


def _rank_file(directory: Path, rank: int, world: int) -> Path:
    return directory / f"rank-{rank}-of-{world}.safetensors"


def _barrier(engine: ShardedParameters) -> None:
    if engine.world_size > 1:
        dist.barrier(group=engine.group)


@torch.no_grad()
def save_sharded(model: nn.Module, directory: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
                 ) -> Path:
    """Write this rank's shards of ``model`` (and ``optimizer``) into ``directory`` (a collective).

    Raises:
        FileExistsError: ``directory`` already holds a checkpoint (nothing is overwritten).
        ValueError: ``model`` is not a ZeRO-3 model, or ``optimizer`` steps other tensors than its parameters.
    """
    engine = _engine(model)
    directory = Path(directory)
    found = [(directory / INDEX).exists() or any(directory.glob("rank-*-of-*.safetensors"))]
    if engine.world_size > 1:
        dist.broadcast_object_list(found, src=0, group=engine.group)
    if found[0]:
        raise FileExistsError(f"{directory} already holds a sharded checkpoint: save into a new directory (or "
                              "remove it first)")
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for u in engine.units:
        tensors[f"unit.{u.index}"] = u.shard.detach().cpu().contiguous()
    index: dict[str, Any] = {
        "format": "ddpkit-zero3-sharded/1", "world_size": engine.world_size,
        "units": [{"name": u.name, "chunk": u.chunk, "dtype": str(u.shard.dtype).removeprefix("torch."),
                   "params": [{"name": q.name, "shape": list(q.shape), "offset": q.offset} for q in u.params]}
                  for u in engine.units],
    }
    if optimizer is not None:
        index["optimizer"] = _optimizer_shards(engine, optimizer, tensors)
    tmp = _rank_file(directory, engine.rank, engine.world_size).with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, _rank_file(directory, engine.rank, engine.world_size))
    _barrier(engine)  # every rank's file is on disk before the index says the checkpoint is whole
    if engine.rank == 0:
        tmp = directory / (INDEX + ".tmp")
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, directory / INDEX)
    _barrier(engine)
    return directory


def _optimizer_shards(engine: ShardedParameters, optimizer: torch.optim.Optimizer,
                      tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Put the optimizer's per-element state into ``tensors`` unit by unit; return the rest for the index."""
    saved = optimizer.state_dict()
    other: dict[str, dict[str, Any]] = {}
    for index, unit, q in indexed_params(engine, optimizer):
        for key, value in saved["state"].get(index, {}).items():
            if per_element(value, q.param):
                name = f"unit.{unit.index}.optim.{key}"
                if name not in tensors:
                    tensors[name] = torch.zeros(unit.chunk, dtype=value.dtype)
                seg = engine.segment(q, unit.chunk)
                if seg:
                    tensors[name][seg[0]: seg[1]].copy_(value.detach().cpu())
                other.setdefault(str(index), {}).setdefault("per_element", []).append(key)
            elif isinstance(value, torch.Tensor):
                other.setdefault(str(index), {})[key] = {"tensor": value.item(), "dtype": str(value.dtype)}
            else:
                other.setdefault(str(index), {})[key] = value
    groups = [{k: {"tuple": list(v)} if isinstance(v, tuple) else v for k, v in g.items()}
              for g in saved["param_groups"]]  # JSON keeps no tuples (AdamW's betas)
    return {"param_groups": groups, "state": other}


def _check(engine: ShardedParameters, index: dict[str, Any], directory: Path) -> None:
    if index.get("format") != "ddpkit-zero3-sharded/1":
        raise ValueError(f"{directory / INDEX} is not a ddpkit sharded checkpoint")
    mine = [(u.name, [(q.name, list(q.shape), q.offset) for q in u.params]) for u in engine.units]
    theirs = [(u["name"], [(p["name"], p["shape"], p["offset"]) for p in u["params"]]) for u in index["units"]]
    if mine != theirs:
        first = next(((a, b) for a, b in zip(mine, theirs) if a != b), (mine[len(theirs):] or theirs[len(mine):], None))
        raise ValueError(f"the sharded checkpoint in {directory} is not of this model (its units and parameters "
                         f"differ, first at {first[0]!r} against the checkpoint's {first[1]!r}): load it into a "
                         "model of the same layers, with the same zero_units")


def _read(directory: Path, world: int, chunk: int, name: str, start: int, stop: int,
          like: torch.Tensor) -> torch.Tensor:
    """Elements ``start:stop`` of the flat tensor ``name`` whose shards (``chunk`` each) the ``world`` files hold."""
    out = torch.zeros(stop - start, dtype=like.dtype)
    for rank in range(start // chunk, min(world, -(-stop // chunk))):
        low = rank * chunk
        a, z = max(start, low), min(stop, low + chunk)
        if a >= z:
            continue
        with safe_open(str(_rank_file(directory, rank, world)), framework="pt") as f:
            if name not in set(f.keys()):
                continue  # nothing of this state was saved (no rank had stepped the parameter)
            out[a - start: z - start] = f.get_slice(name)[a - low: z - low].to(like.dtype)
    return out


@torch.no_grad()
def load_sharded(model: nn.Module, directory: str | os.PathLike,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
    """Read a :func:`save_sharded` checkpoint into ``model`` (and ``optimizer``), at any world size (a collective).

    Raises:
        FileNotFoundError: no finished checkpoint in ``directory`` (its index is missing).
        ValueError: the checkpoint is of another model, or holds no optimizer state and ``optimizer`` is given.
    """
    engine = _engine(model)
    directory = Path(directory)
    if not (directory / INDEX).exists():
        raise FileNotFoundError(f"{directory} holds no finished sharded checkpoint ({INDEX} is missing: a save "
                                "that did not end, or another directory)")
    index = json.loads((directory / INDEX).read_text())
    _check(engine, index, directory)
    world = int(index["world_size"])
    if optimizer is not None and "optimizer" not in index:
        raise ValueError(f"the sharded checkpoint in {directory} holds no optimizer state: load the model alone")
    for u, saved in zip(engine.units, index["units"]):
        low = engine.rank * u.chunk
        total = u.params[-1].offset + u.params[-1].numel
        stop = min(low + u.chunk, total)
        if stop > low:
            piece = _read(directory, world, saved["chunk"], f"unit.{u.index}", low, stop, u.shard)
            u.shard[: stop - low].copy_(piece.to(u.shard.device))
    if optimizer is not None:
        optimizer.load_state_dict(_optimizer_state(engine, optimizer, index, directory, world))
    _barrier(engine)


def _optimizer_state(engine: ShardedParameters, optimizer: torch.optim.Optimizer, index: dict[str, Any],
                     directory: Path, world: int) -> dict[str, Any]:
    saved = index["optimizer"]
    chunks = {u.index: saved_unit["chunk"] for u, saved_unit in zip(engine.units, index["units"])}
    state: dict[int, dict[str, Any]] = {}
    for i, unit, q in indexed_params(engine, optimizer):
        entry = saved["state"].get(str(i))
        if entry is None:
            continue
        state[i] = {}
        for key, value in entry.items():
            if key == "per_element":
                continue
            if isinstance(value, dict) and "tensor" in value:
                state[i][key] = torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"].removeprefix("torch.")))
            else:
                state[i][key] = value
        seg = engine.segment(q, unit.chunk)
        low = engine.rank * unit.chunk
        for key in entry.get("per_element", []):
            if seg:
                state[i][key] = _read(directory, world, chunks[unit.index], f"unit.{unit.index}.optim.{key}",
                                      low + seg[0], low + seg[1], q.param).to(q.param.device)
            else:
                state[i][key] = q.param.new_zeros(0)
    groups = [{k: tuple(v["tuple"]) if isinstance(v, dict) and set(v) == {"tuple"} else v for k, v in g.items()}
              for g in saved["param_groups"]]
    return {"state": state, "param_groups": groups}

"""Sharded checkpoints of a ZeRO-3 model: each rank writes its own rows, and a later job reads them back at any
world size, without the whole model ever on one rank.

:func:`save_sharded` writes, into a new directory,

* ``rank-R-of-W.safetensors`` on every rank ``R``: this rank's rows of each
  parameter (``param.NAME``) and, with an optimizer, of each per-element
  state tensor (``optim.I.KEY``, e.g. AdamW's ``exp_avg`` of the optimizer's
  ``I``-th parameter);
* ``index.json`` (rank 0, written last: a directory without it is an
  unfinished save): the world size, each parameter's name, shape and dtype,
  and the optimizer's param groups and its other state (AdamW's ``step``: the
  same on every rank).

:func:`load_sharded` reads them back into a ZeRO-3 model (and optimizer) with
the same parameters, at any world size and with any units: each rank reads,
with safetensors' slices, only the rows of the saved shards that overlap its
own. The checkpoint is checked against the model (names, shapes) before
anything is read, and refused naming the first difference.
:func:`consolidate_sharded` reads one whole, in one process, as plain state
dicts for an unsharded model and optimizer (torch's ``dcp_to_torch_save``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ddpkit.parallel.zero.stage3 import ShardedParameters, engine_of
from ddpkit.parallel.zero.units import UnitParam, like_param, local_of
from ddpkit.parallel.zero.whole import indexed_params, per_element

__all__ = ["FORMAT", "INDEX", "consolidate_sharded", "load_sharded", "save_sharded"]

INDEX = "index.json"
"""The file that makes a directory a finished sharded checkpoint."""
FORMAT = "ddpkit-zero3-sharded/2"
"""Each parameter cut by rows (format 1, before, cut the units' flat buffers)."""


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


def _params(engine: ShardedParameters) -> list[UnitParam]:
    return [q for u in engine.units for q in u.params]


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
        dist.broadcast_object_list(found, src=dist.get_global_rank(engine.group, 0), group=engine.group)
    if found[0]:
        raise FileExistsError(f"{directory} already holds a sharded checkpoint: save into a new directory (or "
                              "remove it first)")
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for q in _params(engine):
        tensors[f"param.{q.name}"] = local_of(q.param).detach().cpu().contiguous()
    index: dict[str, Any] = {
        "format": FORMAT, "world_size": engine.world_size,
        "params": [{"name": q.name, "shape": list(q.shape), "dtype": str(q.param.dtype).removeprefix("torch.")}
                   for q in _params(engine)],
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
    """Put this rank's rows of the optimizer's per-element state into ``tensors``; return the rest for the index."""
    saved = optimizer.state_dict()
    other: dict[str, dict[str, Any]] = {}
    names = []
    for index, _, q in indexed_params(engine, optimizer):
        names.append(q.name)
        for key, value in saved["state"].get(index, {}).items():
            entry = other.setdefault(str(index), {})
            if per_element(value, q, key):
                tensors[f"optim.{index}.{key}"] = local_of(value).detach().cpu().contiguous()
                entry.setdefault("per_element", []).append(key)
            elif isinstance(value, torch.Tensor):
                entry[key] = {"tensor": value.item(), "dtype": str(value.dtype)}
            else:
                entry[key] = value
    groups = [{k: {"tuple": list(v)} if isinstance(v, tuple) else v for k, v in g.items()}
              for g in saved["param_groups"]]  # JSON keeps no tuples (AdamW's betas)
    return {"param_groups": groups, "state": other, "params": names}


def _check(engine: ShardedParameters, index: dict[str, Any], directory: Path) -> None:
    if index.get("format") != FORMAT:
        older = " (saved by an older ddpkit, whose layout this one does not read)" if str(
            index.get("format", "")).startswith("ddpkit-zero3-sharded/") else ""
        raise ValueError(f"{directory / INDEX} is not a ddpkit sharded checkpoint of format {FORMAT}{older}")
    mine = [(q.name, list(q.shape)) for q in _params(engine)]
    theirs = [(p["name"], p["shape"]) for p in index["params"]]
    if mine != theirs:
        first = next(((a, b) for a, b in zip(mine, theirs) if a != b), (mine[len(theirs):] or theirs[len(mine):], None))
        raise ValueError(f"the sharded checkpoint in {directory} is not of this model (its parameters differ, first "
                         f"at {first[0]!r} against the checkpoint's {first[1]!r}): load it into a model of the same "
                         "layers")


def _read(directory: Path, world: int, name: str, q: UnitParam, start: int, stop: int,
          like: torch.Tensor) -> torch.Tensor:
    """Rows ``start:stop`` of ``name`` (shaped as parameter ``q``), from the ``world`` files that hold its rows."""
    if q.replicated:
        with safe_open(str(_rank_file(directory, 0, world)), framework="pt") as f:
            return f.get_tensor(name).to(like.dtype)
    out = torch.zeros((stop - start, *q.shape[1:]), dtype=like.dtype)
    per_rank = math.ceil(q.rows / world)
    for rank in range(world):
        low = min(rank * per_rank, q.rows)
        high = min(low + per_rank, q.rows)
        a, z = max(start, low), min(stop, high)
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
    engine.adopt()
    directory = Path(directory)
    if not (directory / INDEX).exists():
        raise FileNotFoundError(f"{directory} holds no finished sharded checkpoint ({INDEX} is missing: a save "
                                "that did not end, or another directory)")
    index = json.loads((directory / INDEX).read_text())
    _check(engine, index, directory)
    world = int(index["world_size"])
    if optimizer is not None and "optimizer" not in index:
        raise ValueError(f"the sharded checkpoint in {directory} holds no optimizer state: load the model alone")
    for q in _params(engine):
        local = local_of(q.param)
        a, b = q.local_rows(engine.rank)
        local.copy_(_read(directory, world, f"param.{q.name}", q, a, b, local).view(local.shape))
    if optimizer is not None:
        optimizer.load_state_dict(_optimizer_state(engine, optimizer, index, directory, world))
    _barrier(engine)


def _optimizer_state(engine: ShardedParameters, optimizer: torch.optim.Optimizer, index: dict[str, Any],
                     directory: Path, world: int) -> dict[str, Any]:
    saved = index["optimizer"]
    state: dict[int, dict[str, Any]] = {}
    for i, _, q in indexed_params(engine, optimizer):
        entry = saved["state"].get(str(i))
        if entry is None:
            continue
        state[i] = {}
        for key, value in entry.items():
            if key == "per_element":
                continue
            if isinstance(value, dict) and "tensor" in value:
                dtype = getattr(torch, value["dtype"].removeprefix("torch."))
                state[i][key] = torch.tensor(value["tensor"], dtype=dtype)
            else:
                state[i][key] = value
        local = local_of(q.param)
        a, b = q.local_rows(engine.rank)
        for key in entry.get("per_element", []):
            rows = _read(directory, world, f"optim.{i}.{key}", q, a, b, local).to(local.device)
            state[i][key] = like_param(rows.view(q.local_shape(engine.rank)), q, engine.mesh)
    groups = [{k: tuple(v["tuple"]) if isinstance(v, dict) and set(v) == {"tuple"} else v for k, v in g.items()}
              for g in saved["param_groups"]]
    return {"state": state, "param_groups": groups}



@torch.no_grad()
def consolidate_sharded(directory: str | os.PathLike) -> dict[str, Any]:
    """A :func:`save_sharded` checkpoint whole, in this process (no process group needed): ``{"model": state dict,
    "optimizer": state dict}`` (``"optimizer"`` when one was saved), as an unsharded model's and optimizer's, to
    ``load_state_dict`` into a plain module and its optimizer.

    Raises:
        FileNotFoundError: no finished checkpoint in ``directory``.
        ValueError: ``directory`` holds another kind of checkpoint.
    """
    directory = Path(directory)
    if not (directory / INDEX).exists():
        raise FileNotFoundError(f"{directory} holds no finished sharded checkpoint ({INDEX} is missing: a save "
                                "that did not end, or another directory)")
    index = json.loads((directory / INDEX).read_text())
    if index.get("format") != FORMAT:
        raise ValueError(f"{directory / INDEX} is not a ddpkit sharded checkpoint of format {FORMAT}")
    world = int(index["world_size"])
    layout = []
    for entry in index["params"]:
        shape = torch.Size(entry["shape"])
        per_rank = 1 if not shape else math.ceil(shape[0] / world)
        layout.append(UnitParam(entry["name"], [], shape, per_rank, 0, (entry["name"],)))
    like = {q.name: torch.empty(0, dtype=getattr(torch, e["dtype"])) for q, e in zip(layout, index["params"])}
    model = {q.name: _read(directory, world, f"param.{q.name}", q, 0, q.rows, like[q.name]).view(q.shape)
             for q in layout}
    out: dict[str, Any] = {"model": model}
    saved = index.get("optimizer")
    if saved is not None:
        state: dict[int, dict[str, Any]] = {}
        by_name = {q.name: q for q in layout}
        for i, name in enumerate(saved["params"]):
            q = by_name[name]
            entry = saved["state"].get(str(i))
            if entry is None:
                continue
            state[i] = {k: (torch.tensor(v["tensor"], dtype=getattr(torch, v["dtype"].removeprefix("torch.")))
                            if isinstance(v, dict) and "tensor" in v else v)
                        for k, v in entry.items() if k != "per_element"}
            for key in entry.get("per_element", []):
                state[i][key] = _read(directory, world, f"optim.{i}.{key}", q, 0, q.rows, like[q.name]).view(q.shape)
        groups = [{k: tuple(v["tuple"]) if isinstance(v, dict) and set(v) == {"tuple"} else v for k, v in g.items()}
                  for g in saved["param_groups"]]
        out["optimizer"] = {"state": state, "param_groups": groups}
    return out

"""Sharded checkpoints of a ZeRO-3 model: each rank writes its own rows, and a later job reads them back at any
world size, without the whole model ever on one rank.

:func:`save_sharded` writes, into a new directory,

* ``rank-R-of-W.safetensors`` on every rank ``R``: this rank's rows of each
  parameter (``param.NAME``) and, with an optimizer, of each per-element
  state tensor (``optim.I.KEY``, e.g. AdamW's ``exp_avg`` of the optimizer's
  ``I``-th parameter);
* the model's buffers (``buffer.NAME``: BatchNorm's statistics; each rank
  holds them whole, as its state dict's persistent ones) in rank 0's file;
* ``index.json`` (rank 0, written last: a directory without it is an
  unfinished save): the world size, each parameter's and buffer's name, shape
  and dtype, the optimizer's param groups (a tensor learning rate as its
  value and dtype) and its other state (AdamW's ``step``: the same on every
  rank), and for every rank file its size and the digest of each of its
  tensors; the index carries a digest of itself.

Every file is written as whole checkpoints are (:func:`ddpkit.runtime.durable.write_atomic`:
fsynced, renamed into place, the same file mode), and verified as they are:
before a load or a consolidation reads a row, the index's own digest and
every rank file's size and tensor digests are checked (the files shared out
over the loading ranks, each read once), and a file that is missing,
truncated, foreign, or whose bytes changed is a one-line
:class:`~ddpkit.runtime.durable.CheckpointError` naming it, raised on every
rank (the ranks agree before any of them reads a row, so none is left
waiting in a collective).

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
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from ddpkit.parallel.zero.stage3 import ShardedParameters, engine_of
from ddpkit.parallel.zero.placement import like_param, local_of
from ddpkit.parallel.zero.units import UnitParam
from ddpkit.parallel.zero.whole import indexed_params, per_element
from ddpkit.runtime.durable import CheckpointError, digest, one_line, tensor_digest, write_atomic

__all__ = ["FORMAT", "INDEX", "consolidate_sharded", "load_sharded", "save_sharded", "verify_sharded"]

INDEX = "index.json"
"""The file that makes a directory a finished sharded checkpoint."""
FORMAT = "ddpkit-zero3-sharded/4"
"""Each parameter cut by rows, the buffers whole in rank 0's file, every file's tensors and the index digested
(format 3, before, held no buffers: a load leaves them as they are; format 2 carried no digests and is read
unchecked; format 1 cut the units' flat buffers)."""
READABLE = ("ddpkit-zero3-sharded/2", "ddpkit-zero3-sharded/3", FORMAT)
DIGESTED = ("ddpkit-zero3-sharded/3", FORMAT)


def _inner(model: nn.Module) -> nn.Module:
    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    return getattr(inner, "_orig_mod", inner)


def _buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's persistent buffers (those its state dict holds), named as in it."""
    out = []
    for prefix, module in _inner(model).named_modules():
        transient = getattr(module, "_non_persistent_buffers_set", set())
        out += [(f"{prefix}.{name}" if prefix else name, buf) for name, buf in module.named_buffers(recurse=False)
                if buf is not None and name not in transient]
    return out


def _engine(model: nn.Module) -> ShardedParameters:
    inner = _inner(model)
    engine = engine_of(inner)
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
        ddpkit.CheckpointError: a rank could not write its file, or rank 0 the index (disk full, permissions),
            on every rank alike, naming the rank and the file.
    """
    engine = _engine(model)
    directory = Path(directory)
    found = [(directory / INDEX).exists() or any(directory.glob("rank-*-of-*.safetensors"))]
    if engine.world_size > 1:
        dist.broadcast_object_list(found, src=dist.get_global_rank(engine.group, 0), group=engine.group)
    if found[0]:
        unfinished = "" if (directory / INDEX).exists() else " (an unfinished one: rank files without index.json)"
        raise FileExistsError(f"{directory} already holds a sharded checkpoint{unfinished}: save into a new "
                              "directory (or remove it first)")
    tensors: dict[str, torch.Tensor] = {}
    for q in _params(engine):
        tensors[f"param.{q.name}"] = local_of(q.param).detach().cpu().contiguous()
    buffers = _buffers(model)
    if engine.rank == 0:
        tensors.update({f"buffer.{name}": buf.detach().cpu().contiguous() for name, buf in buffers})
    index: dict[str, Any] = {
        "format": FORMAT, "world_size": engine.world_size,
        "params": [{"name": q.name, "shape": list(q.shape), "dtype": str(q.param.dtype).removeprefix("torch.")}
                   for q in _params(engine)],
        "buffers": [{"name": name, "shape": list(buf.shape), "dtype": str(buf.dtype).removeprefix("torch.")}
                    for name, buf in buffers],
    }
    if optimizer is not None:
        index["optimizer"] = _optimizer_shards(engine, optimizer, tensors)
    try:  # every rank alike, before any file is written: none is left waiting, nothing half-written
        json.dumps(index)
    except (TypeError, ValueError) as e:
        raise ValueError(f"save_sharded: the optimizer's param groups hold a value the index cannot keep "
                         f"({one_line(e)}): keep numbers, strings, lists and scalar tensors there") from e
    directory.mkdir(parents=True, exist_ok=True)
    path = _rank_file(directory, engine.rank, engine.world_size)
    mine: dict[str, Any] | str
    try:
        write_atomic(path, lambda tmp: save_file(tensors, tmp))  # streamed: no copy of the shard in memory
        mine = {"file": path.name, "bytes": path.stat().st_size,
                "tensors": {k: tensor_digest(t) for k, t in tensors.items()}}
    except (OSError, SafetensorError) as e:  # disk full, quota, permissions: every rank says so, none waits
        mine = f"rank {engine.rank} could not write {path}: {one_line(e)}"
    files = _everyones(engine, mine)  # every rank's file is on disk before the index says the checkpoint is whole
    if failed := [f for f in files if isinstance(f, str)]:
        raise CheckpointError("; ".join(failed))
    outcome = [""]
    if engine.rank == 0:
        index["files"] = {f["file"]: {"bytes": f["bytes"], "tensors": f["tensors"]} for f in files}
        index["digest"] = _index_digest(index)
        try:
            write_atomic(directory / INDEX, json.dumps(index, indent=1).encode())
        except OSError as e:
            outcome[0] = f"rank 0 could not write {directory / INDEX}: {one_line(e)}"
    if engine.world_size > 1:
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(engine.group, 0), group=engine.group)
    if outcome[0]:
        raise CheckpointError(outcome[0])
    return directory


def _everyones(engine: ShardedParameters, mine: Any) -> list[Any]:
    """``mine`` from every rank of the engine's group, in rank order."""
    if engine.world_size == 1:
        return [mine]
    gathered: list[Any] = [None] * engine.world_size
    dist.all_gather_object(gathered, mine, group=engine.group)
    return gathered


def _index_digest(index: dict[str, Any]) -> str:
    """The digest of an index's content (all but its ``digest``), in a canonical form."""
    return digest(json.dumps({k: v for k, v in index.items() if k != "digest"}, sort_keys=True).encode())


def _read_index(directory: Path) -> dict[str, Any]:
    """The index of the checkpoint in ``directory``, its form and (format 3) its digest checked.

    Raises:
        FileNotFoundError: no index (a save that did not end, or another directory).
        CheckpointError: an index that is not JSON, not a sharded checkpoint's, of an unknown format, or damaged.
    """
    path = directory / INDEX
    if not path.exists():
        raise FileNotFoundError(f"{directory} holds no finished sharded checkpoint ({INDEX} is missing: a save "
                                "that did not end, or another directory)")
    try:
        index = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"sharded checkpoint index {path} is damaged or truncated: not JSON "
                              f"({one_line(e)})") from e
    if not isinstance(index, dict):
        raise CheckpointError(f"{path} is not a ddpkit sharded checkpoint's index (not a JSON object)")
    found = index.get("format")
    if found not in READABLE:
        older = " (saved by an older ddpkit, whose layout this one does not read)" if str(found).startswith(
            "ddpkit-zero3-sharded/") else ""
        raise CheckpointError(f"{path} is not a ddpkit sharded checkpoint of format {FORMAT}{older}")
    if found in DIGESTED and index.get("digest") != _index_digest(index):
        raise CheckpointError(f"sharded checkpoint index {path} is damaged: its content does not match its digest "
                              "(its bytes changed after it was written)")
    try:
        world = int(index["world_size"])
        params = [(str(p["name"]), [int(n) for n in p["shape"]], str(p["dtype"]))
                  for p in [*index["params"], *index.get("buffers", [])]]
        if world < 1 or (found in DIGESTED and sorted(index["files"]) != sorted(
                _rank_file(directory, r, world).name for r in range(world))):
            raise ValueError(f"world size {world} and the files it names disagree")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"sharded checkpoint index {path} is damaged: {one_line(e)}") from e
    for _, _, dtype in params:
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise CheckpointError(f"sharded checkpoint index {path} is damaged: {dtype!r} is not a torch dtype")
    return index


def _verify_file(directory: Path, name: str, expected: dict[str, Any]) -> str | None:
    """Why rank file ``name`` does not hold what the index says it does (its size, its tensors' digests), or
    None."""
    path = directory / name
    if not path.is_file():
        return f"sharded checkpoint file {path} is missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return (f"sharded checkpoint file {path} is damaged: {size} bytes, the index says {expected['bytes']} "
                "(truncated, or another file in its place)")
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            if names != set(expected["tensors"]):
                return (f"sharded checkpoint file {path} is not the one its index names: it holds {len(names)} "
                        f"tensors, the index {len(expected['tensors'])}")
            for key, want in expected["tensors"].items():
                if tensor_digest(f.get_tensor(key)) != want:
                    return (f"sharded checkpoint file {path} is damaged: tensor {key!r} does not match its digest "
                            "(its bytes changed after it was written)")
    except (SafetensorError, OSError, ValueError) as e:
        return f"sharded checkpoint file {path} is damaged or not a safetensors file: {one_line(e)}"
    return None


def verify_sharded(directory: str | os.PathLike, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Check a sharded checkpoint (see the module notes); its index. With ``rank`` and ``world``, this process
    checks its share of the files only (every ``world``-th, from ``rank``); the caller agrees on the outcome.

    Raises:
        FileNotFoundError: no finished checkpoint in ``directory``.
        CheckpointError: the index or a file (of this share) is damaged, truncated, foreign or missing.
    """
    directory = Path(directory)
    index = _read_index(directory)
    for name in sorted(index.get("files", {}))[rank::world]:
        if (why := _verify_file(directory, name, index["files"][name])) is not None:
            raise CheckpointError(why)
    return index


def _agreed_index(engine: ShardedParameters, directory: Path) -> dict[str, Any]:
    """Every loading rank checks its share of the files; all raise the first problem any found, or go on."""
    error: BaseException | None = None
    index: dict[str, Any] = {}
    try:
        index = verify_sharded(directory, engine.rank, engine.world_size)
    except (CheckpointError, FileNotFoundError) as e:
        error = e
    if engine.world_size > 1:
        said = [None] * engine.world_size
        dist.all_gather_object(said, None if error is None else (type(error).__name__, str(error)),
                               group=engine.group)
        first = next((s for s in said if s is not None), None)
        if first is not None and error is None:
            error = (FileNotFoundError if first[0] == "FileNotFoundError" else CheckpointError)(first[1])
    if error is not None:
        raise error
    return index


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
    groups = [{k: _to_json(v) for k, v in g.items()} for g in saved["param_groups"]]
    return {"param_groups": groups, "state": other, "params": names}


def _to_json(value: Any) -> Any:
    """A param group's setting as JSON keeps it: a tuple (AdamW's betas) or a scalar tensor (a tensor learning
    rate, which torch's optimizers take) marked, to come back as it was (:func:`_from_json`)."""
    if isinstance(value, tuple):
        return {"tuple": [_to_json(v) for v in value]}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {"tensor": value.item(), "dtype": str(value.dtype), "shape": list(value.shape)}
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"tuple"}:
        return tuple(_from_json(v) for v in value["tuple"])
    if isinstance(value, dict) and set(value) == {"tensor", "dtype", "shape"}:
        dtype = getattr(torch, value["dtype"].removeprefix("torch."))
        return torch.tensor(value["tensor"], dtype=dtype).reshape(value["shape"])
    return value


def _groups(saved: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: _from_json(v) for k, v in g.items()} for g in saved["param_groups"]]


def _check(engine: ShardedParameters, model: nn.Module, index: dict[str, Any], directory: Path) -> None:
    """The checkpoint is of this model: the same parameters (and, from format 4, persistent buffers), in order."""
    kinds = [("parameters", [(q.name, list(q.shape)) for q in _params(engine)], index["params"])]
    if "buffers" in index:
        kinds.append(("buffers", [(n, list(b.shape)) for n, b in _buffers(model)], index["buffers"]))
    for what, mine, saved in kinds:
        theirs = [(p["name"], p["shape"]) for p in saved]
        if mine == theirs:
            continue
        at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        model_has = f"{mine[at][0]!r} of shape {mine[at][1]}" if at < len(mine) else "nothing more"
        saved_has = f"{theirs[at][0]!r} of shape {theirs[at][1]}" if at < len(theirs) else "nothing more"
        raise ValueError(f"the sharded checkpoint in {directory} is not of this model: their {what} differ first at "
                         f"position {at}, where the model has {model_has} and the checkpoint {saved_has}; load it "
                         "into a model of the same layers")


def _read(directory: Path, world: int, name: str, q: UnitParam, start: int, stop: int,
          like: torch.Tensor) -> torch.Tensor:
    """Rows ``start:stop`` of ``name`` (shaped as parameter ``q``), from the ``world`` files that hold its rows."""
    path = _rank_file(directory, 0, world)
    try:
        if q.replicated:
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(name).to(like.dtype)
        out = torch.zeros((stop - start, *q.shape[1:]), dtype=like.dtype)
        per_rank = math.ceil(q.rows / world)
        for rank in range(world):
            low = min(rank * per_rank, q.rows)
            high = min(low + per_rank, q.rows)
            a, z = max(start, low), min(stop, high)
            if a >= z:
                continue
            path = _rank_file(directory, rank, world)
            with safe_open(str(path), framework="pt") as f:
                if name not in set(f.keys()):
                    continue  # nothing of this state was saved (no rank had stepped the parameter)
                out[a - start: z - start] = f.get_slice(name)[a - low: z - low].to(like.dtype)
        return out
    except (SafetensorError, OSError) as e:  # checked before, so only a file changed meanwhile (or an old format)
        raise CheckpointError(f"sharded checkpoint file {path} cannot be read: {one_line(e)}") from e


@torch.no_grad()
def load_sharded(model: nn.Module, directory: str | os.PathLike,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
    """Read a :func:`save_sharded` checkpoint into ``model`` (and ``optimizer``), at any world size (a collective).

    Raises:
        FileNotFoundError: no finished checkpoint in ``directory`` (its index is missing).
        CheckpointError: the index or a rank file is damaged, truncated, foreign or missing (on every rank).
        ValueError: the checkpoint is of another model, or holds no optimizer state and ``optimizer`` is given.
    """
    engine = _engine(model)
    engine.adopt()
    directory = Path(directory)
    index = _agreed_index(engine, directory)
    _check(engine, model, index, directory)
    world = int(index["world_size"])
    if optimizer is not None and "optimizer" not in index:
        raise ValueError(f"the sharded checkpoint in {directory} holds no optimizer state: load the model alone")
    for q in _params(engine):
        local = local_of(q.param)
        a, b = q.local_rows(engine.rank)
        local.copy_(_read(directory, world, f"param.{q.name}", q, a, b, local).view(local.shape))
    if "buffers" in index:  # (format 3 held none: the buffers stay as they are)
        buffers = _buffers(model)
        saved = _read_buffers(directory, world, [name for name, _ in buffers])
        for name, buf in buffers:
            buf.copy_(saved[name].to(buf.dtype))
    if optimizer is not None:
        optimizer.load_state_dict(_optimizer_state(engine, optimizer, index, directory, world))
    _barrier(engine)


def _read_buffers(directory: Path, world: int, names: list[str]) -> dict[str, torch.Tensor]:
    """The saved buffers (rank 0's file), by name."""
    path = _rank_file(directory, 0, world)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(f"buffer.{name}") for name in names}
    except (SafetensorError, OSError) as e:  # checked before, so only a file changed meanwhile
        raise CheckpointError(f"sharded checkpoint file {path} cannot be read: {one_line(e)}") from e


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
    return {"state": state, "param_groups": _groups(saved)}



@torch.no_grad()
def consolidate_sharded(directory: str | os.PathLike) -> dict[str, Any]:
    """A :func:`save_sharded` checkpoint whole, in this process (no process group needed): ``{"model": state dict,
    "optimizer": state dict}`` (``"optimizer"`` when one was saved), as an unsharded model's and optimizer's, to
    ``load_state_dict`` into a plain module and its optimizer.

    Raises:
        FileNotFoundError: no finished checkpoint in ``directory``.
        CheckpointError: ``directory`` holds another kind of checkpoint, or its index or a rank file is damaged,
            truncated, foreign or missing.
    """
    directory = Path(directory)
    index = verify_sharded(directory)
    world = int(index["world_size"])
    layout = []
    for entry in index["params"]:
        shape = torch.Size(entry["shape"])
        per_rank = 1 if not shape else math.ceil(shape[0] / world)
        layout.append(UnitParam(entry["name"], [], shape, per_rank, 0, (entry["name"],)))
    like = {q.name: torch.empty(0, dtype=getattr(torch, e["dtype"])) for q, e in zip(layout, index["params"])}
    model = {q.name: _read(directory, world, f"param.{q.name}", q, 0, q.rows, like[q.name]).view(q.shape)
             for q in layout}
    if "buffers" in index:
        model.update(_read_buffers(directory, world, [b["name"] for b in index["buffers"]]))
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
        out["optimizer"] = {"state": state, "param_groups": _groups(saved)}
    return out

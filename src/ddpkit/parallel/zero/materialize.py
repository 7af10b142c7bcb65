"""A model built on the meta device, materialised by ZeRO stage 3 one unit at a time, each rank keeping its shard.

A model too large for one rank is built without memory (``with
torch.device("meta"): model = Net()``) and wrapped with
``DistributedDataParallel(model, zero_stage=3)``. The wrapping initialises it
as ``model.apply(init)`` would, children before their parent (default:
each module's own ``reset_parameters()``, or ``_reset_parameters()``, which
is what torch's modules run when they are built), on ``device``:

* the root unit's parameters are made whole first and kept so until the walk ends (the root's modules are
  visited before, between and after the units);
* each unit's parameters are made whole when the walk enters the unit's module, initialised with the rest of
  its subtree, sent from rank 0 (as DDP's construction broadcast sends every rank rank 0's model), cut to
  this rank's rows, and let go;
* buffers are made where they are, initialised by the same calls, and sent from rank 0.

So no rank holds more than the root unit, one unit and its shards at once, and
with the same seed the parameters are bit for bit those of the same model
built whole (the same random draws, in the same order, as torch's modules make
them when built), then wrapped. Code that initialises a parent's parameters
from outside (a model-level ``init_weights()`` reaching into its blocks) is
given as ``init`` (called on every module, as ``model.apply`` calls it); a
module with parameters or buffers and nothing that initialises them is
refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddpkit.parallel.common.broadcast import broadcast_once
from ddpkit.parallel.zero.placement import home
from ddpkit.parallel.zero.units import Unit

__all__ = ["CHUNK_BYTES", "materialize"]

CHUNK_BYTES = 25 * 1024 * 1024
"""The largest message of the broadcasts from rank 0 (a unit goes in several when larger)."""


def materialize(engine: Any, init: Any, device: torch.device) -> None:
    """Initialise ``engine``'s meta-device model on ``device`` unit by unit (see the module notes)."""
    module: nn.Module = engine.module
    names = {id(m): n or "(the model)" for n, m in module.named_modules(remove_duplicate=False)}
    unit_of = {id(u.module): u for u in engine.units if u.name}
    on_meta = {id(m) for m in module.modules()
               if any(t is not None and t.is_meta for t in [*m._parameters.values(), *m._buffers.values()])}
    root = engine.root
    if root is not None:
        _whole(root, device)

    def visit(m: nn.Module) -> None:
        unit = unit_of.get(id(m))
        if unit is not None:
            _whole(unit, device)
        for child in m.children():
            visit(child)
        _buffers(m, device)
        _init(m, init, id(m) in on_meta, names.get(id(m), type(m).__name__), engine.owner)
        if unit is not None:
            _shard(engine, unit, device)

    with torch.no_grad():
        visit(module)
        if root is not None:
            _shard(engine, root, device)
        buffers = list(module.buffers())
        if engine.world_size > 1 and buffers:
            broadcast_once(buffers, engine.group, "buffers of the materialised model", chunk_bytes=CHUNK_BYTES)


def _whole(u: Unit, device: torch.device) -> None:
    """The unit's parameters whole (uninitialised) on ``device``, registered where the modules look."""
    for q in u.params:
        p = q.param
        whole = nn.Parameter(torch.empty(q.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
        for m, attr in q.owners:
            m._parameters[attr] = whole


def _buffers(m: nn.Module, device: torch.device) -> None:
    """``m``'s own meta buffers made (uninitialised) on ``device``."""
    for name, b in m._buffers.items():
        if b is not None and b.is_meta:
            m._buffers[name] = torch.empty_like(b, device=device)


def _init(m: nn.Module, init: Any, meta: bool, name: str, owner: str) -> None:
    if init is not None:
        init(m)
        return
    reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
    if callable(reset):
        reset()
    elif meta:
        raise ValueError(f"{owner}(zero_stage=3): module {name!r} ({type(m).__name__}) was built on the meta device "
                         "and has no reset_parameters() to initialise its parameters and buffers: give "
                         "zero_init=fn, a function that initialises one module (called on every module, children "
                         "first, as model.apply calls it)")


def _shard(engine: Any, u: Unit, device: torch.device) -> None:
    """The unit's whole parameters sent from rank 0, cut to this rank's rows, and let go."""
    wholes = [q.param for q in u.params]
    if engine.world_size > 1:
        broadcast_once([w.detach() for w in wholes], engine.group, f"unit {u.name or '(root)'} materialised",
                       chunk_bytes=CHUNK_BYTES)
    home(u, wholes, engine.mesh, engine.rank)
    u.full = torch.empty(u.full.numel(), dtype=u.full.dtype, device=device)
    u.full.untyped_storage().resize_(0)

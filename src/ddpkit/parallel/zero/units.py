"""ZeRO stage 3's units: which modules are gathered together, where each parameter's elements are, and the
helpers the engine (:mod:`ddpkit.parallel.zero.stage3`) and the wrapper share."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.comm.direct import direct_all_gather, direct_reduce_scatter
from ddpkit.runtime.compat import all_gather_tensor, reduce_scatter_tensor
from ddpkit.runtime.devices import comm_device, comm_tensor

__all__ = [
    "CONTAINERS",
    "Launched",
    "Unit",
    "UnitParam",
    "all_gather_flat",
    "cast_floats",
    "clip_grad_norm",
    "find_units",
    "flatten_grads",
    "grad_norm",
    "make_units",
    "reduce_scatter_flat",
    "segment",
    "settle",
    "tensors_in",
]

CONTAINERS = (nn.Sequential, nn.ModuleList)
"""The containers whose children are the default units."""


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def find_units(module: nn.Module, classes: Sequence[type[nn.Module]] | None = None) -> list[tuple[str, nn.Module]]:
    """The units of ``module`` as ``(qualified name, module)``, in registration order (see the module notes).

    ``classes``: every outermost module of one of these classes is a unit
    (``None``: the children of the outermost ``Sequential``/``ModuleList``
    containers). Units never nest.
    """
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, parent: nn.Module) -> None:
        container = classes is None and isinstance(parent, CONTAINERS)
        for name, child in parent.named_children():
            qualified = f"{prefix}{name}"
            unit = isinstance(child, tuple(classes)) if classes is not None else container
            if unit:
                if _holds_parameters(child):
                    found.append((qualified, child))
            else:
                visit(qualified + ".", child)

    if classes is not None and isinstance(module, tuple(classes)):
        raise ValueError(f"zero_units={tuple(c.__name__ for c in classes)}: the whole model is a "
                         f"{type(module).__name__}, so it would be one unit gathered whole; name the classes of its "
                         "blocks instead")
    visit("", module)
    return found


@dataclass
class UnitParam:
    """One parameter of a unit: where it is used, and where its elements are."""

    name: str
    param: nn.Parameter
    owners: list[tuple[nn.Module, str]]
    shape: torch.Size
    offset: int
    """First element in the unit's flat layout."""
    names: tuple[str, ...] = ()
    """Every qualified name it is registered under, :attr:`name` first (a tied weight has several)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Unit:
    """A group of parameters gathered together (see the module notes)."""

    index: int
    name: str
    """Qualified name of the unit's module in the model; ``""`` for the root unit."""
    module: nn.Module
    params: list[UnitParam]
    chunk: int
    """Elements of the shard on every rank."""
    shard: torch.Tensor
    full: torch.Tensor
    requires_grad: bool
    """Whether any of its parameters is trained (a unit may mix frozen and trained ones)."""
    work: Any = None
    """The all-gather in flight into :attr:`full`."""
    gathered: bool = False
    ran: bool = False
    """Its forward ran since the last synchronised backward ended."""
    reduced: bool = False
    pending: list[tuple[torch.Tensor, Any]] = field(default_factory=list)
    """Reductions in flight: (buffer, work)."""
    expected: int = 0
    """Gradients this iteration's forwards will give its parameters (one per parameter per forward)."""
    grads: list[torch.Tensor | None] = field(default_factory=list)
    """The gradients arrived so far, per parameter, whole."""
    arrived: int = 0
    acc: torch.Tensor | None = None
    """The unit's flat gradient accumulated outside synchronisation (``no_sync``), or held for the end of
    backward (``find_unused_parameters``)."""

    @property
    def nbytes(self) -> int:
        return self.full.numel() * self.full.element_size()


def grad_norm(grads: Iterable[torch.Tensor], norm_type: float, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The ``norm_type``-norm of the gradients whose pieces ``grads`` are spread over the ranks of ``group``.

    Each rank passes its own pieces (disjoint across ranks); the result is the
    norm of their union, the same on every rank (a collective).
    """
    grads = [g for g in grads if g is not None and g.numel()]
    inf = math.isinf(norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    if inf:
        local = max((g.detach().abs().max().float() for g in grads), default=torch.zeros((), device=device))
    else:
        local = sum((g.detach().float().norm(norm_type) ** norm_type for g in grads),
                    torch.zeros((), device=device))
    if group is not None and dist.get_world_size(group) > 1:
        total = comm_tensor([float(local)], torch.float64, group)
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        local = total[0].to(device=device, dtype=torch.float32)
    return local if inf else local ** (1.0 / norm_type)


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating tensors (in tuples, lists and dicts too) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a module's output (tensors, and tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def make_units(module: nn.Module, named: list[tuple[str, nn.Module]], *, owner: str, rank: int, world_size: int,
               param_dtype: torch.dtype | None) -> list[Unit]:
    """The root unit (index 0, when it holds parameters), then one unit per module of ``named``; every parameter
    of ``module`` becomes a view of this rank's shard (see :mod:`ddpkit.parallel.zero.stage3`)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    names: dict[int, list[str]] = {}
    unit_of: dict[int, int] = {}
    unit_modules = {id(m): k + 1 for k, (_, m) in enumerate(named)}
    params: dict[int, nn.Parameter] = {}

    def walk(prefix: str, m: nn.Module, unit: int) -> None:
        unit = unit_modules.get(id(m), unit)
        for attr, p in m._parameters.items():
            if p is None:
                continue
            key = id(p)
            owners.setdefault(key, []).append((m, attr))
            names.setdefault(key, []).append(f"{prefix}{attr}")
            params[key] = p
            if unit_of.setdefault(key, unit) != unit:
                where = [("the root unit" if u == 0 else f"unit {named[u - 1][0]!r}") for u in (unit_of[key], unit)]
                raise ValueError(f"{owner}(zero_stage=3): parameter {names[key][0]!r} is shared by {where[0]} and "
                                 f"{where[1]}; a unit's parameters are gathered with it alone, so a shared one "
                                 "must live in one unit: choose units (zero_units=...) that hold both users, or "
                                 "untie it")
        for child_name, child in m._modules.items():
            if child is not None:
                walk(f"{prefix}{child_name}.", child, unit)

    walk("", module, 0)
    by_unit: list[list[int]] = [[] for _ in range(len(named) + 1)]
    for key in params:  # registration order (dicts keep insertion order)
        by_unit[unit_of[key]].append(key)
    units = []
    # The root unit first (index 0) when it holds parameters, then the units in registration order.
    for u, keys in enumerate(by_unit):
        if not keys:
            continue
        name, unit_module = ("", module) if u == 0 else named[u - 1]
        members = [(names[k], params[k], owners[k]) for k in keys]
        units.append(_make_unit(len(units), name, unit_module, members, owner, rank, world_size, param_dtype))
    return units

def _make_unit(index: int, name: str, module: nn.Module,
               members: list[tuple[list[str], nn.Parameter, list[tuple[nn.Module, str]]]], owner: str, rank: int,
               world_size: int, param_dtype: torch.dtype | None) -> Unit:
    dtypes = {p.dtype for _, p, _ in members}
    devices = {p.device for _, p, _ in members}
    if len(dtypes) > 1 or len(devices) > 1:
        kinds = [f"{what} {', '.join(sorted(map(str, found)))}" for what, found in (("dtypes", dtypes),
                                                                                      ("devices", devices))
                 if len(found) > 1]
        raise ValueError(f"{owner}(zero_stage=3): unit {name or '(root)'!r} holds parameters of {' and '.join(kinds)}; "
                         "a unit's parameters share one flat buffer: give them one dtype and one device, or put "
                         "each kind in units of its own (zero_units=...)")
    first = members[0][1]
    layout, offset = [], 0
    for aliases, p, where in members:
        n = aliases[0]
        if p.is_sparse or isinstance(where[0][0], (nn.Embedding, nn.EmbeddingBag)) and getattr(where[0][0],
                                                                                            "sparse", False):
            raise ValueError(f"{owner}(zero_stage=3) cannot shard the sparse gradient of {n!r}: use a "
                             "sparse=False embedding")
        layout.append(UnitParam(n, p, where, p.shape, offset, tuple(aliases)))
        offset += p.numel()
    chunk = max(1, math.ceil(offset / world_size))
    low = rank * chunk
    with torch.no_grad():
        # Only this rank's chunk is made (the padding zeros): the whole unit is never flattened twice.
        shard = torch.zeros(chunk, dtype=first.dtype, device=first.device)
        for q in layout:
            a, z = max(q.offset, low), min(q.offset + q.numel, low + chunk)
            if a < z:
                shard[a - low: z - low].copy_(q.param.detach().reshape(-1)[a - q.offset: z - q.offset])
        for q in layout:
            a, z = max(q.offset, low), min(q.offset + q.numel, low + chunk)
            q.param.data = shard[a - low: z - low] if a < z else shard[:0]
    full = torch.empty(chunk * world_size, dtype=param_dtype or first.dtype, device=first.device)
    full.untyped_storage().resize_(0)  # gathered when first needed
    return Unit(index, name, module, layout, chunk, shard, full, any(p.requires_grad for _, p, _ in members))


def segment(q: UnitParam, chunk: int, rank: int) -> tuple[int, int] | None:
    """``q``'s elements in rank ``rank``'s chunk, relative to the chunk (``None``: none)."""
    low = rank * chunk
    a, z = max(q.offset, low), min(q.offset + q.numel, low + chunk)
    return (a - low, z - low) if a < z else None


@torch.no_grad()
def clip_grad_norm(grads: list[torch.Tensor], max_norm: float, norm_type: float,
                   group: dist.ProcessGroup | None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over gradients whose pieces are spread over ``group``'s ranks.

    Each rank passes its own pieces (disjoint across ranks: stage 3's segments, stage 2's gradient shards); the
    norm is the whole model's (a collective: call it on every rank), and every piece is scaled by torch's rule,
    ``max_norm / (norm + 1e-6)`` when that is below 1. Returns the norm.
    """
    norm = grad_norm(grads, float(norm_type), group)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return norm


class _Done:
    """A finished collective, for a caller that waits on what it was given (or on its future)."""

    def wait(self) -> bool:
        return True

    @staticmethod
    def get_future() -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future


def _staged(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether ``tensor`` goes through the CPU for ``group``: gloo with CUDA tensors (its CUDA paths are not
    every collective's, and ddpkit's stage 2 met "Bad address" there)."""
    return tensor.is_cuda and dist.get_backend(group) == "gloo"


def all_gather_flat(out: torch.Tensor, src: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> Any:
    """``out`` (flat, ``W`` times ``src``) made of every rank's ``src``; a work to wait on when ``async_op``.

    NCCL's all-gather; on gloo direct messages (:mod:`ddpkit.comm.direct`), through the CPU for CUDA tensors.
    """
    if _staged(src, group):
        staged = torch.empty(out.shape, dtype=out.dtype, device=comm_device(group))  # gloo's: the CPU
        direct_all_gather(staged, src.to(comm_device(group)), group).wait()
        out.copy_(staged)
        return _Done() if async_op else None
    if dist.get_backend(group) == "gloo":
        work = direct_all_gather(out, src, group)
    else:
        work = all_gather_tensor(out, src, group=group, async_op=True)
    if async_op:
        return work
    work.wait()
    return None


def reduce_scatter_flat(out: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup) -> Any:
    """Start summing ``flat`` over the ranks into ``out``, this rank's chunk of the sum; a work to wait on.

    NCCL's reduce-scatter; on gloo direct messages (:mod:`ddpkit.comm.direct`), through the CPU for CUDA
    tensors (synchronously).
    """
    if _staged(flat, group):
        staged = torch.empty(out.shape, dtype=out.dtype, device=comm_device(group))
        direct_reduce_scatter(staged, flat.to(comm_device(group)), group).wait()
        out.copy_(staged)
        return _Done()
    if dist.get_backend(group) == "gloo":
        return direct_reduce_scatter(out, flat, group)
    return reduce_scatter_tensor(out, flat, group=group, async_op=True)


@torch.no_grad()
def flatten_grads(u: Unit, dtype: torch.dtype) -> torch.Tensor:
    """The unit's gradients so far as one flat tensor in ``dtype`` (added to what it accumulated), zeros for a
    parameter without one and for the padding; the unit's gradients are let go."""
    flat, add = (u.acc, True) if u.acc is not None else (
        torch.empty(u.full.numel(), dtype=dtype, device=u.full.device), False)
    total = 0
    for q, grad in zip(u.params, u.grads or [None] * len(u.params)):
        piece = flat[q.offset: q.offset + q.numel]
        if grad is not None:
            piece.add_(grad.reshape(-1)) if add else piece.copy_(grad.reshape(-1))
        elif not add:
            piece.zero_()
        total = q.offset + q.numel
    if not add:
        flat[total:].zero_()
    u.acc, u.grads, u.arrived, u.expected = None, [None] * len(u.params), 0, 0
    return flat


@torch.no_grad()
def settle(u: Unit, rank: int) -> None:
    """Wait for the unit's reductions and add this rank's chunk of each into its parameters' ``.grad``."""
    for chunk, work in u.pending:
        if work is not None:
            work.wait()
        if chunk.numel() != u.chunk:
            chunk = chunk[rank * u.chunk: (rank + 1) * u.chunk]
        for q in u.params:
            if not q.param.requires_grad:
                continue  # frozen: its .grad stays as it is (None), as under DDP
            seg = segment(q, u.chunk, rank)
            piece = chunk[seg[0]: seg[1]] if seg else chunk[:0]
            if q.param.grad is None:
                q.param.grad = piece.to(q.param.dtype, copy=True)
            else:
                q.param.grad.add_(piece)
    u.pending = []


@dataclass
class Launched:
    """What an observer's launch and done events need of a reduction in flight (a bucket's part)."""

    unit: int
    work: Any
    future: Any = None

    def index(self) -> int:
        return self.unit

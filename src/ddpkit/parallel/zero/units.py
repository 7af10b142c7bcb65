"""ZeRO stage 3's units: which modules are gathered together, and how each parameter is cut over the ranks.

Units
    By default each child holding parameters of the outermost
    ``nn.Sequential``/``nn.ModuleList`` containers (the blocks of a
    transformer, the residual blocks of a ResNet), or every outermost module of
    the classes given as ``zero_units`` (FSDP's wrapping policy). The
    parameters outside every unit form the *root unit*. Units never nest, and a
    parameter shared by two units is refused by name.
Parameters
    Each parameter is cut along its first dimension as ``torch.chunk`` cuts it
    (FSDP2's layout): rank ``r`` holds rows ``r * c`` to ``(r + 1) * c`` of it,
    ``c = ceil(rows / W)`` (the last ranks may hold fewer rows, or none). A
    parameter with no dimension (a learned temperature) is held whole by every
    rank and averaged like the rest. How a rank holds its rows (as the model's
    parameter, a ``DTensor``) is :mod:`ddpkit.parallel.zero.placement`'s.
The unit's flat layouts
    A rank's *part* of a unit is its rows of each parameter, each padded to
    ``c`` rows (:attr:`UnitParam.piece` elements, at :attr:`UnitParam.offset`):
    the small parameters first, in registration order (one all-gather and one
    reduce-scatter move them together), then each large one
    (:data:`SEPARATE_BYTES`), moved by collectives of its own. The gathered
    unit (:attr:`Unit.full`) holds each parameter whole and contiguous, at
    ``W * offset``, padded to ``W * piece``: a large parameter's all-gather
    lands there as it is (the ranks' rows in rank order are the parameter),
    the small ones' are laid out from a staging buffer.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ddpkit.runtime.states import check_move

__all__ = [
    "CONTAINERS",
    "SEPARATE_BYTES",
    "RESIDENCY_MOVES",
    "Launched",
    "Residency",
    "Unit",
    "UnitParam",
    "find_units",
    "make_units",
]

CONTAINERS = (nn.Sequential, nn.ModuleList)
"""The containers whose children are the default units."""
SEPARATE_BYTES = 4 << 20
"""A parameter this large (whole) is gathered and reduced on its own: one collective more, and no copy of it.
Measured (``ddpkit bench --zero``, world 4, transformer of 1 MiB matrices): at 1 MiB the collectives more cost more
than the copies they save (1.44 x DDP's step against 1.35 x at 4 MiB); the MLP's 86 MB matrix gains either way."""


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


@dataclass(eq=False)
class UnitParam:
    """One parameter of a unit: where it is registered, its true shape, and where its elements are."""

    name: str
    owners: list[tuple[nn.Module, str]]
    """Every (module, attribute) it is registered under (a tied weight has several)."""
    shape: torch.Size
    rows_per_rank: int
    """Rows of it each rank holds, padded (``ceil(rows / W)``; 1 for a parameter with no dimension)."""
    offset: int
    """Where its piece starts in a rank's part of the unit (elements)."""
    names: tuple[str, ...] = ()
    """Every qualified name it is registered under, :attr:`name` first."""
    separate: bool = False
    """Large (:data:`SEPARATE_BYTES` or more): gathered and reduced alone, its all-gather landing in its place of
    :attr:`Unit.full` and its reduce-scatter reading its gradient as it is (no copy either way)."""
    leaf: torch.Tensor | None = field(default=None, repr=False)
    """The tensor its modules compute with while the unit is gathered (a view of :attr:`Unit.full`, kept for
    the engine's life: the leaf autograd accumulates its gradient into)."""
    accumulated: torch.Tensor | None = field(default=None, repr=False)
    """Its whole gradient summed over backwards that did not reduce it, in the reduce dtype where that is not the
    leaf's (FSDP2's ``unsharded_accumulated_grad``: bf16 micro-batches add up in fp32); ``None`` otherwise."""

    @property
    def replicated(self) -> bool:
        """It has no dimension to cut: every rank holds it whole."""
        return len(self.shape) == 0

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row(self) -> int:
        """Elements per row."""
        return math.prod(self.shape[1:])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def piece(self) -> int:
        """Elements of each rank's padded piece."""
        return self.rows_per_rank * self.row

    def local_rows(self, rank: int) -> tuple[int, int]:
        """The rows rank ``rank`` holds (``torch.chunk``'s cut)."""
        if self.replicated:
            return 0, 1
        start = min(rank * self.rows_per_rank, self.rows)
        return start, min(start + self.rows_per_rank, self.rows)

    def local_shape(self, rank: int) -> torch.Size:
        if self.replicated:
            return torch.Size()
        a, b = self.local_rows(rank)
        return torch.Size((b - a, *self.shape[1:]))

    @property
    def param(self) -> nn.Parameter:
        """The parameter as its first module holds it now (``load_state_dict(assign=True)``, ``to_empty`` or an
        assignment may have replaced the object given at wrapping)."""
        module, attr = self.owners[0]
        return module._parameters[attr]  # type: ignore[return-value]


class Residency(enum.Enum):
    """Where a unit's whole parameters stand (FSDP2's sharded state); its moves are :data:`RESIDENCY_MOVES`."""

    FREED = "freed"
    """Only this rank's shards: :attr:`Unit.full` holds no memory and the modules see the shards."""
    GATHERING = "gathering"
    """Its all-gathers are in flight into :attr:`Unit.full` (:attr:`Unit.work`); waited for before it is read."""
    GATHERED = "gathered"
    """Whole in :attr:`Unit.full`, landed: its modules may compute with it."""


RESIDENCY_MOVES: dict[Residency, frozenset[Residency]] = {
    # Freeing is idempotent (the end of backward frees every unit); a world of one gathers at once (a copy).
    Residency.FREED: frozenset({Residency.FREED, Residency.GATHERING, Residency.GATHERED}),
    Residency.GATHERING: frozenset({Residency.GATHERED, Residency.FREED}),  # landed; or freed (waited for first)
    Residency.GATHERED: frozenset({Residency.FREED}),
}
"""The moves of a unit's :class:`Residency`; any other is a bug (:meth:`Unit.become` raises)."""


@dataclass(eq=False)
class Unit:
    """A group of parameters gathered together (see the module notes), and its state in one backward."""

    index: int
    name: str
    """Qualified name of the unit's module in the model; ``""`` for the root unit."""
    module: nn.Module
    params: list[UnitParam]
    part_numel: int
    """Elements of a rank's part (every rank's is this long)."""
    full: torch.Tensor = field(repr=False)
    small: int = 0
    """Elements of a rank's part taken by the parameters that are not :attr:`UnitParam.separate` (first in it)."""
    """The gathered unit (its storage is given back when it is freed: printing it then would read freed memory)."""
    dtype: torch.dtype = torch.float32
    """The parameters' dtype (the shards'; ``param_dtype`` is what they are gathered in)."""
    device: torch.device = torch.device("cpu")
    """The parameters' device."""
    part: torch.Tensor | None = field(default=None, repr=False)
    homed: list[torch.Tensor] = field(default_factory=list, repr=False)
    """The parameter objects last found to live in :attr:`part` (checked again only when one is replaced)."""
    """This rank's part, whose views the parameters' local tensors are (so the all-gather sends it as it is);
    ``None`` once a parameter was replaced by one of its own memory (then each gather copies the part)."""
    work: Any = field(default=None, repr=False)
    """The all-gather in flight into :attr:`full`."""
    staged: torch.Tensor | None = field(default=None, repr=False)
    """Where that all-gather lands, when it cannot land in :attr:`full` itself (several parameters)."""
    residency: Residency = Residency.FREED
    """Changed by :meth:`become` only."""
    hooked: set[int] = field(default_factory=set)
    """The leaves that carry the engine's gradient hook."""
    open_calls: set[int] = field(default_factory=set)
    """Forward calls whose backward has begun and not yet reached the call's inputs."""
    arrived: set[int] = field(default_factory=set)
    """The parameters whose gradient autograd has accumulated in this backward."""
    expect: set[int] = field(default_factory=set)
    """The trained parameters, as the first gradient of :attr:`arrived` found them."""
    pending: list[tuple[torch.Tensor, Any, list[bool]]] = field(default_factory=list, repr=False)
    """Reductions in flight: (this rank's part of the sum, work, which parameters had a gradient here)."""
    reduce_grads: bool = True
    """Its backwards reduce (FSDP2's ``set_requires_gradient_sync``, read when its gradients are in); off, they
    accumulate whole (in its leaves, or :attr:`UnitParam.accumulated`), as under ``no_sync()``."""
    no_sync_sums: bool = False
    """Its accumulated gradients include a backward of a forward run under ``no_sync()``: the wrapper's
    ``zero_grad()`` drops them, as DDP's drops its local sums (FSDP2's switch alone: they stay, as FSDP2's)."""

    @property
    def nbytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    def become(self, residency: Residency) -> None:
        """Move :attr:`residency` (the only place it changes; :data:`RESIDENCY_MOVES` says which moves exist)."""
        check_move(RESIDENCY_MOVES, self.residency, residency, f"zero-3 unit {self.index} ({self.name or 'root'})")
        self.residency = residency

    @functools.cached_property
    def small_params(self) -> list[tuple[int, UnitParam]]:
        """The parameters that are not :attr:`UnitParam.separate`, in the order of their offsets."""
        return sorted(((i, q) for i, q in enumerate(self.params) if not q.separate), key=lambda iq: iq[1].offset)

    @property
    def trained(self) -> list[int]:
        """The parameters that take a gradient now (``requires_grad`` may change after wrapping)."""
        return [i for i, q in enumerate(self.params) if q.param.requires_grad]

    def whole_view(self, q: UnitParam, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """``q`` whole as a view of ``buffer`` laid out as :attr:`full` (default :attr:`full`)."""
        buffer = self.full if buffer is None else buffer
        start = (buffer.numel() // self.part_numel) * q.offset
        return buffer[start: start + q.numel].view(q.shape)


def _walk(module: nn.Module, named: list[tuple[str, nn.Module]], owner: str
          ) -> tuple[list[list[nn.Parameter]], dict[int, list[tuple[nn.Module, str]]], dict[int, list[str]]]:
    """Each unit's parameters (the root unit first) in registration order, and where each is registered."""
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
    by_unit: list[list[nn.Parameter]] = [[] for _ in range(len(named) + 1)]
    for key, p in params.items():  # registration order (dicts keep insertion order)
        by_unit[unit_of[key]].append(p)
    return by_unit, owners, names


def make_units(module: nn.Module, named: list[tuple[str, nn.Module]], *, owner: str, world_size: int,
               param_dtype: torch.dtype | None) -> list[Unit]:
    """The root unit (index 0, when it holds parameters), then one unit per module of ``named``, each laid out
    for ``world_size`` ranks (see the module notes); the parameters are still the module's own, until
    :func:`ddpkit.parallel.zero.placement.home` makes them this rank's shards."""
    by_unit, owners, names = _walk(module, named, owner)
    units = []
    for u, members in enumerate(by_unit):
        if not members:
            continue
        name, unit_module = ("", module) if u == 0 else named[u - 1]
        _check_kinds(name, members, owner)
        layout = []
        for p in members:
            if p.is_sparse or any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and getattr(m, "sparse", False)
                                  for m, _ in owners[id(p)]):
                raise ValueError(f"{owner}(zero_stage=3) cannot shard the sparse gradient of {names[id(p)][0]!r}: "
                                 "use a sparse=False embedding")
            rows = p.shape[0] if p.dim() else 1
            layout.append(UnitParam(names[id(p)][0], owners[id(p)], p.shape,
                                    1 if p.dim() == 0 else math.ceil(rows / world_size), 0, tuple(names[id(p)]),
                                    separate=p.dim() > 0 and p.numel() * p.element_size() >= SEPARATE_BYTES))
        # The small parameters first, together (one all-gather, one reduce-scatter), then each large one alone.
        offset = 0
        for q in [q for q in layout if not q.separate] + [q for q in layout if q.separate]:
            q.offset = offset
            offset += q.piece
        small = sum(q.piece for q in layout if not q.separate)
        part_numel = max(offset, 1)
        first = members[0]
        full = torch.empty(part_numel * world_size, dtype=param_dtype or first.dtype, device=first.device)
        if not full.is_meta:
            full.untyped_storage().resize_(0)  # gathered when first needed
        units.append(Unit(len(units), name, unit_module, layout, part_numel, full, small=small))
    return units


def _check_kinds(name: str, members: list[nn.Parameter], owner: str) -> None:
    dtypes = {p.dtype for p in members}
    devices = {p.device for p in members}
    if len(dtypes) > 1 or len(devices) > 1:
        kinds = [f"{what} {', '.join(sorted(map(str, found)))}" for what, found in (("dtypes", dtypes),
                                                                                      ("devices", devices))
                 if len(found) > 1]
        raise ValueError(f"{owner}(zero_stage=3): unit {name or '(root)'!r} holds parameters of {' and '.join(kinds)}"
                         "; a unit's parameters share one flat buffer: give them one dtype and one device, or put "
                         "each kind in units of its own (zero_units=...)")


@dataclass
class Launched:
    """What an observer's launch and done events need of a reduction in flight (a bucket's part)."""

    unit: int
    work: Any
    future: Any = None

    def index(self) -> int:
        return self.unit

"""ZeRO stage 3: the parameters sharded too, gathered unit by unit for forward and for backward.

:class:`ShardedParameters` is the engine of ``DistributedDataParallel(module,
zero_stage=3)`` (it stands where stage 0's and stage 2's reducer stand). The
units and the layout of the shards are :mod:`ddpkit.parallel.zero.units`'s;
gathering and freeing, :mod:`ddpkit.parallel.zero.gathering`'s.

Parameters
    Every parameter of the model becomes a ``DTensor`` of its true shape
    holding this rank's rows, so any torch optimizer built over
    ``model.parameters()`` *after wrapping* steps this rank's shard (an
    optimizer built before holds the replaced tensors: its first step is
    refused by name), ``torch.nn.utils.clip_grad_norm_`` and
    ``clip_grad_value_`` act on the whole model's gradient, and torch's
    ``GradScaler`` finds an overflow on any rank on every rank.
Forward
    Before a unit's forward its shards are all-gathered and its modules see
    the whole parameters (the unit's *leaves*); the next unit's all-gather is
    started at the same time (prefetch, in the order of the previous forward).
    After the forward the unit is freed (``reshard_after_forward=True``, the
    default; the last unit, the first of the backward, is kept) or kept until
    its backward. A forward without grad gathers and frees alike.
Backward, as autograd runs it
    A hook on a unit's outputs gathers it again when the first gradient
    reaches them; an autograd function on its inputs frees it when the
    gradient has gone through it to them (FSDP2's pre- and post-backward), so
    a frozen unit is freed after its backward use, as a trained one is. The
    leaves are the same tensors in every forward, so autograd itself adds the
    gradients of several forwards, or of a second backward, into them. A unit
    is reduced as soon as every trained parameter of it has its gradient for
    this backward: averaged (pre-scaled by ``1/W`` as DDP's gradients are) in
    ``reduce_dtype`` and reduce-scattered asynchronously while backward goes
    on, the units going out in one order on every rank (the last unit first,
    the root unit last; a ready unit waits for those before it). At the end of
    backward (autograd's queued callback) what is left is reduced, every
    reduction waited for, and each parameter's ``.grad`` (a ``DTensor`` of
    its rows) gets this rank's rows of the average, added to what it held.
Which backwards synchronise
    A backward after a forward run outside ``no_sync()`` (as DDP decides it).
    A pass in which no parameter's gradient is accumulated
    (``torch.autograd.grad``) is not one. A second backward through the same
    graph (``retain_graph=True``) reduces its gradients too, added to the
    first's: DDP adds them locally without averaging, which would leave each
    rank's shard with other ranks' rows of a different sum (FSDP2 reduces them
    as this engine does).
``no_sync``
    Outside synchronisation the gradients accumulate whole in the leaves (one
    unit's parameters each: the documented cost), and the next synchronised
    backward reduces the sum. Where ``reduce_dtype`` is not ``param_dtype``
    each backward's gradients are added up in ``reduce_dtype`` instead, as
    FSDP2 does: in fp32 with bf16 compute and an fp32 reduction (not in bf16),
    and in bf16 with fp32 parameters and a bf16 reduction.
    The sums are kept as each unit's gradients are complete, as FSDP2's
    post-backward keeps them (so at most one unit's gradient in
    ``param_dtype`` waits beside them).
``set_requires_gradient_sync``
    FSDP2's switch, beside DDP's ``no_sync()``: off (for every unit, or the
    root unit alone with ``recurse=False``), a unit's gradients accumulate
    whole as under ``no_sync()``; on, its next backward reduces the sum. As
    under FSDP2 it is read in backward, when the unit's gradients are in, not
    at the forward: a forward run with it on, then a micro-batch with it off,
    then the first forward's backward with it on again reduces both. A
    backward reduces a unit when the last forward before it ran outside
    ``no_sync()`` and the unit's switch is on. The wrapper's ``zero_grad()``
    drops the sums of a ``no_sync()`` accumulation, as DDP's does, and keeps
    those made with the switch off alone, as FSDP2 keeps its own (they are not
    the parameters' ``.grad``). The units are still gathered at each forward,
    and rank 0's buffers broadcast at each forward outside ``no_sync()``.
Unused parameters
    Without ``find_unused_parameters``, a trained parameter that gets no
    gradient in a synchronised backward is reduced as zeros (so no rank
    waits) and the backward raises, naming it, as DDP's does. With it, the
    units whose gradients are complete still go out during backward, the rest
    at its end (zeros for what this rank lacks), and one all-reduce of the
    ranks' used-parameter maps decides: a parameter no rank used keeps its
    ``.grad`` (``None`` stays ``None``), one used somewhere gets the average.
    Only the units some parameter of which went unused hold their whole
    gradients to the end of backward.
Activation checkpointing
    A recomputation in backward (around a unit, inside it, or of a root
    module; reentrant or not) sees the unit gathered, with the same leaves.
    Checkpointing the whole wrapped model (its root's forward) is not
    supported: checkpoint its units.
Mixed precision
    ``param_dtype`` (e.g. ``torch.bfloat16``): the shards stay in their dtype
    (fp32), the units are gathered in ``param_dtype``, so forward and backward
    compute in it; ``reduce_dtype`` (default ``param_dtype``, as FSDP2's
    ``MixedPrecisionPolicy``) is the dtype the gradients are averaged in.
Meta-device models
    See :mod:`ddpkit.parallel.zero.materialize`: a model built on the meta
    device is materialised unit by unit, this rank keeping its shard.

States
    Where the backward stands is a :class:`Backward` (idle, begun,
    accumulating, and *held* after a backward that gave no gradient), a
    unit's memory a :class:`~ddpkit.parallel.zero.units.Residency` (freed,
    gathering, gathered); each moves by one function, along its table of
    moves. Whether the backwards of the last forward synchronise
    (:attr:`ShardedParameters.armed`) is the forward's setting, as DDP's
    ``require_backward_grad_sync``, not a state of the backward.

Observers (:meth:`ShardedParameters.add_observer`) see each unit's reduction
as a bucket's. Refused, each with the reason: a comm hook, ``static_graph``,
``gradient_as_bucket_view``, ``join()``, sparse gradients.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import re
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from ddpkit.parallel.common.observer import Observer, ObserverHandle, Observers
from ddpkit.parallel.common.unused import UnusedParametersError
from ddpkit.parallel.zero.gathering import Gathering
from ddpkit.parallel.zero.placement import home, local_of, make_mesh, shard_whole
from ddpkit.parallel.zero.reduction import Reductions
from ddpkit.parallel.zero.structures import cast_floats, tensors_in
from ddpkit.parallel.zero.units import Residency, Unit, find_units, make_units
from ddpkit.runtime.devices import comm_device
from ddpkit.runtime.states import check_move

__all__ = ["BACKWARD_MOVES", "Backward", "ShardedParameters", "engine_of", "is_sharded", "optimizer_over_shards"]


class Backward(enum.Enum):
    """Where the engine's backward stands (the module notes' *Backward* and *Which backwards synchronise*); its moves
    are :data:`BACKWARD_MOVES`.

    *Held*: a backward that gave no parameter a gradient (``torch.autograd.grad`` with ``create_graph=True``, a
    gradient penalty) saved views of the gathered units that the next backward reads in any order, so the units stay
    gathered until a backward that gives gradients ends.
    """

    IDLE = "idle"
    """No backward runs."""
    HELD = "held"
    """No backward runs; the last one gave no gradient, and the units stay gathered."""
    BEGUN = "begun"
    """A backward runs; no parameter has its gradient yet."""
    BEGUN_HELD = "begun, held"
    ACCUMULATING = "accumulating"
    """A backward runs and has given a gradient: each unit is freed once backward is done with it."""
    ACCUMULATING_HELD = "accumulating, held"
    """As accumulating, after a held backward: the units stay gathered to its end."""

    @property
    def running(self) -> bool:
        return self not in (Backward.IDLE, Backward.HELD)

    @property
    def held(self) -> bool:
        return self in (Backward.HELD, Backward.BEGUN_HELD, Backward.ACCUMULATING_HELD)


BACKWARD_MOVES: dict[Backward, frozenset[Backward]] = {
    Backward.IDLE: frozenset({Backward.BEGUN}),
    Backward.HELD: frozenset({Backward.BEGUN_HELD}),
    # The first gradient; a backward that gave none ends held; one that raised is ended by the next root forward.
    Backward.BEGUN: frozenset({Backward.ACCUMULATING, Backward.HELD, Backward.IDLE}),
    Backward.BEGUN_HELD: frozenset({Backward.ACCUMULATING_HELD, Backward.HELD}),
    Backward.ACCUMULATING: frozenset({Backward.IDLE}),  # its end (or, raised, the next root forward's)
    Backward.ACCUMULATING_HELD: frozenset({Backward.IDLE, Backward.HELD}),  # its end; raised: still held
}
"""The moves of :class:`Backward`; any other is a bug (:meth:`ShardedParameters._enter` raises)."""

_ENGINES: dict[int, tuple[weakref.ref, weakref.ref]] = {}
"""id(module) -> (the module, its stage-3 engine), both held weakly."""


def engine_of(module: nn.Module) -> ShardedParameters | None:
    """The stage-3 engine sharding ``module``'s parameters (``None``: they are not sharded)."""
    entry = _ENGINES.get(id(module))
    if entry is None or entry[0]() is not module:
        return None
    return entry[1]()


def is_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is a stage-3 shard (a DTensor)."""
    return hasattr(param, "to_local") and hasattr(param, "placements")


_REPLACED = "_ddpkit_replaced_by_shard"
"""The mark on a parameter object that wrapping replaced by its shard (an optimizer that holds one steps nothing)."""
_CHECKED: weakref.WeakSet = weakref.WeakSet()
_STEP_HOOK: list[Any] = []


def _refuse_replaced(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A global optimizer step pre-hook: an optimizer over parameters a stage-3 wrapping replaced is refused at
    its first step (it would step tensors no model uses)."""
    if optimizer in _CHECKED:
        return
    _CHECKED.add(optimizer)
    if any(getattr(p, _REPLACED, False) for g in optimizer.param_groups for p in g["params"]):
        _CHECKED.discard(optimizer)
        raise RuntimeError(
            f"{type(optimizer).__name__} holds parameters that DistributedDataParallel(zero_stage=3) replaced by "
            "their shards when it wrapped the model, so this step would change tensors the model no longer uses: "
            "build the optimizer after wrapping, over model.parameters() (as with FSDP2's fully_shard)")


def _home_device(module: nn.Module, group: dist.ProcessGroup | None) -> torch.device:
    """Where the parameters are (a meta-device model: where the group's collectives run, as it is materialised
    there)."""
    first = next(module.parameters(), None)
    if first is not None and not first.is_meta:
        return first.device
    return comm_device(group)


class _AtInputs(torch.autograd.Function):
    """Passes a unit's forward inputs on unchanged; its backward, when the gradient has gone through the unit
    to its inputs, tells the engine that this call's backward is done (FSDP2's post-backward)."""

    @staticmethod
    def forward(ctx: Any, done: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.done = done
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.done()
        return (None, *grads)


class ShardedParameters:
    """ZeRO stage 3's engine (see the module notes).

    Args:
        module: the model, its parameters equal on every rank already (or on the meta device).
        process_group: the ranks that share the model.
        units: classes whose outermost instances are units (``None``: the default units).
        reshard_after_forward: free a unit's gathered parameters after its forward (``False``: after its backward).
        find_unused_parameters: allow parameters that get no gradient (see the module notes).
        param_dtype: the dtype units are gathered and computed in (``None``: the parameters' own).
        reduce_dtype: the dtype gradients are averaged in (``None``: ``param_dtype``).
        init: for a meta-device model, what initialises each module (see
            :mod:`ddpkit.parallel.zero.materialize`; ``None``: its ``reset_parameters()``).
        device: where a meta-device model is materialised (``None``: where the group's collectives run).
        owner: the name the errors use.
    """

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None,
                 units: Sequence[type[nn.Module]] | None = None, reshard_after_forward: bool = True,
                 find_unused_parameters: bool = False, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, init: Any = None, device: torch.device | None = None,
                 owner: str = "DDP") -> None:
        if units is not None:
            units = tuple(units) if isinstance(units, (tuple, list)) else (units,)
            bad = [u for u in units if not (isinstance(u, type) and issubclass(u, nn.Module))]
            if bad or not units:
                raise ValueError(f"zero_units={units!r}: give nn.Module subclasses (e.g. zero_units=(Block,)), "
                                 "or None for the children of the model's Sequential/ModuleList containers")
        for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"zero_{name}={dtype!r}: give a floating dtype (torch.bfloat16, torch.float16, "
                                 "torch.float32) or None")
        if init is not None and not callable(init):
            raise TypeError(f"zero_init={init!r}: give a function of one module (called on every module, "
                            "children first, as nn.Module.apply calls it) or None")
        self.module = module
        self.owner = owner
        self.group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        self.rank = 0 if process_group is None else dist.get_rank(process_group)
        self.reshard_after_forward = bool(reshard_after_forward)
        self.find_unused = bool(find_unused_parameters)
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype or param_dtype
        self.div_factor: int | None = self.world_size
        """What the gradients are divided by (the wrapper sets it before each forward)."""
        self.armed = False
        """The backwards of the last forward synchronise."""
        self.step = 0
        self.sharded_state_dict = False
        """``state_dict()`` leaves the parameters as this rank's shards (DTensors) while set."""
        self.observers = Observers(owner)
        on_meta = any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers())
        self.device = torch.device(device) if device is not None else _home_device(module, process_group)
        self.mesh = make_mesh(process_group, self.device.type)
        replaced = list(module.named_parameters())  # the names are the units' (the same walk, the same order)
        self.units = make_units(module, find_units(module, units), owner=owner, world_size=self.world_size,
                                param_dtype=param_dtype)
        for u in self.units:  # every parameter replaced, in every module that registers it, by this rank's shard
            home(u, [q.param for q in u.params], self.mesh, self.rank)
        by_name = {q.name: q for u in self.units for q in u.params}
        self._replaced = {id(p): by_name[n] for n, p in replaced}
        """id of each parameter wrapping replaced -> its unit parameter (:meth:`shard_of`)."""
        for _, p in replaced:
            setattr(p, _REPLACED, True)
        if not _STEP_HOOK:
            _STEP_HOOK.append(register_optimizer_step_pre_hook(_refuse_replaced))
        self.order: list[int] = [u.index for u in self.units if u.name]
        """The units' forward order in the last forward (the registration order at first)."""
        self.launch_order = sorted(self.units, key=lambda u: -u.index)
        """The order units are reduced in, the same on every rank: the last unit first, the root unit last."""
        self.gathering = Gathering(process_group, self.world_size, self.rank, owner, self._on_grad)
        self.reductions = Reductions(process_group, self.world_size, self.rank, owner, self.reduce_dtype,
                                     self.observers, self.mesh)
        self.reductions.units = self.units
        self._seen: list[int] = []
        self._calls = itertools.count()
        self._in_forward: dict[int, tuple[int, bool]] = {}
        self.backward = Backward.IDLE
        """Where the backward stands; changed by :meth:`_enter` only."""
        self._complete: set[int] = set()
        """The units every trained parameter of which has its gradient in this backward (they may be reduced)."""
        self._cursor = 0
        self._saving: Any = None
        self._handles = self._install_hooks()
        if on_meta:
            from ddpkit.parallel.zero.materialize import materialize

            materialize(self, init, self.device)
        self._by_buffer = {id(u.full): u for u in self.units}
        """The units by their gathered buffer (what a saved parameter's view has as its base)."""

    @contextlib.contextmanager
    def sharded_state(self) -> Iterator[None]:
        """Within it, ``state_dict()`` shows this rank's shards (DTensors of the true shapes): nothing gathered."""
        before, self.sharded_state_dict = self.sharded_state_dict, True
        try:
            yield
        finally:
            self.sharded_state_dict = before

    @property
    def root(self) -> Unit | None:
        """The unit of the parameters outside every unit (``None``: there are none)."""
        return self.units[0] if self.units and not self.units[0].name else None

    def shard_of(self, param: torch.Tensor) -> nn.Parameter:
        """The parameter that replaced ``param`` (one of the model's before wrapping), or ``param`` itself if it is
        one of the model's now: to rebuild an optimizer made before wrapping (see
        :func:`ddpkit.parallel.zero.stage3.optimizer_over_shards`)."""
        q = self._replaced.get(id(param))
        if q is not None:
            return q.param
        if any(param is p for p in self.params):
            return param
        raise ValueError(f"{self.owner}(zero_stage=3): a tensor of shape {list(param.shape)} is not one of the "
                         "model's parameters")

    @property
    def params(self) -> list[nn.Parameter]:
        """Every parameter, unit by unit (each this rank's shard)."""
        return [q.param for u in self.units for q in u.params]

    def adopt(self) -> None:
        """Take up parameters replaced since wrapping (``load_state_dict(assign=True)``, ``to_empty``, an
        assignment): a whole tensor is cut to this rank's shard, and a tied parameter is the same tensor in each
        module that registers it."""
        for u in self.units:
            for q in u.params:
                p = q.param
                local = local_of(p)
                if local.dtype != u.dtype or local.device != u.device:
                    raise ValueError(
                        f"{self.owner}(zero_stage=3): parameter {q.name!r} is {local.dtype} on {local.device}, where "
                        f"the model was wrapped with {u.dtype} on {u.device}: it was cast or moved after wrapping. "
                        "Cast or move the model before wrapping it (zero_param_dtype computes in another dtype "
                        "while the shards keep theirs)")
                if self.mesh is not None and not is_sharded(p):
                    if p.shape != q.shape:
                        raise ValueError(f"{self.owner}(zero_stage=3): parameter {q.name!r} was replaced by a tensor "
                                         f"of shape {list(p.shape)}, where it has {list(q.shape)}: a sharded model "
                                         "keeps its parameters' shapes")
                    p = shard_whole(p, q, self.mesh, self.rank, p.requires_grad)
                    q.owners[0][0]._parameters[q.owners[0][1]] = p
                for m, attr in q.owners[1:]:
                    if m._parameters[attr] is not p:
                        m._parameters[attr] = p

    # -- forward --------------------------------------------------------------------------------------

    def _install_hooks(self) -> list[Any]:
        handles = [self.module.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True),
                   self.module.register_forward_hook(self._root_post_forward, always_call=True)]
        for u in self.units:
            if u.name:
                handles.append(u.module.register_forward_pre_hook(functools.partial(self._pre_forward, u),
                                                                  with_kwargs=True))
                handles.append(u.module.register_forward_hook(functools.partial(self._post_forward, u)))
        return handles

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _cast(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The floating tensors of a forward's inputs in ``param_dtype`` (FSDP2's ``cast_forward_inputs``)."""
        if self.param_dtype is None:
            return args, kwargs
        return cast_floats(args, self.param_dtype), cast_floats(kwargs, self.param_dtype)

    # Under torch.compile the forward hooks run eagerly (Dynamo breaks the graph at each, and compiles the modules
    # between them): their gathers, frees and bindings change per unit and per step.
    @torch.compiler.disable
    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.backward.running:  # a backward that raised never reached its end (a root forward starts afresh)
            self._end_of_backward_state(Backward.HELD if self.backward.held else Backward.IDLE)
        self.adopt()
        self._seen = []
        root = self.root
        if root is not None:
            self.gathering.gather(root, wait=True)
            self.gathering.bind(root)
        if self.order:
            self.gathering.gather(self.units[self.order[0]], wait=False)
        if torch.is_grad_enabled():
            self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saving.__enter__()
        return self._cast(args, kwargs)

    def _pack(self, tensor: torch.Tensor) -> Any:
        """What autograd saves of ``tensor``: a parameter of a unit (or a view of one) with its unit, so that the
        backward that reads it finds the unit gathered, whatever order it runs in (a gradient penalty's double
        backward, a loss that enters a unit by another way than its outputs)."""
        base = tensor._base
        unit = self._by_buffer.get(id(base)) if base is not None else None
        return tensor if unit is None or unit.full is not base else (unit, tensor)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, tuple):
            unit, tensor = saved
            if unit.residency is not Residency.GATHERED:
                self._begin_backward()
                self.gathering.gather(unit, wait=True)
            return tensor
        return saved

    @torch.compiler.disable
    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        saving, self._saving = self._saving, None
        if saving is not None:  # (this hook runs when the forward raised too)
            saving.__exit__(None, None, None)
        if self._seen and self._seen != self.order:
            self.order = list(self._seen)
            for u in self.units:  # prefetched in the order of the forward before, and skipped in this one
                if (u.name and u.residency is not Residency.FREED and u.index not in self._seen
                        and not self.backward.running):
                    self.gathering.free(u)
        grad = torch.is_grad_enabled()
        root = self.root
        if root is not None:
            if grad:
                self.gathering.unbind(root)  # kept gathered for the backward (its first and last parameters' use)
            else:
                self.gathering.free(root)
        if grad:
            tensors = [t for t in tensors_in(output) if t.requires_grad]
            if tensors:  # backward begins here: its end is this (outermost) backward's, not a nested one's
                register_multi_grad_hook(tensors, lambda grads: self._begin_backward(), mode="any")

    @torch.compiler.disable
    def _pre_forward(self, u: Unit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.backward.running:  # a recomputation (activation checkpointing): the unit as in the forward
            self.gathering.gather(u, wait=True)
            self.gathering.bind(u)
            return self._cast(args, kwargs)
        self.gathering.gather(u, wait=True)
        self.gathering.bind(u)
        if u.index not in self._seen:
            self._seen.append(u.index)
        nxt = self._neighbour(u, +1)
        if nxt is not None:
            self.gathering.gather(nxt, wait=False)
        if torch.is_grad_enabled():
            call = next(self._calls)
            args, kwargs, watched = self._watch_inputs(u, call, args, kwargs)
            self._in_forward[u.index] = (call, watched)
        return self._cast(args, kwargs)

    def _watch_inputs(self, u: Unit, call: int, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
        """The inputs passed through :class:`_AtInputs` (those that require grad), to learn when this call's
        backward has reached them."""
        leaves, spec = tree_flatten((args, kwargs))
        at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not at:
            return args, kwargs, False
        passed = _AtInputs.apply(functools.partial(self._post_backward, u, call), *(leaves[i] for i in at))
        for i, t in zip(at, passed):
            leaves[i] = t
        args, kwargs = tree_unflatten(leaves, spec)
        return args, kwargs, True

    @torch.compiler.disable
    def _post_forward(self, u: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if self.backward.running:
            return  # a recomputation: the unit stays gathered and bound until its backward is done
        self.gathering.unbind(u)
        grad = torch.is_grad_enabled()
        # The last unit of the forward is the first of the backward: kept, rather than freed and gathered again.
        last = bool(self.order) and u.index == self.order[-1]
        if not grad or (self.reshard_after_forward and not last):
            self.gathering.free(u)
        if grad:
            call, watched = self._in_forward.pop(u.index, (-1, False))
            tensors = [t for t in tensors_in(output) if t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, lambda grads: self._pre_backward(u, call, watched), mode="any")

    def _neighbour(self, u: Unit, step: int) -> Unit | None:
        order = self.order
        if u.index not in order:
            return None
        at = order.index(u.index) + step
        return self.units[order[at]] if 0 <= at < len(order) else None

    # -- backward -------------------------------------------------------------------------------------

    def _enter(self, backward: Backward) -> None:
        """Move :attr:`backward` (the only place it changes; :data:`BACKWARD_MOVES` says which moves exist)."""
        check_move(BACKWARD_MOVES, self.backward, backward, f"{self.owner}(zero_stage=3): the backward")
        self.backward = backward

    def _begin_backward(self) -> None:
        if not self.backward.running:
            self._enter(Backward.BEGUN_HELD if self.backward.held else Backward.BEGUN)
            Variable._execution_engine.queue_callback(self._end_backward)
            root = self.root
            if root is not None:  # the root's parameters are used last in forward and first in backward
                self.gathering.gather(root, wait=True)
                self.gathering.bind(root)

    def _pre_backward(self, u: Unit, call: int, watched: bool) -> None:
        self._begin_backward()
        self.gathering.gather(u, wait=True)
        self.gathering.bind(u)  # a recomputation inside the unit reads its modules' attributes
        if watched:
            u.open_calls.add(call)
        prev = self._neighbour(u, -1)
        if prev is not None:
            self.gathering.gather(prev, wait=False)

    def _post_backward(self, u: Unit, call: int) -> None:
        """The gradient of one of the unit's forward calls has gone through it: free it if no call is left."""
        u.open_calls.discard(call)
        if (not u.open_calls and u.residency is not Residency.FREED and u is not self.root
                and self.backward is Backward.ACCUMULATING):
            self.gathering.free(u)

    def _on_grad(self, unit: int, i: int) -> None:
        """Autograd has accumulated a gradient into the ``i``-th leaf of unit ``unit``."""
        u = self.units[unit]
        self._begin_backward()
        if self.backward is Backward.BEGUN:
            self._enter(Backward.ACCUMULATING)
        elif self.backward is Backward.BEGUN_HELD:
            self._enter(Backward.ACCUMULATING_HELD)
        if not u.arrived:  # its first gradient (of this backward, or since it was reduced)
            u.expect = set(u.trained)
        u.arrived.add(i)
        if u.index in self._complete or not u.expect <= u.arrived:
            return
        self._complete.add(u.index)
        all_trained = len(u.expect) == len(u.params)
        if self.armed and u.reduce_grads:
            position = self.launch_order.index(u)
            if position < self._cursor:  # reduced once in this backward already (reentrant checkpointing)
                self._reduce(u)
            else:
                self._launch_ready()
        else:  # not reduced: its gradient joins its sum now (FSDP2's post-backward), not at the end of backward
            self._keep_sums(u)
        # Every trained parameter's gradient is in, so no node of this backward reads them any more; a frozen one
        # may still be read (by another input's gradient), and a call still open reads it all.
        if not u.open_calls and u is not self.root and all_trained and not self.backward.held:
            self.gathering.free(u)

    def _launch_ready(self) -> None:
        order = self.launch_order
        while self._cursor < len(order):
            u = order[self._cursor]
            if u.trained and u.reduce_grads:
                if u.index not in self._complete:
                    return
                self._reduce(u)
            self._cursor += 1

    def _reduce(self, u: Unit) -> None:
        """Launch the unit's reduction; gradients that arrive after it (reentrant checkpointing) count afresh."""
        self._complete.discard(u.index)
        self.reductions.launch(u, self.div_factor, self.step)

    # -- reduction ------------------------------------------------------------------------------------

    def _end_backward(self) -> None:
        """The end of backward (autograd's queued callback)."""
        if not self.backward.running:
            return  # ended already by a root forward inside it (checkpointing the whole model: not supported)
        if self.backward in (Backward.BEGUN, Backward.BEGUN_HELD):
            # No parameter got a gradient (torch.autograd.grad): not the backward that synchronises. Its graph, made
            # with create_graph=True (a gradient penalty), saved views of the gathered units that the next backward
            # reads in any order: the units stay gathered until that backward ends.
            self._enter(Backward.HELD)
            for u in self.units:
                u.open_calls.clear()
            return
        try:
            if not self.armed or not any(u.reduce_grads for u in self.units):
                return  # no_sync (or no unit's gradients to sync): the leaves keep their sums
            for u in self.launch_order[self._cursor:]:
                if u.trained and u.reduce_grads:
                    self._reduce(u)
            self._cursor = len(self.launch_order)
            used = self.reductions.used_everywhere(self.units, self.step) if self.find_unused else None
            observed = self.observers.wait or self.observers.done
            start = time.perf_counter() if observed else 0.0
            missing = [q.name for u in self.units for i, q in enumerate(u.params)
                       if q.param.requires_grad and u.pending and not any(had[i] for _, _, had in u.pending)]
            for u in self.units:
                self.reductions.deliver(u, used)
            if observed:
                self.observers.waited(start, time.perf_counter(), self.step)
            self.step += 1
            if missing and not self.find_unused:
                listed = ", ".join(repr(n) for n in missing)
                raise UnusedParametersError(
                    f"{self.owner}(zero_stage=3): {len(missing)} parameter(s) got no gradient in this backward: "
                    f"{listed}. Every parameter that requires grad must take part in the loss of every "
                    "synchronised step; if some legitimately do not, pass find_unused_parameters=True")
        finally:
            self._end_of_backward_state()

    def _end_of_backward_state(self, after: Backward = Backward.IDLE) -> None:
        """Every unit freed and its reductions waited for; the backward ``after`` (held, if a backward that raised
        was after a held one)."""
        self._enter(after)
        self._complete.clear()
        self._cursor = 0
        for u in self.units:
            self._keep_sums(u)
            if u.pending:  # a backward that raised after launching the unit's reduction: its average, as FSDP2's
                self.reductions.deliver(u, None)
            self.gathering.free(u)
            u.open_calls.clear()
            u.arrived.clear()
        self._in_forward.clear()

    def _keep_sums(self, u: Unit) -> None:
        """What a backward left in the unit's leaves (it did not reduce them), kept for the next backward that does:
        summed in ``reduce_dtype`` where that is not the leaves' dtype, as FSDP2 does (bf16 micro-batches add up in
        fp32, not in bf16), and marked as ``no_sync()``'s when the forward ran under it."""
        if not self.armed and any(q.leaf is not None and q.leaf.grad is not None for q in u.params):
            u.no_sync_sums = True
        if self.reduce_dtype is None:  # the leaves' own dtype: their sums stay in them
            return
        for q in u.params:
            grad = q.leaf.grad if q.leaf is not None else None
            if grad is None or (q.accumulated is None and grad.dtype == self.reduce_dtype):
                continue
            if q.accumulated is None:
                q.accumulated = grad.to(self.reduce_dtype)
            else:
                q.accumulated.add_(grad)
            q.leaf.grad = None

    def drop_accumulated(self) -> None:
        """Let go of the gradients accumulated whole under ``no_sync()`` (the wrapper's ``zero_grad()``, as DDP's
        drops its local sums). A unit's sums made with FSDP2's switch off alone stay, as FSDP2's do: they are not
        the parameters' ``.grad``."""
        for u in self.units:
            if not u.no_sync_sums:
                continue
            u.no_sync_sums = False
            for q in u.params:
                q.accumulated = None
                if q.leaf is not None:
                    q.leaf.grad = None

    # -- what the wrapper calls as it calls a reducer --------------------------------------------------

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] = ()) -> None:
        del outputs
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch: whether the backwards from now on reduce every unit's gradients (``recurse``) or the root
        unit's only. Read when a unit's gradients are in, not at the forward (see the module notes)."""
        for u in self.units if recurse else [u for u in self.units if not u.name]:
            u.reduce_grads = bool(requires_gradient_sync)

    def rebuild_if_due(self) -> bool:
        return False

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        raise RuntimeError("a comm hook reduces whole buckets, and zero_stage=3 reduce-scatters units: use "
                           "zero_stage=0 to use a comm hook")

    def add_observer(self, observer: Observer) -> ObserverHandle:
        """Attach ``observer``: each unit's reduction is a bucket's (its index the unit's), then the wait at the end
        of backward (see :mod:`ddpkit.parallel.common.observer`)."""
        return self.observers.add(observer)

    def set_static_graph(self) -> None:
        raise RuntimeError("static_graph is not supported with zero_stage=3: drop one of them")

    def begin_shadow(self) -> None:
        raise RuntimeError("join() is not supported with zero_stage=3")


def optimizer_over_shards(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class, param groups and settings over the shards that replaced its
    parameters when ``model`` (or the module of the DDP that wraps it) was wrapped with ``zero_stage=3``. Its
    state is not carried over: rebuild it before the first step."""
    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    engine = engine_of(inner)
    if engine is None:
        raise ValueError(f"{type(model).__name__} does not shard its parameters (zero_stage=3)")
    if any("step" not in state or float(state["step"]) > 0 for state in optimizer.state.values()):
        # (Adagrad makes its state, at step 0, in its constructor: that is no step.)
        raise ValueError(f"{type(optimizer).__name__} has stepped already: its state cannot move to the shards; "
                         "build the optimizer after wrapping")
    groups = [{**g, "params": [engine.shard_of(p) for p in g["params"]]} for g in optimizer.param_groups]
    # The groups carry every setting; the defaults go to the constructor but for those it refuses (AdamW's hold
    # `decoupled_weight_decay`, which its constructor sets itself and refuses, also through a subclass's
    # **kwargs), then all of them are restored as they were.
    given = dict(optimizer.defaults)
    while True:
        try:
            sharded = type(optimizer)(groups, **given)
            break
        except TypeError as e:
            refused = re.search(r"unexpected keyword argument '(\w+)'", str(e))
            if refused is None or refused.group(1) not in given:
                raise
            del given[refused.group(1)]
    sharded.defaults = dict(optimizer.defaults)
    return sharded


def sharded_parameters(module: nn.Module, process_group: dist.ProcessGroup | None, find_unused_parameters: bool,
                       settings: dict[str, Any]) -> ShardedParameters:
    """The stage-3 engine of ``module``, with the state-dict hooks that show every module's parameters whole."""
    from ddpkit.parallel.zero.whole import install_state_dict_hooks

    if engine_of(module) is not None or any(is_sharded(p) for p in module.parameters()):
        raise ValueError("this module's parameters are sharded already (it was wrapped with zero_stage=3 before): "
                         "wrap it once, or wrap a fresh copy of the plain model")
    engine = ShardedParameters(module, process_group=process_group, find_unused_parameters=find_unused_parameters,
                               **settings)
    _ENGINES[id(module)] = (weakref.ref(module), weakref.ref(engine))
    install_state_dict_hooks(engine)
    return engine

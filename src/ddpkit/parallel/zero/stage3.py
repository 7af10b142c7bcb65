"""ZeRO stage 3: the parameters sharded too, gathered unit by unit for forward and for backward.

:class:`ShardedParameters` is the engine of ``DistributedDataParallel(module,
zero_stage=3)`` (it stands where stage 0's and stage 2's reducer stand).

Units
    The model is cut into units (:func:`find_units`): by default each child
    holding parameters of the outermost ``nn.Sequential``/``nn.ModuleList``
    containers (the blocks of a transformer, the residual blocks of a ResNet),
    or every outermost module of the classes given as ``zero_units`` (FSDP's
    wrapping policy). The parameters outside every unit form the *root unit*.
    A parameter shared by two units is refused by name. A unit may mix frozen
    and trained parameters (a fine-tuned block with frozen weights and trained
    adapters): the frozen ones are gathered with it but get no gradient, and
    their part of the unit's reduction is zeros. The parameters each keep
    their identity: every ``nn.Parameter`` of the model becomes a
    one-dimensional view of this rank's shard (its *segment*, maybe empty), so
    an optimizer built over ``model.parameters()`` (param groups as the user
    makes them) steps on the shard.
Shards
    A unit's parameters, each flattened in registration order, concatenated
    and padded with zeros to a multiple of the world size ``W``, are cut into
    ``W`` equal chunks; rank ``r`` keeps chunk ``r`` (:attr:`Unit.shard`).
Forward
    Before a unit's forward its shards are all-gathered into one flat buffer
    (:attr:`Unit.full`, a leaf tensor of autograd) and its modules see their
    parameters as views of it; the next unit's all-gather is started at the
    same time (prefetch: asynchronous, so it runs while this unit computes;
    the order is that of the previous forward, the registration order at
    first). After the forward the buffer's memory is freed
    (``reshard_after_forward=True``, the default) or kept until backward.
Backward
    A hook on the unit's outputs gathers the unit again as soon as the first
    gradient reaches them (and starts the gather of the unit before it). When
    autograd has accumulated the buffer's gradient, it is averaged
    (pre-scaled by ``1/W`` as DDP's gradients are) and reduce-scattered
    (NCCL's reduce-scatter; on gloo direct messages, :mod:`ddpkit.comm.direct`),
    asynchronously, while backward goes on; the
    buffer's memory is freed. At the end of backward each parameter's
    ``.grad`` is its segment of the averaged gradient (added to what it held,
    as DDP's accumulate).
Activation checkpointing
    A recomputation in backward (around a unit, inside it, or of a root
    module; reentrant or not) sees the unit gathered and bound: see
    :meth:`ShardedParameters._recompute`. Checkpointing the whole wrapped
    model (its root's forward) is not supported: checkpoint its units.
``no_sync``
    Outside synchronisation each unit's gradient accumulates unsharded (full
    size, one buffer per unit: the documented cost), and the next synchronised
    backward reduces the sum.
``find_unused_parameters``
    Without it a unit whose forward ran but that got no gradient makes the
    backward raise, naming it. With it, every unit's gradient is reduced at the
    end of backward, in unit order (zeros for a unit without one), so the
    ranks' collectives line up whatever each of them used; no overlap.
Mixed precision
    ``param_dtype`` (e.g. ``torch.bfloat16``): the shards stay in their dtype
    (fp32), the units are gathered in ``param_dtype``, so forward and backward
    compute in it; ``reduce_dtype`` (default ``param_dtype``, as FSDP2's
    ``MixedPrecisionPolicy``) is the dtype the gradients are averaged in.

Observers (:meth:`ShardedParameters.add_observer`) see each unit's reduction
as a bucket's. Refused, each with the reason: a comm hook, ``static_graph``,
``gradient_as_bucket_view``, ``join()``, sparse gradients.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook

from ddpkit.parallel.ddp.observer import Observer, ObserverHandle, Observers
from ddpkit.parallel.zero.gathering import Gathering
from ddpkit.parallel.zero.units import (
    Launched,
    Unit,
    UnitParam,
    cast_floats,
    find_units,
    flatten_grads,
    make_units,
    reduce_scatter_flat,
    segment,
    settle,
    tensors_in,
)
from ddpkit.parallel.zero.whole import shard_state, whole_state
from ddpkit.runtime import events
from ddpkit.runtime.devices import comm_tensor

__all__ = ["ShardedParameters", "engine_of", "sharded_parameters"]

_ENGINES: dict[int, tuple[weakref.ref, weakref.ref]] = {}
"""id(module) -> (the module, its stage-3 engine), both held weakly."""


def engine_of(module: nn.Module) -> ShardedParameters | None:
    """The stage-3 engine sharding ``module``'s parameters (``None``: they are not sharded)."""
    entry = _ENGINES.get(id(module))
    if entry is None or entry[0]() is not module:
        return None
    return entry[1]()

class ShardedParameters:
    """ZeRO stage 3's engine (see the module notes).

    Args:
        module: the model, its parameters equal on every rank already.
        process_group: the ranks that share the model.
        units: classes whose outermost instances are units (``None``: the default units).
        reshard_after_forward: free a unit's gathered parameters after its forward (``False``: after its backward).
        find_unused_parameters: allow units that get no gradient (every unit reduced at the end of backward).
        param_dtype: the dtype units are gathered and computed in (``None``: the parameters' own).
        reduce_dtype: the dtype gradients are averaged in (``None``: ``param_dtype``).
        owner: the name the errors use.
    """

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None,
                 units: Sequence[type[nn.Module]] | None = None, reshard_after_forward: bool = True,
                 find_unused_parameters: bool = False, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, owner: str = "DDP") -> None:
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
        """The coming backward synchronises."""
        self.step = 0
        self.observers = Observers(owner)
        self.units = make_units(module, find_units(module, units), owner=owner, rank=self.rank,
                                world_size=self.world_size, param_dtype=param_dtype)
        self.params = [p.param for u in self.units for p in u.params]
        """Every parameter, unit by unit (each a view of this rank's shard)."""
        self.order: list[int] = [u.index for u in self.units if u.name]
        """The units' forward order in the last forward (the registration order at first)."""
        self.whole = Gathering(process_group, self.world_size, owner, self._leaf_ready)
        self._seen: list[int] = []
        self._queued = False
        self._handles = self._install_hooks()

    def segment(self, q: UnitParam, chunk: int) -> tuple[int, int] | None:
        """``q``'s elements in this rank's chunk, relative to the chunk (``None``: none)."""
        return segment(q, chunk, self.rank)

    # -- hooks --------------------------------------------------------------------------------------

    def _install_hooks(self) -> list[Any]:
        handles = [self.module.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True),
                   self.module.register_forward_hook(self._root_post_forward)]
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

    def _cast(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The floating tensors of a forward's inputs in ``param_dtype`` (FSDP2's ``cast_forward_inputs``)."""
        if self.param_dtype is None:
            return None
        return cast_floats(args, self.param_dtype), cast_floats(kwargs, self.param_dtype)

    # Under torch.compile the four forward hooks run eagerly (Dynamo breaks the graph at each, and compiles the
    # modules between them): their gathers, frees and bindings change per unit and per step, so traced they
    # would be recompiled for every unit (and past Dynamo's limit fall back to eager with a warning).
    @torch.compiler.disable
    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if any(u.ran or u.gathered for u in self.units):  # a forward whose backward never came: start afresh
            self._end_iteration()
        # A backward that raised never ran its end: the next forward is not a recomputation (see _recompute;
        # checkpointing the whole model, its root's forward, is not supported: checkpoint its units).
        self._queued = False
        self._seen = []
        root = self.units[0] if self.units and not self.units[0].name else None
        if root is not None:
            self.whole.gather(root, wait=True)
            self.whole.bind(root)
            root.ran = root.ran or torch.is_grad_enabled()
        if self.order:
            self.whole.gather(self.units[self.order[0]], wait=False)
        return self._cast(args, kwargs)

    @torch.compiler.disable
    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        root = self.units[0] if self.units and not self.units[0].name else None
        if self._seen and self._seen != self.order:
            self.order = list(self._seen)
        if root is not None:
            self.whole.unbind(root)
            if torch.is_grad_enabled():
                self.whole.bind(root, counted=False)  # gathered until its gradients are in: for a recomputation
            else:
                self.whole.free(root)
        if not torch.is_grad_enabled():
            self._seen = []

    @torch.compiler.disable
    def _pre_forward(self, u: Unit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._queued:
            return self._recompute(u, args, kwargs)
        self.whole.gather(u, wait=True)
        self.whole.bind(u)
        if u.index not in self._seen:
            self._seen.append(u.index)
        if torch.is_grad_enabled():
            u.ran = True
        nxt = self._neighbour(u, +1)
        if nxt is not None:
            self.whole.gather(nxt, wait=False)
        return self._cast(args, kwargs)

    @torch.compiler.disable
    def _post_forward(self, u: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if self._queued:
            return  # a recomputation (see _recompute): the unit stays gathered and bound until its gradients are in
        self.whole.unbind(u)
        grad = torch.is_grad_enabled()
        # The last unit of the forward is the first of the backward: kept, rather than freed and gathered again.
        last = bool(self.order) and u.index == self.order[-1]
        if not grad or (self.reshard_after_forward and not last):
            self.whole.free(u)
        if grad:
            tensors = [t for t in tensors_in(output) if t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, lambda grads, u=u: self._pre_backward(u), mode="any")

    def _recompute(self, u: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The unit's forward run again inside this model's backward: activation checkpointing.

        Non-reentrant checkpointing (``use_reentrant=False``) recomputes only the values autograd saved; the
        gradients still flow to the leaves of the first forward, so the unit is bound to uncounted leaves, and
        nothing of the forward's bookkeeping (order, prefetch, freeing) happens. Reentrant checkpointing ran the
        first forward without grad, and its recomputation is the forward the gradients flow through: leaves.
        """
        self.whole.gather(u, wait=True)
        counted = torch.is_grad_enabled() and not u.ran
        self.whole.bind(u, counted=counted)
        u.ran = u.ran or counted
        return self._cast(args, kwargs)

    def _pre_backward(self, u: Unit) -> None:
        self._queue_finish()
        self.whole.gather(u, wait=True)
        with torch.enable_grad():  # (off in backward) leaves, as in the forward the recomputation must repeat
            self.whole.bind(u, counted=False)  # checkpointing inside the unit recomputes through its modules' attributes
        prev = self._neighbour(u, -1)
        if prev is not None:
            self.whole.gather(prev, wait=False)

    def _leaf_ready(self, u: Unit, i: int, leaf: torch.Tensor) -> None:
        """A gathered parameter's gradient is in: kept (its ``.grad`` let go); the unit is done when all are."""
        self._queue_finish()
        grad, leaf.grad = leaf.grad, None
        u.grads[i] = grad if u.grads[i] is None else u.grads[i] + grad
        u.arrived += 1
        if u.arrived == u.expected:
            self._unit_done(u)

    def _unit_done(self, u: Unit) -> None:
        """Every gradient of the unit is in (or backward ended): free its parameters first, then make its flat
        gradient (so the two are never whole at once), and reduce it or keep it."""
        self.whole.unbind(u)
        self.whole.free(u)
        flat = flatten_grads(u, self.reduce_dtype or u.full.dtype)
        if self.armed and not self.find_unused:
            self._reduce(u, flat)
        else:
            u.acc = flat

    def _queue_finish(self) -> None:
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)

    def _neighbour(self, u: Unit, step: int) -> Unit | None:
        order = self.order
        if u.index not in order:
            return None
        at = order.index(u.index) + step
        return self.units[order[at]] if 0 <= at < len(order) else None

    # -- reduction ----------------------------------------------------------------------------------

    @torch.no_grad()
    def _reduce(self, u: Unit, grad: torch.Tensor | None) -> None:
        """Average ``grad`` (the unit's flat gradient; ``None``: zeros) over the ranks, asynchronously."""
        dtype = self.reduce_dtype or u.full.dtype
        if grad is None:
            flat = torch.zeros(u.full.numel(), dtype=dtype, device=u.full.device)
        elif grad.dtype != dtype:
            flat = grad.to(dtype)
        else:
            flat = grad
        if self.div_factor is not None and self.div_factor != 1:
            flat.mul_(1.0 / self.div_factor)  # DDP's averaging by pre-scaling: the same products
        u.reduced = True
        # The reductions before this one have had a unit's backward to finish: their full-size buffers go now,
        # so that at most one unit's gradient is whole at a time (as FSDP2 waits for the last reduce-scatter).
        for before in self.units:
            if before.pending:
                settle(before, self.rank)
        nbytes = flat.numel() * flat.element_size()
        if self.observers.ready:
            self.observers.bucket_ready(u.index, nbytes, self.step)
        work = None
        if self.world_size == 1:
            u.pending.append((flat, None))
        else:
            events.collective("{} zero-3 unit {} reduce-scatter", self.owner, u.index, step=self.step, nbytes=nbytes)
            out = flat.new_empty(u.chunk)
            work = reduce_scatter_flat(out, flat, self.group)
            u.pending.append((out, work))
        if self.observers.launch or self.observers.done:
            # The unit stands for a bucket: its index, and the reduction the done event waits for.
            self.observers.launched(Launched(u.index, work), nbytes, self.step)

    def _finish_backward(self) -> None:
        self._queued = False
        try:
            # Units whose gradients did not all come (a parameter unused): what came, zeros for the rest, in unit
            # order, so that every rank's collectives line up.
            short = [u for u in self.units if u.requires_grad and u.expected and u.arrived < u.expected]
            for u in short:
                self._unit_done(u)
            if self.armed:
                if self.find_unused:
                    # DDP's rule: a unit no rank used keeps its .grad; one used somewhere gets the average.
                    trained = [u for u in self.units if u.requires_grad]
                    used = comm_tensor([float(u.acc is not None) for u in trained], torch.float32, self.group)
                    if self.world_size > 1:
                        dist.all_reduce(used, group=self.group)
                    for u, count in zip(trained, used.tolist()):
                        flat, u.acc = u.acc, None
                        if count:
                            self._reduce(u, flat)
                observed = self.observers.wait or self.observers.done
                start = time.perf_counter() if observed else 0.0
                for u in self.units:
                    settle(u, self.rank)
                if observed:
                    self.observers.waited(start, time.perf_counter(), self.step)
                self.step += 1
                if short and not self.find_unused:
                    names = ", ".join(repr(u.name or "(root)") for u in short)
                    raise RuntimeError(
                        f"{self.owner}(zero_stage=3): units {names} ran forward but did not get a gradient for every "
                        "parameter in this backward; pass find_unused_parameters=True if some parameters take no "
                        "part in the loss")
        finally:
            self._end_iteration()

    def _end_iteration(self) -> None:
        for u in self.units:
            self.whole.unbind(u)
            self.whole.free(u)
            u.ran = u.reduced = False
            u.grads, u.arrived, u.expected = [None] * len(u.params) if u.grads else [], 0, 0
        self._seen = []

    # -- what the wrapper calls as it calls a reducer --------------------------------------------------

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] = ()) -> None:
        del outputs
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def rebuild_if_due(self) -> bool:
        return False

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        raise RuntimeError("a comm hook reduces whole buckets, and zero_stage=3 reduce-scatters units: use "
                           "zero_stage=0 to use a comm hook")

    def add_observer(self, observer: Observer) -> ObserverHandle:
        """Attach ``observer``: each unit's reduction is a bucket's (its index the unit's), then the wait at the
        end of backward (see :mod:`ddpkit.parallel.ddp.observer`)."""
        return self.observers.add(observer)

    def set_static_graph(self) -> None:
        raise RuntimeError("static_graph is not supported with zero_stage=3: drop one of them")

    def begin_shadow(self) -> None:
        raise RuntimeError("join() is not supported with zero_stage=3")


def sharded_parameters(module: nn.Module, process_group: dist.ProcessGroup | None, find_unused_parameters: bool,
                       settings: dict[str, Any]) -> ShardedParameters:
    """The stage-3 engine of ``module``, its state-dict hooks on the module (whole parameters out and in)."""
    engine = ShardedParameters(module, process_group=process_group, find_unused_parameters=find_unused_parameters,
                               **settings)
    _ENGINES[id(module)] = (weakref.ref(module), weakref.ref(engine))
    module.register_state_dict_post_hook(lambda m, state, prefix, local: whole_state(engine, state, prefix))
    module.register_load_state_dict_pre_hook(lambda m, state, prefix, *args: shard_state(engine, state, prefix))
    return engine

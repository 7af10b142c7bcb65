"""``DistributedDataParallel``: the module wrapper around :class:`ddpkit.parallel.common.reducer.Reducer`.

Construction checks that every rank holds the same parameters, broadcasts
parameters and buffers from rank 0 (coalesced), and hands the parameters that
require grad to a reducer. Each forward that will be followed by a
synchronised backward broadcasts buffers (``broadcast_buffers=True``) and arms
the reducer; the backward then all-reduces gradients bucket by bucket while
autograd is still running, and leaves the average in ``.grad``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.comm.bucket import CommHook, check_hook_signature
from ddpkit.parallel.common.broadcast import BROADCAST_CHUNK_BYTES, broadcast_once
from ddpkit.parallel.common.bucket_caps import DEFAULT_BUCKET_CAP_MB
from ddpkit.parallel.common.observer import Observer, ObserverHandle
from ddpkit.parallel.common.replicas import DDPConfigError, verify_same_parameters
from ddpkit.parallel.common.scatter import gather, padded, scatter, to_device
from ddpkit.parallel.ddp import args as ddp_args
from ddpkit.parallel.ddp.buffers import IGNORED_ATTRIBUTE, DDPBuffers
from ddpkit.parallel.ddp.engine import (
    Engine,
    clip_sharded_grad_norm,
    make_engine,
    refuse_sharded,
)
from ddpkit.parallel.ddp.join import DDPJoinable
from ddpkit.parallel.ddp.logging_data import DDPLogging, ShardedLogging
from ddpkit.parallel.ddp.sink import anchor_end_of_backward, through_sink
from ddpkit.runtime import membership

__all__ = ["DDP", "DDPConfigError", "DistributedDataParallel"]

_STATIC_AND_UNUSED = ("find_unused_parameters=True is not needed with a static graph: it finds its unused parameters "
                      "in the first iteration (they must stay unused)")

_MIB = 1024 * 1024


class DistributedDataParallel(DDPBuffers, DDPJoinable, nn.Module):
    """Data parallelism: same model on every rank, gradients averaged during backward.

    Args:
        module: the model, already on its device, identical on every rank.
        device_ids: for a single-device CUDA module, ``[device]``; inputs are
            moved there before forward. ``None`` (default) leaves them alone.
        output_device: accepted for torch compatibility; outputs stay where the
            module puts them.
        broadcast_buffers: deprecated by torch 2.13 for ``forward_sync_buffers``
            (a FutureWarning when given, as torch's); ``False`` also keeps
            buffers out of the construction broadcast. Default None (True).
        bucket_cap_mb: bucket size cap in MiB. Default (``None``) 25 MiB with
            a first bucket of 1 MiB; a value given caps the first bucket too
            (torch's rule). Buckets are laid out as torch's DDP lays them out.
        find_unused_parameters: allow parameters that get no gradient in some
            iterations (reduced as zeros; untouched when unused on every rank).
            Default False: an unused parameter raises at the end of backward.
        gradient_as_bucket_view: make ``.grad`` a view into bucket memory,
            saving a copy and a gradient-sized buffer. Default False.
        process_group: the group to average over; default the world. Under
            ``ddpkit launch --on-failure continue`` (no world: it changes as
            workers die) the wrapper spans none and trains inside
            :class:`ddpkit.FaultTolerance`, which reduces each step.
        static_graph: the model uses the same parameters the same number of
            times every iteration: unused parameters are found once, and
            parameters may get several gradients per backward (activation
            checkpointing, reentrant or not). A graph that changes later
            raises. Default False.
        bucket_cap_mb_list: one cap per bucket in MiB, the last for all
            buckets after it; replaces ``bucket_cap_mb`` (torch 2.13).
        forward_sync_buffers: broadcast buffers (BatchNorm statistics) from
            rank 0 before each forward that follows a synchronised one. The
            construction broadcast includes buffers either way. Default True.
        zero_stage: ddpkit's own, keyword only. ``2``: ZeRO stage 2, each
            bucket reduce-scattered during backward so that each rank keeps
            only its shard of the averaged gradients; train with
            :class:`ddpkit.ZeroRedundancyOptimizer` over the model's
            parameters (see :mod:`ddpkit.parallel.zero.stage2`). Default
            ``0``: every rank gets every average (stage 1 is the optimizer
            alone, over this). ``3``: ZeRO stage 3, the parameters sharded
            too and gathered unit by unit; any torch optimizer over the
            model's parameters steps on this rank's shard (see
            :mod:`ddpkit.parallel.zero.stage3`, also for ``zero_units``,
            ``reshard_after_forward``, ``zero_param_dtype`` and ``zero_reduce_dtype``).
        comm: ddpkit's own, keyword only. ``"auto"``: the gradient reduction
            chosen from the measured link as training runs (the exact
            all-reduce, fp16, bf16 or PowerSGD at rank 16 or 32; ``"auto:bf16,powersgd:4"``
            lists the candidates), printed once with the spec that pins it;
            ``"none"``, ``"fp16"``, ``"bf16"``, ``"powersgd:R"``: that one from
            the start (see :mod:`ddpkit.comm.auto`). Default None: no hook.

    Parameters and buffers named with torch's
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)``
    (also on this class) before wrapping are not broadcast, checked or reduced.

    The constructor takes torch's arguments in torch's order. ``dim`` is kept
    for compatibility (one device per process: nothing is scattered);
    ``init_sync=False`` skips the construction-time check and broadcast;
    ``check_reduction`` is ignored as by torch; ``skip_all_reduce_unused_params``
    leaves buckets of unused parameters unreduced (torch's rule, see
    :mod:`ddpkit.parallel.common.unused`; not with ZeRO or ``join()``);
    a one-dimensional ``device_mesh`` stands for its process group;
    ``mixed_precision``, ``delay_all_reduce_named_params`` and
    ``param_to_hook_all_reduce`` are refused when set; ``batched_grad_copy`` (a
    speed knob) is accepted and has no effect.

    Raises:
        DDPConfigError: (a ``RuntimeError`` and a ``ValueError``) ranks hold
            different parameters; nothing requires grad.
        ValueError: a bucket cap is not positive; ``device_ids`` for a
            CPU module; parameters on several device types; an unsupported
            argument.
        RuntimeError: uninitialised (lazy) parameters.
        ddpkit.parallel.common.reducer.UnusedParametersError: from ``backward``, see
            ``find_unused_parameters``.

    Warning:
        Every rank must run the same sequence of synchronised forwards and
        backwards: each one issues collectives.

    Example::

        ctx = ddpkit.init()
        model = ddpkit.DDP(Net().to(ctx.device))
        loss_fn(model(x), y).backward()   # .grad now holds the average over ranks
        optimizer.step()
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Any = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        zero_stage: int = 0,
        zero_units: Sequence[type[nn.Module]] | None = None,
        reshard_after_forward: bool = True,
        zero_param_dtype: torch.dtype | None = None,
        zero_reduce_dtype: torch.dtype | None = None,
        zero_init: Any = None,
        comm: str | None = None,
    ) -> None:
        super().__init__()
        # torch's arguments in torch's order, so a call written for torch's DDP
        # (positional ones included) means the same here or fails by name.
        process_group = ddp_args.mesh_group(device_mesh, process_group)
        refuse_sharded(module)
        settings = ddp_args.check_arguments(
            module, device_ids=device_ids, output_device=output_device, dim=dim,
            broadcast_buffers=broadcast_buffers, process_group=process_group, bucket_cap_mb=bucket_cap_mb,
            check_reduction=check_reduction, bucket_cap_mb_list=bucket_cap_mb_list,
            forward_sync_buffers=forward_sync_buffers, allow_meta=zero_stage == 3,
            unsupported={
                "delay_all_reduce_named_params": delay_all_reduce_named_params,
                "param_to_hook_all_reduce": param_to_hook_all_reduce, "mixed_precision": mixed_precision,
            },
        )
        ddp_args.issue(settings.warnings, stacklevel=2)
        self.module = module
        self.device_mesh = device_mesh
        self.dim = dim
        self._keep_settings(settings, bucket_cap_mb)
        self.batched_grad_copy = batched_grad_copy  # a speed knob of torch's C++ reducer: no effect here
        self.static_graph = bool(static_graph)
        self.find_unused_parameters = find_unused_parameters
        if self.static_graph and find_unused_parameters:  # torch's constructor warns so (its _set_static_graph)
            warnings.warn(_STATIC_AND_UNUSED, stacklevel=2)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.zero_stage = ddp_args.check_zero_stage(zero_stage, static_graph, gradient_as_bucket_view,
                                                    skip_all_reduce_unused_params)
        self.skip_all_reduce_unused_params = bool(skip_all_reduce_unused_params)
        self.stage3_settings = ddp_args.check_stage3(
            self.zero_stage, zero_units, reshard_after_forward, zero_param_dtype, zero_reduce_dtype, zero_init,
            device=self._input_device())
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.under_membership = process_group is None and membership.current() is not None
        """Built under ``ddpkit launch --on-failure continue`` with no group: the job's world changes as workers die,
        so this wrapper spans none and runs inside :class:`ddpkit.FaultTolerance`, which gives it the step's
        micro-batches and reduces the step (a synchronised forward outside it is refused)."""
        if self.under_membership:
            if self.zero_stage:
                raise DDPConfigError(f"DistributedDataParallel(zero_stage={self.zero_stage}) under ddpkit launch "
                                     "--on-failure continue: a ZeRO shard exists once, on the rank that dies with "
                                     "it; drop zero_stage (the mode keeps whole replicas), or use --on-failure "
                                     "restart")
            if comm is not None and str(comm).strip().partition(":")[0] not in ("none", "fp16", "bf16"):
                raise DDPConfigError(f"DistributedDataParallel(comm={comm!r}) under ddpkit launch --on-failure "
                                     "continue: the link's choice and PowerSGD keep a state per group, and the "
                                     "members' group changes with each death; pin comm='fp16' or 'bf16', or drop it")
        self.process_group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        """Whether the next forward broadcasts buffers: the previous forward was
        a synchronised one (torch's rule; Accelerate reads and sets it)."""
        self.local_steps = False
        """Set by :class:`ddpkit.LocalSGD` and :class:`ddpkit.DiLoCo` while their steps are local: backwards
        reduce nothing (``require_backward_grad_sync`` is off) and every forward with grad enabled still counts as
        synchronised for the buffers' broadcast, as under torch's post-local SGD hook (where DDP synchronises and
        the hook sends nothing)."""
        self._ddp_sink_clone = True
        self._init_join()
        self.parameters_to_ignore: set[str] = set(getattr(module, IGNORED_ATTRIBUTE, ()))
        """Names of parameters and buffers DDP leaves alone (torch's
        ``_set_params_and_buffers_to_ignore_for_model``)."""
        named = [(n, p) for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
        if not any(p.requires_grad for _, p in named):
            raise DDPConfigError(
                "DistributedDataParallel: the module has no parameter that requires grad, so "
                "there is nothing to synchronise; wrap a trainable module"
            )
        buffers = self._init_buffers()
        if self.world_size > 1 and init_sync:
            verify_same_parameters(named, process_group)
            states = [t for t in [p.detach() for _, p in named] + (buffers if settings.init_sync_buffers else [])
                      if not t.is_meta]  # stage 3 materialises a meta model unit by unit, from rank 0
            # Stage 3 is for models that barely fit once: its messages are a bucket's, not torch's 250 MB.
            chunk = int(self.bucket_cap_mb * 1024 * 1024) if self.zero_stage == 3 else BROADCAST_CHUNK_BYTES
            broadcast_once(states, process_group, "parameters and buffers", chunk_bytes=chunk)
        self.reducer = self._make_reducer()
        if self.device.type == "meta":  # materialised by stage 3
            self.device = self.reducer.device
            self.device_type = self.device.type
        self._logging = DDPLogging(self) if self.zero_stage < 3 else ShardedLogging(self)
        if comm is not None:
            self._use_comm(comm)

    def _use_comm(self, comm: str) -> None:
        """``comm=``: the reduction chosen from the measured link (``auto``) or pinned (see :mod:`ddpkit.comm.auto`)."""
        from ddpkit.comm import auto, schemes

        choice = schemes.parse_comm(comm)
        if choice == schemes.Scheme("none"):  # no hook: DDP's own reduction, whatever the stage
            return
        if self.zero_stage >= 2:
            raise ValueError(f"comm={comm!r} does not fit zero_stage={self.zero_stage}, whose gradients are "
                             "reduce-scattered, not all-reduced by buckets: leave comm out (or use zero_stage 0 or 1)")
        if isinstance(choice, schemes.Scheme):
            hook = schemes.pinned(choice, self.process_group)
            assert hook is not None  # "none" returned above
            self.register_comm_hook(*hook)
        else:
            self.register_comm_hook(auto.AutoComm(self.process_group, choice), auto.auto_hook)

    def _keep_settings(self, settings: ddp_args.DDPSettings, bucket_cap_mb: float | None) -> None:
        """The settings arguments, and the attributes torch's DDP exposes for them."""
        devices, caps = settings.devices, settings.bucket_cap_mb_list
        self.device_ids = settings.device_ids
        self.output_device = settings.output_device
        self.is_multi_device_module = len(devices) > 1
        self.device_type = next(iter(devices)).type if devices else "cpu"
        self.device = next(iter(self.module.parameters())).device if devices else torch.device("cpu")
        """Where the module's (first) parameter lives, as torch's DDP keeps it."""
        self.forward_sync_buffers = settings.forward_sync_buffers
        # torch's bucket configuration.
        self.bucket_cap_mb = max(caps) if caps else (DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb)
        self.bucket_bytes_cap = int(self.bucket_cap_mb * _MIB)
        self.bucket_bytes_cap_list = [int(c * _MIB) for c in caps]
        self.bucket_bytes_cap_default = bucket_cap_mb is None and not caps  # the 1 MiB first bucket
        self._bucket_cap_mb_given, self._bucket_cap_mb_list = bucket_cap_mb, list(caps)
        """The caps as given (the engine lays its buckets out by them)."""
        # What torch's DDP would do for these, or (refused by the check) their defaults.
        self.mixed_precision = None
        self.broadcast_bucket_size = BROADCAST_CHUNK_BYTES
        self.use_side_stream_for_tensor_copies = os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"

    def _make_reducer(self) -> Engine:
        return make_engine(self.module, self.process_group, self._engine_settings())

    def _engine_settings(self) -> ddp_args.EngineSettings:
        """The settings the engine is made from, as they stand now (``_set_static_graph`` and torch's ignore list
        may change them before a pickled wrapper is loaded)."""
        return ddp_args.EngineSettings(
            zero_stage=self.zero_stage, bucket_cap_mb=self._bucket_cap_mb_given,
            bucket_cap_mb_list=self._bucket_cap_mb_list, find_unused_parameters=bool(self.find_unused_parameters),
            gradient_as_bucket_view=bool(self.gradient_as_bucket_view), static_graph=self.static_graph,
            skip_all_reduce_unused_params=self.skip_all_reduce_unused_params,
            parameters_to_ignore=frozenset(self.parameters_to_ignore), stage3=self.stage3_settings)

    @property
    def _has_rebuilt_buckets(self) -> bool:
        """Whether the buckets were rebuilt in gradient order (torch's attribute; its ZeRO overlap hook reads it)."""
        return bool(getattr(self.reducer, "rebuilt", False))

    def _set_static_graph(self) -> None:
        """Turn on ``static_graph`` after construction (torch's older API; Lightning calls it)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        self.reducer.set_static_graph()
        self.static_graph = True
        self._logging.static_graph()
        if self.find_unused_parameters:
            warnings.warn(_STATIC_AND_UNUSED, stacklevel=2)

    # -- pickling (torch.save of the whole wrapper), as torch's DDP allows --------

    def __getstate__(self) -> dict[str, Any]:
        if self.zero_stage == 3:
            raise RuntimeError("a zero_stage=3 model holds this rank's shard only, and cannot be pickled whole: "
                               "save its state_dict() (the whole model) instead")
        if self.process_group is not None and self.process_group != dist.group.WORLD:
            raise RuntimeError(
                "DistributedDataParallel can be pickled only with the default process group: a "
                "subgroup cannot be found again when it is loaded; save ddpkit.unwrap(model) instead"
            )
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        # The group, the reducer (its gradient hooks and buckets) and the comm
        # hook belong to this process: rebuilt on load, the hook dropped.
        for key in ("process_group", "reducer", "_buffer_broadcast", "_logging"):
            state.pop(key, None)
        state["_buffer_ids"] = ()
        state["_had_group"] = self.process_group is not None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        had_group = state.pop("_had_group", True)
        grouped = dist.is_available() and dist.is_initialized()
        if had_group and not grouped:
            raise DDPConfigError(  # torch raises ValueError here; RuntimeError as ddpkit did
                "this DistributedDataParallel was pickled in a job with a process group, and none "
                "exists here: call ddpkit.init() before loading it, or load the plain module "
                "(save ddpkit.unwrap(model) instead)"
            )
        if "bucket_caps_given" in state:  # pickled before the caps went by torch's names
            state["_bucket_cap_mb_given"], caps = state.pop("bucket_caps_given")
            state["_bucket_cap_mb_list"] = list(caps)
        state.setdefault("local_steps", False)  # pickled before LocalSGD and DiLoCo set it
        super().__setstate__(state)
        self.process_group = dist.group.WORLD if grouped and had_group else None
        self.under_membership = self.process_group is None and membership.current() is not None
        self.world_size = 1 if self.process_group is None else dist.get_world_size(self.process_group)
        self._buffer_broadcast = None
        self.reducer = self._make_reducer()
        self._logging = DDPLogging(self) if self.zero_stage < 3 else ShardedLogging(self)

    # Under torch.compile, Dynamo skips this frame and the bookkeeping before and after the module (collectives,
    # hooks, the stall record's clock), with no graph break, and compiles the module as a frame of its own, as
    # under torch's DDP.
    @torch.compiler.disable(recursive=False)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._pre_forward(args, kwargs)
        return self._post_forward(self.module(*args, **kwargs))

    @torch.compiler.disable
    def _pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Buffers out, the buckets rebuilt when due, inputs to the device."""
        grad = torch.is_grad_enabled()
        sync = self.require_backward_grad_sync and grad
        if sync and self.under_membership:
            raise DDPConfigError("DistributedDataParallel under ddpkit launch --on-failure continue trains inside "
                                 "ddpkit.FaultTolerance (the job's world changes as workers die): pass this wrapper "
                                 "to FaultTolerance(model, optimizer, dataset, batch_size) and run its forwards in "
                                 "the steps it gives (a forward under torch.no_grad() runs anywhere)")
        if sync:
            self._logging.forward_start()
        joining = self._join_config.enable and self.world_size > 1
        div_factor = self._join_step(sync, grad) if joining else self.world_size
        # torch's rule: buffers go out from rank 0 when the previous forward
        # was a synchronised one, so the first synchronised forward after a
        # no_sync() block keeps each rank's own statistics. Under join(), from
        # the highest rank still training (rank 0 may have stopped).
        if self.require_forward_param_sync and self.forward_sync_buffers and self.world_size > 1:
            self.sync_module_buffers(self.join_source_rank(True) if joining and self._has_buffers() else 0)
        self.reducer.div_factor = div_factor
        if grad:
            self.reducer.rebuild_if_due()  # torch's rule: at any forward with grad enabled, no_sync() too
        device = self._input_device()
        if device is not None:
            args, kwargs = to_device(args, device), to_device(kwargs, device)
        return args, kwargs

    def _input_device(self) -> torch.device | None:
        """The device of ``device_ids`` (where inputs go), or ``None``."""
        if self.device_ids is None:
            return None
        first = self.device_ids[0]
        return torch.device("cuda", first) if isinstance(first, int) else torch.device(first)

    @torch.compiler.disable
    def _post_forward(self, output: Any) -> Any:
        """Arm the reducer (or not) and pass the output through the sink where torch's DDP does.

        As torch's DDP, whether the backward synchronises is read after the module ran: Lightning's
        manual optimisation turns ``require_backward_grad_sync`` off inside the forward and arms the
        reducer itself before each backward (``model.reducer.prepare_for_backward``).
        """
        grad = torch.is_grad_enabled()
        sync = self.require_backward_grad_sync and grad
        if sync:
            self.reducer.prepare_for_backward()
            self._logging.forward_end()
        elif grad and self.zero_stage >= 2:
            # Stages 2 and 3 keep their own rule: the next backward accumulates. torch's DDP leaves its reducer as
            # it is at a forward under no_sync(): a synchronised forward's arming stands until a backward uses it,
            # so a no_sync() micro-batch run between that forward and its backward is the one reduced (kept).
            self.reducer.disarm()
        self.require_forward_param_sync = sync or (grad and self.local_steps)
        # torch's rule for its sink: every forward with find_unused_parameters, and a static graph's
        # forwards until its first backward. Every other synchronised backward is anchored on the output's
        # nodes instead, the outputs untouched as under torch: the end-of-backward callback goes on the
        # backward the loss started, not on a reentrant checkpoint's inner one, where the first gradients
        # may arrive (the callback ran when that ended, before the parameters in front of the checkpoint
        # had their gradients: they were reported unused). torch queues it when the last bucket is ready.
        first_static = self.static_graph and not self.reducer.static.counted
        if (self.find_unused_parameters and not self.static_graph and self.zero_stage < 3) or first_static:
            output = through_sink(output, self.reducer, self._ddp_sink_clone)
        elif sync and (self.static_graph or self.zero_stage < 3):
            anchor_end_of_backward(output, self.reducer)
        return output

    # torch's helpers for placing inputs and outputs, kept for code written against them (ddpkit's forward
    # moves inputs to the module's device itself).

    def to_kwargs(self, inputs: Any, kwargs: Any, device_id: int | None) -> tuple[tuple, tuple]:
        """``inputs`` and ``kwargs`` moved to ``device_id`` of this model's device type, as
        ``((inputs,), (kwargs,))``."""
        device = torch.device(self.device_type, device_id)
        return padded([to_device(tuple(inputs), device)] if inputs else [],
                      [to_device(dict(kwargs), device)] if kwargs else [])

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[Any]) -> tuple[tuple, tuple]:
        """``inputs`` and ``kwargs`` split along ``dim`` over ``device_ids``: one ``(inputs, kwargs)`` per device."""
        devices = [torch.device(self.device_type, d) if isinstance(d, int) else torch.device(d) for d in device_ids]
        return padded(scatter(tuple(inputs), devices, self.dim) if inputs else [],
                      scatter(dict(kwargs), devices, self.dim) if kwargs else [])

    def gather(self, outputs: Sequence[Any], output_device: Any) -> Any:
        """The replicas' ``outputs`` joined along ``dim`` on ``output_device`` (scalars stacked)."""
        device = torch.device(self.device_type, output_device) if isinstance(output_device, int) \
            else torch.device(output_device)
        return gather(list(outputs), device, self.dim)

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Whether the outputs passed through the sink are copies (torch's switch; default True)."""
        self._ddp_sink_clone = val

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward/backward inside accumulate gradients locally and communicate nothing.

        The first synchronised backward after it reduces the accumulated sum,
        so K micro-batches under ``no_sync`` (all but the last) equal one step
        over their union.

        Example::

            with model.no_sync():
                for x in micro_batches[:-1]:
                    loss_fn(model(x)).backward()
            loss_fn(model(micro_batches[-1])).backward()
        """
        previous = self.require_backward_grad_sync, self.local_steps
        self.require_backward_grad_sync = self.local_steps = False  # (local steps too: as torch's, no broadcast)
        try:
            yield
        finally:
            self.require_backward_grad_sync, self.local_steps = previous

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's way to accumulate gradients without reducing them, under ``zero_stage=3``: off, the backwards
        accumulate each unit's gradients whole (every unit's, or with ``recurse=False`` the root unit's only); on
        again, the next backward reduces the sums. The units are still gathered at each forward, as FSDP2's.

        As FSDP2's, the switch is read in backward, when a unit's gradients are in, where ``no_sync()`` is read at
        the forward, as DDP's: a backward reduces a unit when the last forward before it ran outside ``no_sync()``
        and the unit's switch is on then. :meth:`zero_grad` keeps the sums made with the switch off (FSDP2's
        ``zero_grad()`` does not reach them either) and drops those of ``no_sync()``.

        Example::

            model.set_requires_gradient_sync(False)
            for x in micro_batches[:-1]:
                loss_fn(model(x)).backward()
            model.set_requires_gradient_sync(True)
            loss_fn(model(micro_batches[-1])).backward()

        Raises:
            RuntimeError: under ``zero_stage`` 0, 1 or 2 (DDP's replicas): use :meth:`no_sync`.
        """
        if self.zero_stage != 3:
            raise RuntimeError(f"set_requires_gradient_sync() is FSDP2's switch, for zero_stage=3; this model has "
                               f"zero_stage={self.zero_stage}: accumulate under model.no_sync() instead")
        self.reducer.set_requires_gradient_sync(requires_gradient_sync, recurse=recurse)

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]``.

        The future's value is the bucket's reduced (averaged) flat tensor.
        ``ddpkit.hooks`` has ready-made hooks; torch's
        ``ddp_comm_hooks.default_hooks`` work too. Call once, before training.

        As torch's: the hook must take a parameter named ``bucket``; an
        annotated ``bucket`` must be a ``GradBucket`` and an annotated return a
        ``torch.futures.Future[torch.Tensor]`` (``ValueError`` otherwise).

        Under ``ddpkit launch --on-failure continue`` :class:`ddpkit.FaultTolerance` calls the hook on each
        step's gradients, bucket by bucket, with the members' group in place of a ``None`` state (other states
        are refused there, see ``FaultTolerance``).
        """
        if callable(hook):
            check_hook_signature(hook)
        self.reducer.register_comm_hook(state, hook)
        self._logging.comm_hook(getattr(hook, "__qualname__", repr(hook)))

    @property
    def comm_state(self) -> Any:
        """The state :meth:`register_comm_hook` gave the hook (``None`` without one): what a checkpoint keeps of
        the hook, e.g. a ``PowerSGDState``'s ``state_dict()``."""
        return getattr(self.reducer, "comm_state", None)

    def bucket_indices(self) -> list[list[int]]:
        """Each bucket's parameters, as indices into the parameters that require grad (in ``parameters()``
        order), as the gradients are reduced now: what :meth:`restore_buckets` takes back.

        Raises:
            RuntimeError: under ``zero_stage=3`` (its units stand for buckets).
        """
        if self.zero_stage == 3:
            raise RuntimeError("bucket_indices(): zero_stage=3 reduces unit by unit, not in buckets")
        return self.reducer.bucket_indices()

    @property
    def buckets_final(self) -> bool:
        """Whether :meth:`bucket_indices` are the buckets the run goes on in: after the rebuild (at the second
        forward; a static graph's third), or from the start when none comes. A checkpoint keeps them only then."""
        return self.zero_stage < 3 and self.reducer.buckets_final

    def restore_buckets(self, indices: Sequence[Sequence[int]]) -> None:
        """Reduce in the buckets :meth:`bucket_indices` gave for a run of this model, from the first backward on
        (no rebuild after it): a resumed run reduces as the run that saved it did, which a comm hook that keeps
        state per bucket (PowerSGD's error feedback and warm start) needs to go on exactly. Call it before the
        first backward. torch's DDP has no such method (it rebuilds after the first step, always).

        Raises:
            RuntimeError: after the first synchronised backward, or under ``zero_stage`` 2 or 3 (their buckets
                are their shards').
            ValueError: ``indices`` does not hold each parameter once.
        """
        if self.zero_stage >= 2:
            raise RuntimeError(f"restore_buckets(): zero_stage={self.zero_stage} lays out its own shards")
        self.reducer.restore_buckets(indices)

    def register_observer(self, observer: Observer) -> ObserverHandle:
        """Call ``observer`` at the engine's events: a bucket ready, launched, reduced, and the wait at the end
        of backward, with bucket index, bytes and times (see :mod:`ddpkit.parallel.common.observer`).

        Returns:
            A handle whose ``remove()`` detaches the observer.
        """
        return self.reducer.add_observer(observer)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's built-in hooks by type: ``dist.BuiltinCommHookType.ALLREDUCE`` or ``FP16_COMPRESS``."""
        from ddpkit.comm.bucket_hooks import allreduce_hook, fp16_compress_hook

        hooks = {"ALLREDUCE": allreduce_hook, "FP16_COMPRESS": fp16_compress_hook}
        name = getattr(comm_hook_type, "name", str(comm_hook_type))
        if name not in hooks:
            raise ValueError(f"comm_hook_type={comm_hook_type!r}: use dist.BuiltinCommHookType.ALLREDUCE or "
                             "FP16_COMPRESS, or register a hook with register_comm_hook()")
        self.reducer.register_comm_hook(self.process_group, hooks[name])  # the model's group, as torch's
        self._logging.comm_hook(str(comm_hook_type))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``; under ZeRO stage 3 also the gradients a ``no_sync()`` accumulation holds whole
        in the gathered units (DDP's are in ``.grad``, which this clears). Sums made with FSDP2's switch off
        (:meth:`set_requires_gradient_sync`) alone stay, as under FSDP2."""
        super().zero_grad(set_to_none)
        if self.zero_stage == 3:
            self.reducer.drop_accumulated()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that their global ``norm_type``-norm is at most ``max_norm``; return that norm
        (a plain tensor, the same on every rank). Under ZeRO the gradients are sharded and the norm is a
        collective: call it on every rank. Stage 2's shards are the reducer's (see
        :func:`ddpkit.parallel.zero.norm.clip_grad_norm`); stage 3's are DTensors, which torch's own
        ``clip_grad_norm_`` over ``model.parameters()`` clips as well."""
        if self.zero_stage == 2:
            return clip_sharded_grad_norm(self, max_norm, norm_type)
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm, norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's logging data of this model: settings, environment and sampled runtime figures (see
        :mod:`ddpkit.parallel.ddp.logging_data`). Like torch's, a prototype interface: print it to see how DDP runs."""
        return self._logging.data()

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """After the first 10 synchronised iterations, sample the runtime figures once every ``sample_rate``."""
        self._logging.set_sample_rate(sample_rate)

DDP = DistributedDataParallel

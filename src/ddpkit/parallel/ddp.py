"""``DistributedDataParallel``: the module wrapper around :class:`ddpkit.parallel.reducer.Reducer`.

Construction checks that every rank holds the same parameters, broadcasts
parameters and buffers from rank 0 (coalesced), and hands the parameters that
require grad to a reducer. Each forward that will be followed by a
synchronised backward broadcasts buffers (``broadcast_buffers=True``) and arms
the reducer; the backward then all-reduces gradients bucket by bucket while
autograd is still running, and leaves the average in ``.grad``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.comm.bucket import CommHook
from ddpkit.parallel.reducer import Reducer

_BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024
"""Largest message of a coalesced broadcast."""


class DDPConfigError(ValueError, RuntimeError):
    """The model cannot be wrapped as given (nothing to train, ranks that differ).

    A ``RuntimeError``, as torch raises for these mistakes, and a ``ValueError``
    as earlier ddpkit versions did: either ``except`` catches it.
    """


class _PackedBroadcast:
    """Broadcast rank 0's values of a fixed list of tensors, one message per device.

    Tensors of every dtype travel together as raw bytes at aligned offsets of
    a persistent buffer, so BatchNorm's float statistics and integer counters
    cost one collective, and a repeated broadcast (buffers, every forward)
    allocates nothing: rank 0 only packs, the others only unpack.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
        self.group = group
        self.src = dist.get_global_rank(group, 0)
        self.is_src = dist.get_rank(group) == 0
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
        self.packs: list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        for device, members in by_device.items():
            offsets, size = [], 0
            for t in members:
                offsets.append(size)
                size += -(-_nbytes(t) // _ALIGN) * _ALIGN
            packed = torch.empty(size, dtype=torch.uint8, device=device)
            pairs = [(t, packed[o : o + _nbytes(t)].view(t.dtype).view(t.shape)) for t, o in zip(members, offsets)]
            self.packs.append((packed, pairs))

    def __call__(self) -> None:
        # Same devices, tensors and sizes in the same order on every rank (the
        # parameters were verified identical), so the broadcasts match up.
        with torch.no_grad():
            for packed, pairs in self.packs:
                if self.is_src:
                    for t, view in pairs:
                        view.copy_(t)
                dist.broadcast(packed, src=self.src, group=self.group)
                if not self.is_src:
                    for t, view in pairs:
                        t.copy_(view)


_ALIGN = 16
"""Byte alignment of each tensor in a packed broadcast (any dtype can be viewed there)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _broadcast_once(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` with rank 0's values in messages of at most 250 MB."""
    chunk: list[torch.Tensor] = []
    size = 0
    for t in list(tensors) + [None]:  # type: ignore[list-item]
        if t is not None and (not chunk or size + _nbytes(t) <= _BROADCAST_CHUNK_BYTES):
            chunk.append(t)
            size += _nbytes(t)
            continue
        if chunk:
            _PackedBroadcast(chunk, group)()
        if t is not None:
            chunk, size = [t], _nbytes(t)


def _verify_same_parameters(named: Sequence[tuple[str, torch.Tensor]], group: dist.ProcessGroup) -> None:
    """Raise on every rank if the ranks' parameters differ, naming the first difference."""
    mine = [(n, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad) for n, p in named]
    world = dist.get_world_size(group)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    longest = max(len(e) for e in everyone)
    for k in range(longest):
        entries = [e[k] if k < len(e) else None for e in everyone]
        if any(x != entries[0] for x in entries):
            name = next(x[0] for x in entries if x is not None)

            def describe(x: Any) -> str:
                if x is None:
                    return "no such parameter"
                return f"{x[0]!r} shape {list(x[1])} {x[2]}" + ("" if x[3] else " (frozen)")

            what = "; ".join(f"rank {r} has {describe(x)}" for r, x in enumerate(entries))
            counts = ", ".join(f"rank {r}: {len(e)}" for r, e in enumerate(everyone))
            raise DDPConfigError(
                f"DistributedDataParallel: the ranks hold different parameters (counts {counts}); "
                f"first difference at parameter #{k} {name!r}: {what}. Build the same model with "
                "the same arguments and the same requires_grad flags on every rank before wrapping it"
            )


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_device(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    return obj


class DistributedDataParallel(nn.Module):
    """Data parallelism: same model on every rank, gradients averaged during backward.

    Args:
        module: the model, already on its device, identical on every rank.
        device_ids: for a single-device CUDA module, ``[device]``; inputs are
            moved there before forward. ``None`` (default) leaves them alone.
        output_device: accepted for torch compatibility; outputs stay where the
            module puts them.
        broadcast_buffers: broadcast buffers (BatchNorm statistics) from rank 0
            before each forward while gradient sync is on. Default True.
        bucket_cap_mb: bucket size cap in MiB (the first bucket is 1 MiB).
            Default 25.
        find_unused_parameters: allow parameters that get no gradient in some
            iterations (reduced as zeros; untouched when unused on every rank).
            Default False: an unused parameter raises at the end of backward.
        gradient_as_bucket_view: make ``.grad`` a view into bucket memory,
            saving a copy and a gradient-sized buffer. Default False.
        process_group: the group to average over; default the world.

    The constructor takes torch's arguments in torch's order. ``dim`` is kept
    for compatibility (one device per process: nothing is scattered);
    ``init_sync=False`` skips the construction-time check and broadcast;
    ``check_reduction`` is ignored as by torch; ``static_graph``,
    ``mixed_precision``, ``device_mesh``, ``delay_all_reduce_named_params``,
    ``param_to_hook_all_reduce``, ``skip_all_reduce_unused_params`` and
    ``bucket_cap_mb_list`` are refused when set.

    Raises:
        DDPConfigError: (a ``RuntimeError`` and a ``ValueError``) ranks hold
            different parameters; nothing requires grad.
        ValueError: ``bucket_cap_mb`` is not positive; ``device_ids`` for a
            CPU module; parameters on several device types; an unsupported
            argument.
        RuntimeError: uninitialised (lazy) parameters.
        ddpkit.parallel.reducer.UnusedParametersError: from ``backward``, see
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
        broadcast_buffers: bool | None = True,
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
    ) -> None:
        super().__init__()
        # torch's arguments in torch's order, so a call written for torch's DDP
        # (positional ones included) means the same here or fails by name.
        unsupported = {
            "static_graph": static_graph, "delay_all_reduce_named_params": delay_all_reduce_named_params,
            "param_to_hook_all_reduce": param_to_hook_all_reduce, "mixed_precision": mixed_precision,
            "device_mesh": device_mesh, "skip_all_reduce_unused_params": skip_all_reduce_unused_params,
            "bucket_cap_mb_list": bucket_cap_mb_list,
        }
        given = [k for k, v in unsupported.items() if v not in (None, False)]
        if given:
            raise ValueError(
                f"DistributedDataParallel({', '.join(f'{k}=...' for k in given)}): not supported by ddpkit's "
                "DDP yet; leave it at its default (use a process_group instead of a device_mesh, "
                "torch.autocast instead of mixed_precision)"
            )
        if not isinstance(dim, int):
            raise TypeError(f"dim={dim!r} must be an int (the batch dimension)")
        del check_reduction, batched_grad_copy  # torch ignores the first; the second is a speed knob
        if bucket_cap_mb is None:
            bucket_cap_mb = 25.0
        if broadcast_buffers is None:
            broadcast_buffers = True
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb} must be positive: the default is 25")
        if device_ids is not None and len(device_ids) != 1:
            raise ValueError(
                f"device_ids={list(device_ids)}: ddpkit drives one device per process; "
                "pass device_ids=[local_rank] or None"
            )
        devices = {p.device for p in module.parameters()}
        if len({d.type for d in devices}) > 1:
            raise ValueError(
                "DistributedDataParallel's input module must be on the same type of devices, but its "
                f"parameters are on {sorted(str(d) for d in devices)}: move the whole module with .to(device)"
            )
        if device_ids is not None and any(d.type == "cpu" for d in devices):
            raise ValueError(
                f"DistributedDataParallel(device_ids={list(device_ids)}) only works with a GPU module, but "
                f"this module's parameters are on {sorted(str(d) for d in devices)}: pass device_ids=None "
                "for a CPU module, or move the module to the GPU first"
            )
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters()):
            raise RuntimeError(
                "DistributedDataParallel: the module has uninitialized (lazy) parameters: run a dummy "
                "forward pass to initialise them before wrapping"
            )
        self.module = module
        self.dim = dim
        self.device_ids = list(device_ids) if device_ids is not None else None
        self.output_device = output_device
        self.broadcast_buffers = broadcast_buffers
        self.forward_sync_buffers = broadcast_buffers if forward_sync_buffers is None else forward_sync_buffers
        self.static_graph = False
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.process_group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        self.require_backward_grad_sync = True

        named = list(module.named_parameters())
        trainable = [(n, p) for n, p in named if p.requires_grad]
        if not trainable:
            raise DDPConfigError(
                "DistributedDataParallel: the module has no parameter that requires grad, so "
                "there is nothing to synchronise; wrap a trainable module"
            )
        buffers = list(module.buffers())
        self._buffer_broadcast: _PackedBroadcast | None = None
        self._buffer_ids: tuple[int, ...] = ()
        self.require_forward_param_sync = True
        """Whether the next forward broadcasts buffers: the previous forward was
        a synchronised one (torch's rule; Accelerate reads and sets it)."""
        if self.world_size > 1 and init_sync:
            _verify_same_parameters(named, process_group)
            _broadcast_once([p.detach() for _, p in named] + buffers, process_group)
        self.bucket_cap_mb = bucket_cap_mb
        self.reducer = self._make_reducer()

    def _make_reducer(self) -> Reducer:
        trainable = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        return Reducer(
            trainable,
            process_group=self.process_group,
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )

    # -- pickling (torch.save of the whole wrapper), as torch's DDP allows --------

    def __getstate__(self) -> dict[str, Any]:
        if self.process_group is not None and self.process_group != dist.group.WORLD:
            raise RuntimeError(
                "DistributedDataParallel can be pickled only with the default process group: a "
                "subgroup cannot be found again when it is loaded; save ddpkit.unwrap(model) instead"
            )
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        # The group, the reducer (its gradient hooks and buckets) and the comm
        # hook belong to this process: rebuilt on load, the hook dropped.
        for key in ("process_group", "reducer", "_buffer_broadcast"):
            state.pop(key, None)
        state["_buffer_ids"] = ()
        state["_had_group"] = self.process_group is not None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        had_group = state.pop("_had_group", True)
        grouped = dist.is_available() and dist.is_initialized()
        if had_group and not grouped:
            raise RuntimeError(
                "this DistributedDataParallel was pickled in a job with a process group, and none "
                "exists here: call ddpkit.init() before loading it, or load the plain module "
                "(save ddpkit.unwrap(model) instead)"
            )
        super().__setstate__(state)
        self.process_group = dist.group.WORLD if grouped and had_group else None
        self.world_size = 1 if self.process_group is None else dist.get_world_size(self.process_group)
        self._buffer_broadcast = None
        self.reducer = self._make_reducer()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        sync = self.require_backward_grad_sync
        # torch's rule: buffers go out from rank 0 when the previous forward
        # was a synchronised one, so the first synchronised forward after a
        # no_sync() block keeps each rank's own statistics.
        if self.require_forward_param_sync and self.forward_sync_buffers and self.world_size > 1:
            self._sync_buffers()
        if sync and torch.is_grad_enabled():
            self.reducer.prepare_for_backward()
        elif torch.is_grad_enabled():
            self.reducer.disarm()
        if self.device_ids is not None:
            device = torch.device("cuda", self.device_ids[0]) if isinstance(self.device_ids[0], int) else torch.device(self.device_ids[0])
            args, kwargs = _to_device(args, device), _to_device(kwargs, device)
        output = self.module(*args, **kwargs)
        self.require_forward_param_sync = torch.is_grad_enabled() and sync
        return output

    def _sync_buffers(self) -> None:
        """Broadcast rank 0's buffers; collected again each time, in case the model reassigned one."""
        buffers = list(self.module.buffers())
        if not buffers:
            return
        ids = tuple(id(b) for b in buffers)
        if ids != self._buffer_ids:
            # Same structure on every rank, so every rank rebuilds here together.
            self._buffer_broadcast = _PackedBroadcast(buffers, self.process_group)
            self._buffer_ids = ids
        self._buffer_broadcast()

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
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]``.

        The future's value is the bucket's reduced (averaged) flat tensor.
        ``ddpkit.hooks`` has ready-made hooks; torch's
        ``ddp_comm_hooks.default_hooks`` work too. Call once, before training.
        """
        self.reducer.register_comm_hook(state, hook)


DDP = DistributedDataParallel


def unwrap(model: nn.Module) -> nn.Module:
    """Return the plain module inside DDP / DataParallel / ``torch.compile`` wrappers.

    Works for ddpkit's and torch's wrappers, nested in any order; a plain
    module is returned as is.

    Example::

        torch.save(ddpkit.unwrap(model).state_dict(), "model.pt")
    """
    while True:
        if isinstance(model, nn.Module) and hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif type(model).__name__ in ("DistributedDataParallel", "DataParallel") and isinstance(
            getattr(model, "module", None), nn.Module
        ):
            model = model.module
        else:
            return model

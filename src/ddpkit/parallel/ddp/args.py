"""``DistributedDataParallel``'s arguments checked and their defaults decided, as torch 2.13 decides them: one pure
function.

:func:`check_arguments` reads the module and the arguments, communicates nothing and
changes nothing; it returns what the wrapper keeps (:class:`DDPSettings`),
with the warnings torch gives for deprecated arguments, for the wrapper to
issue at its caller's line.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.parallel.common.bucket_caps import check_bucket_cap

__all__ = ["DDPSettings", "EngineSettings", "check_arguments", "check_zero_stage"]


@dataclass(frozen=True)
class DDPSettings:
    """What ``DistributedDataParallel`` keeps of its arguments."""

    device_ids: list[Any] | None
    """One device id, or None (a CPU module, or a module that places itself)."""
    output_device: Any
    devices: frozenset[torch.device]
    """Where the module's parameters are."""
    forward_sync_buffers: bool
    """Broadcast buffers before each forward that follows a synchronised one."""
    init_sync_buffers: bool
    """Include buffers in the construction broadcast (all but torch's old ``broadcast_buffers=False``)."""
    bucket_cap_mb_list: list[float]
    """As given, or empty."""
    warnings: list[tuple[str, type[Warning]]] = field(default_factory=list)
    """Warnings to issue at the caller's line (deprecated arguments)."""


@dataclass(frozen=True)
class EngineSettings:
    """What the engine of a ``DistributedDataParallel`` is made from (:func:`ddpkit.parallel.ddp.engine.make_engine`):
    the wrapper's settings when it makes one (at construction, and again when a pickled wrapper is loaded)."""

    zero_stage: int
    bucket_cap_mb: float | None
    """As given (``None``: torch's default, with a small first bucket)."""
    bucket_cap_mb_list: list[float]
    """As given, or empty."""
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    static_graph: bool
    skip_all_reduce_unused_params: bool
    parameters_to_ignore: frozenset[str]
    """torch's ``_set_params_and_buffers_to_ignore_for_model`` names."""
    stage3: dict[str, Any]
    """Stage 3's own arguments (:func:`check_stage3`)."""


def check_arguments(
    module: nn.Module,
    *,
    device_ids: Sequence[int | torch.device] | None,
    output_device: int | torch.device | None,
    dim: Any,
    broadcast_buffers: bool | None,
    process_group: Any,
    bucket_cap_mb: float | None,
    check_reduction: bool,
    bucket_cap_mb_list: Any,
    forward_sync_buffers: bool | None,
    unsupported: dict[str, Any],
    allow_meta: bool = False,
) -> DDPSettings:
    """Check ``DistributedDataParallel``'s arguments against ``module``; decide the defaults.

    Args:
        unsupported: torch's arguments ddpkit does not implement, by name:
            any set to something other than ``None``/``False`` is refused.
        allow_meta: parameters on the meta device are accepted (ZeRO stage 3 materialises them).

    Raises:
        ValueError: an unsupported argument; a bad bucket cap; ``device_ids``
            with more than one device or for a CPU module; ``output_device``
            without a single-device GPU module; parameters on several device
            types; torch's ``nn.SyncBatchNorm`` in a CPU module.
        TypeError: ``dim`` is not an int; ``process_group`` is not a group.
        RuntimeError: parameters on the meta device, or uninitialised (lazy) ones.
    """
    given = [k for k, v in unsupported.items() if v not in (None, False)]
    if given:
        raise ValueError(
            f"DistributedDataParallel({', '.join(f'{k}=...' for k in given)}): not supported by ddpkit's "
            "DDP yet; leave it at its default (torch.autocast instead of mixed_precision)"
        )
    if not isinstance(dim, int):
        raise TypeError(f"dim={dim!r} must be an int (the batch dimension)")
    tensor_module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists until it is imported
    dtensors = [n for n, p in module.named_parameters()
                if tensor_module is not None and isinstance(p, tensor_module.DTensor)]
    if dtensors:
        raise ValueError(f"DistributedDataParallel: parameters {dtensors[:3]} are DTensors (tensor parallelism), "
                         "which ddpkit's DDP does not shard or reduce; wrap a module of plain tensors")
    notes: list[tuple[str, type[Warning]]] = []
    if check_reduction:
        notes.append(("The `check_reduction` argument of DistributedDataParallel is deprecated (torch's) and "
                      "has no effect: leave it out", FutureWarning))
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group={process_group!r} is not a torch.distributed.ProcessGroup: pass "
                        "None (the world) or a group from torch.distributed.new_group()")
    if broadcast_buffers is not None:
        notes.append((
            "`broadcast_buffers` is deprecated (torch 2.13) and ignored when `forward_sync_buffers` is given"
            if forward_sync_buffers is not None else
            "`broadcast_buffers` is deprecated (torch 2.13): use `forward_sync_buffers`. Unlike "
            "`broadcast_buffers=False`, `forward_sync_buffers=False` still broadcasts buffers at construction",
            FutureWarning,
        ))
    # torch's rule: forward_sync_buffers wins; the construction broadcast skips buffers only
    # under the old broadcast_buffers=False.
    if forward_sync_buffers is None:
        forward_sync_buffers = init_sync_buffers = broadcast_buffers is not False
    else:
        init_sync_buffers = True
    caps = list(bucket_cap_mb_list or ())
    check_bucket_cap(bucket_cap_mb)
    for i, cap in enumerate(caps):
        check_bucket_cap(cap, f"bucket_cap_mb_list[{i}]")
    device_ids = _device_ids(device_ids)
    devices = frozenset(p.device for p in module.parameters())
    _check_devices(module, devices, device_ids, output_device, allow_meta)
    output = (device_ids[0] if output_device is None else output_device) if device_ids else None
    return DDPSettings(device_ids=device_ids, output_device=output, devices=devices,
                       forward_sync_buffers=bool(forward_sync_buffers), init_sync_buffers=init_sync_buffers,
                       bucket_cap_mb_list=caps, warnings=notes)


def mesh_group(device_mesh: Any, process_group: Any) -> Any:
    """The process group of a one-dimensional ``device_mesh`` (torch's rule), or ``process_group`` without one.

    Raises:
        RuntimeError: both given; a mesh of more than one dimension.
        TypeError: ``device_mesh`` is not a ``DeviceMesh``.
    """
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments: pass one of them")
    if not callable(getattr(device_mesh, "get_group", None)) or not hasattr(device_mesh, "ndim"):
        raise TypeError(f"device_mesh={device_mesh!r} is not a torch.distributed.device_mesh.DeviceMesh: make one "
                        "with torch.distributed.device_mesh.init_device_mesh(device_type, (world_size,))")
    if device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}: pass its data-parallel "
                           "dimension, e.g. mesh['dp']")
    return device_mesh.get_group(mesh_dim=0)


def _device_ids(device_ids: Sequence[int | torch.device] | None) -> list[Any] | None:
    if device_ids is not None and len(device_ids) == 0:
        return None  # torch's: an empty list means none
    if device_ids is not None and len(device_ids) != 1:
        raise ValueError(
            f"device_ids={list(device_ids)}: ddpkit drives one device per process; "
            "pass device_ids=[local_rank] or None"
        )
    return list(device_ids) if device_ids is not None else None


def _check_devices(module: nn.Module, devices: frozenset[torch.device], device_ids: list[Any] | None,
                   output_device: Any, allow_meta: bool) -> None:
    where = sorted(str(d) for d in devices)
    on_cpu = any(d.type == "cpu" for d in devices)
    if allow_meta and devices == {torch.device("meta")}:
        return
    if len({d.type for d in devices}) > 1:
        raise ValueError(
            "DistributedDataParallel's input module must be on the same type of devices, but its "
            f"parameters are on {where}: move the whole module with .to(device)"
        )
    if device_ids is not None and on_cpu:
        raise ValueError(
            f"DistributedDataParallel(device_ids={device_ids}) only works with a GPU module, but "
            f"this module's parameters are on {where}: pass device_ids=None "
            "for a CPU module, or move the module to the GPU first"
        )
    if device_ids is None and output_device and (on_cpu or len(devices) > 1):
        raise ValueError(
            f"DistributedDataParallel(output_device={output_device!r}) only works with a single-device GPU "
            f"module, but this module's parameters are on {where}: leave "
            "output_device out (the module itself decides where its outputs go)"
        )
    if any(d.type == "meta" for d in devices):
        raise RuntimeError(
            "DistributedDataParallel: the module has parameters on the meta device (no data to broadcast or "
            "reduce): materialise them first, e.g. module.to_empty(device=...) and initialise, then wrap; or "
            "wrap it with zero_stage=3, which materialises it shard by shard"
        )
    if on_cpu and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        raise ValueError(
            "torch's SyncBatchNorm layers only work with GPU modules (as under torch's DDP): on CPU use "
            "ddpkit.SyncBatchNorm.convert_sync_batchnorm(model), which synchronises over gloo"
        )
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters()):
        raise RuntimeError(
            "DistributedDataParallel: the module has uninitialized (lazy) parameters: run a dummy "
            "forward pass to initialise them before wrapping"
        )


def issue(notes: list[tuple[str, type[Warning]]], stacklevel: int) -> None:
    """Issue the warnings the check gathered; ``stacklevel`` as for :func:`warnings.warn` from the caller."""
    for message, category in notes:
        warnings.warn(message, category, stacklevel=stacklevel + 1)


def check_zero_stage(stage: Any, static_graph: bool, gradient_as_bucket_view: bool,
                     skip_unused: bool = False) -> int:
    """``zero_stage`` as an int, refused with the reason where it cannot work.

    Raises:
        ValueError: a stage other than 0, 2 and 3, or stage 2 or 3 with ``static_graph``,
            ``gradient_as_bucket_view`` or ``skip_all_reduce_unused_params``.
    """
    if stage not in (0, 2, 3) or isinstance(stage, bool):
        hint = (" (stage 1 shards the optimizer state only: ddpkit.ZeroRedundancyOptimizer over a model with "
                "zero_stage=0)" if stage == 1 else "")
        raise ValueError(f"zero_stage={stage!r}: use 0 (every rank gets every averaged gradient), 2 (each rank "
                         f"keeps its shard of the gradients) or 3 (of the parameters too){hint}")
    if stage and static_graph:
        raise ValueError(f"zero_stage={stage} does not support static_graph=True: drop one of them")
    if stage and gradient_as_bucket_view:
        raise ValueError(f"zero_stage={stage} with gradient_as_bucket_view=True: the buckets of stage {stage} exist "
                         "only while they are reduced, so no gradient can live in them; drop gradient_as_bucket_view")
    if stage and skip_unused:
        raise ValueError(f"zero_stage={stage} with skip_all_reduce_unused_params=True: every rank reduces every "
                         f"bucket of stage {stage}; drop skip_all_reduce_unused_params")
    return int(stage)


def check_stage3(stage: int, units: Any, reshard_after_forward: Any, param_dtype: Any, reduce_dtype: Any,
                 init: Any = None, device: Any = None) -> dict[str, Any]:
    """Stage 3's own arguments as :class:`ddpkit.parallel.zero.stage3.ShardedParameters` takes them; refused,
    naming them, with another stage."""
    given = {"zero_units": units is not None, "reshard_after_forward": reshard_after_forward is not True,
             "zero_param_dtype": param_dtype is not None, "zero_reduce_dtype": reduce_dtype is not None,
             "zero_init": init is not None}
    if stage != 3 and any(given.values()):
        names = ", ".join(n for n, g in given.items() if g)
        raise ValueError(f"{names} apply to zero_stage=3 only (zero_stage={stage} here): drop them or use zero_stage=3")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward={reshard_after_forward!r}: give True (free a unit's gathered "
                         "parameters after its forward) or False (keep them until its backward)")
    return {"units": units, "reshard_after_forward": reshard_after_forward, "param_dtype": param_dtype,
            "reduce_dtype": reduce_dtype, "init": init, "device": device}

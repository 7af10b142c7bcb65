"""ddpkit: data-parallel training for PyTorch, built on torch.distributed.

Import has no side effects: nothing here touches the environment, the process
group or logging until :func:`init` is called. The public names are resolved
on first use (PEP 562), so ``ddpkit launch`` can start its workers without
paying for ``import torch`` in the launcher process first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module that defines it.
_EXPORTS = {
    "DistContext": "ddpkit.runtime.group",
    "RendezvousError": "ddpkit.runtime.rendezvous",
    "barrier": "ddpkit.runtime.group",
    "init": "ddpkit.runtime.group",
    "is_main": "ddpkit.runtime.group",
    "local_rank": "ddpkit.runtime.group",
    "print0": "ddpkit.runtime.group",
    "rank": "ddpkit.runtime.group",
    "shutdown": "ddpkit.runtime.group",
    "world_size": "ddpkit.runtime.group",
    "zero_first": "ddpkit.runtime.group",
    "WorkerError": "ddpkit.runtime.spawn",
    "all_gather_object": "ddpkit.runtime.objects",
    "broadcast_object": "ddpkit.runtime.objects",
    "gather": "ddpkit.runtime.objects",
    "gather_for_metrics": "ddpkit.runtime.objects",
    "reduce_value": "ddpkit.runtime.objects",
    "spawn": "ddpkit.runtime.spawn",
    "DDP": "ddpkit.parallel.ddp.wrapper",
    "DistributedDataParallel": "ddpkit.parallel.ddp.wrapper",
    "unwrap": "ddpkit.parallel.unwrap",
    "UnusedParametersError": "ddpkit.parallel.common.unused",
    "SyncBatchNorm": "ddpkit.parallel.syncbn",
    "DataParallel": "ddpkit.parallel.dp",
    "DistributedOptimizer": "ddpkit.parallel.horovod_optimizer",
    "broadcast_parameters": "ddpkit.parallel.common.broadcast",
    "broadcast_optimizer_state": "ddpkit.parallel.common.broadcast",
    "Compression": "ddpkit.comm.compression",
    "LocalSGD": "ddpkit.parallel.local_sgd",
    "DiLoCo": "ddpkit.parallel.diloco",
    "ZeroRedundancyOptimizer": "ddpkit.parallel.zero.stage1",
    "save_sharded": "ddpkit.parallel.zero.sharded_checkpoints",
    "load_sharded": "ddpkit.parallel.zero.sharded_checkpoints",
    "consolidate_sharded": "ddpkit.parallel.zero.sharded_checkpoints",
    "verify_sharded": "ddpkit.parallel.zero.sharded_checkpoints",
    "ParameterServerOptimizer": "ddpkit.parallel.ps.optimizer",
    "StaleSynchronousOptimizer": "ddpkit.parallel.ssp",
    "TrainState": "ddpkit.train.state",
    "FaultTolerance": "ddpkit.parallel.fault_tolerance.steps",
    "DistributedSampler": "ddpkit.data.sampler",
    "DatasetError": "ddpkit.data.datasets",
    "CheckpointError": "ddpkit.runtime.durable",
    "load_checkpoint": "ddpkit.train.checkpoint",
    "save_checkpoint": "ddpkit.train.checkpoint",
}
# Public submodules reached as attributes (``ddpkit.hooks.allreduce_hook``).
_SUBMODULES = {"collectives", "hooks"}

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ddpkit")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        return _version()
    if name in _SUBMODULES:
        value: Any = importlib.import_module(f"ddpkit.{name}")
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    # The public API only, not this module's own imports.
    return sorted([*__all__, "__version__"])


if TYPE_CHECKING:  # for type checkers and IDEs; at run time names load lazily
    from ddpkit import collectives, hooks
    from ddpkit.comm.compression import Compression
    from ddpkit.data.datasets import DatasetError
    from ddpkit.data.sampler import DistributedSampler
    from ddpkit.parallel.common.broadcast import broadcast_optimizer_state, broadcast_parameters
    from ddpkit.parallel.common.unused import UnusedParametersError
    from ddpkit.parallel.ddp.wrapper import DDP, DistributedDataParallel
    from ddpkit.parallel.dp import DataParallel
    from ddpkit.parallel.diloco import DiLoCo
    from ddpkit.parallel.local_sgd import LocalSGD
    from ddpkit.parallel.horovod_optimizer import DistributedOptimizer
    from ddpkit.parallel.ps.optimizer import ParameterServerOptimizer
    from ddpkit.parallel.ssp import StaleSynchronousOptimizer
    from ddpkit.parallel.syncbn import SyncBatchNorm
    from ddpkit.parallel.unwrap import unwrap
    from ddpkit.parallel.zero.sharded_checkpoints import consolidate_sharded, load_sharded, save_sharded, verify_sharded
    from ddpkit.parallel.zero.stage1 import ZeroRedundancyOptimizer
    from ddpkit.runtime.durable import CheckpointError
    from ddpkit.runtime.group import (
        DistContext,
        barrier,
        init,
        is_main,
        local_rank,
        print0,
        rank,
        shutdown,
        world_size,
        zero_first,
    )
    from ddpkit.runtime.objects import all_gather_object, broadcast_object, gather, gather_for_metrics, reduce_value
    from ddpkit.runtime.rendezvous import RendezvousError
    from ddpkit.runtime.spawn import WorkerError, spawn
    from ddpkit.train.checkpoint import load_checkpoint, save_checkpoint
    from ddpkit.train.state import TrainState
    from ddpkit.parallel.fault_tolerance.steps import FaultTolerance

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
    "DistContext": "ddpkit.runtime",
    "barrier": "ddpkit.runtime",
    "init": "ddpkit.runtime",
    "is_main": "ddpkit.runtime",
    "local_rank": "ddpkit.runtime",
    "print0": "ddpkit.runtime",
    "rank": "ddpkit.runtime",
    "shutdown": "ddpkit.runtime",
    "world_size": "ddpkit.runtime",
    "zero_first": "ddpkit.runtime",
    "DDP": "ddpkit.ddp",
    "DistributedDataParallel": "ddpkit.ddp",
    "unwrap": "ddpkit.ddp",
    "DistributedSampler": "ddpkit.sampler",
    "load_checkpoint": "ddpkit.checkpoint",
    "save_checkpoint": "ddpkit.checkpoint",
}
_SUBMODULES = {"hooks"}

# spawn is torch-free and imported eagerly: the function must shadow the
# submodule of the same name, which a lazy lookup would never get to do.
from ddpkit.spawn import WorkerError, spawn  # noqa: E402

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "WorkerError", "spawn"])


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value: Any = importlib.import_module(f"ddpkit.{name}")
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # for type checkers and IDEs; at run time names load lazily
    from ddpkit import hooks
    from ddpkit.checkpoint import load_checkpoint, save_checkpoint
    from ddpkit.ddp import DDP, DistributedDataParallel, unwrap
    from ddpkit.runtime import (
        DistContext, barrier, init, is_main, local_rank, print0, rank, shutdown, world_size, zero_first,
    )
    from ddpkit.sampler import DistributedSampler

"""ddpkit: data-parallel training for PyTorch, built on torch.distributed.

Import has no side effects: nothing here touches the environment, the process
group or logging until :func:`init` is called.
"""

from ddpkit.runtime import (
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
from ddpkit.spawn import WorkerError, spawn

__all__ = [
    "DistContext",
    "WorkerError",
    "barrier",
    "init",
    "is_main",
    "local_rank",
    "print0",
    "rank",
    "shutdown",
    "spawn",
    "world_size",
    "zero_first",
]

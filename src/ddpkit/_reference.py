"""torch's own implementations, for side-by-side comparison only.

The one module of ddpkit's source allowed to import ``torch.nn.parallel``,
``torch.distributed.algorithms`` and ``torch.distributed.optim``, and to build
torch's ``nn.SyncBatchNorm`` and FSDP2's ``fully_shard``: ``ddpkit bench``, ``ddpkit train --engine
torch`` and ``ddpkit doctor`` measure or check ddpkit against them. Nothing
else may use them to do ddpkit's job.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def torch_ddp(module: nn.Module, **kwargs: Any) -> nn.Module:
    """Wrap ``module`` in ``torch.nn.parallel.DistributedDataParallel`` with ``kwargs``."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, **kwargs)


def torch_ddp_accepts(argument: str) -> bool:
    """Whether this torch's ``DistributedDataParallel`` takes ``argument`` (``batched_grad_copy`` came in 2.12)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return argument in inspect.signature(DistributedDataParallel.__init__).parameters


def torch_zero(params: Any, optimizer_class: type, **kwargs: Any) -> Any:
    """``torch.distributed.optim.ZeroRedundancyOptimizer`` over ``params`` (ZeRO stage 1, torch's)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class, **kwargs)


def torch_fsdp2(module: nn.Module, units: list[nn.Module], param_dtype: Any = None, reduce_dtype: Any = None,
                ) -> nn.Module:
    """``module`` under torch's FSDP2: ``fully_shard`` on each of ``units``, then on ``module`` (the root), with
    ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for unit in units:
        fully_shard(unit, mp_policy=policy)
    return fully_shard(module, mp_policy=policy)


def torch_sync_batchnorm(num_features: int) -> nn.Module:
    """torch's ``nn.SyncBatchNorm`` (CUDA only)."""
    return nn.SyncBatchNorm(num_features)

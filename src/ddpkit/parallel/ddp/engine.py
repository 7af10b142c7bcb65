"""Which engine a ``DistributedDataParallel`` gets for its ``zero_stage``: stage 0's reducer, stage 2's sharded
reducer, or stage 3's sharded parameters. The one place ``ddp/`` meets ``zero/``: the wrapper asks here for what
depends on the stage (its engine, the gradient norm of sharded gradients, whether a module is sharded already).
"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import nn

from ddpkit.parallel.common.reducer import Reducer
from ddpkit.parallel.zero.norm import clip_grad_norm
from ddpkit.parallel.zero.stage2 import ShardedReducer
from ddpkit.parallel.zero.stage3 import ShardedParameters, sharded_parameters
from ddpkit.parallel.zero.units import SHARD_MARK

__all__ = ["Engine", "clip_sharded_grad_norm", "make_engine", "refuse_sharded"]

Engine = Union[Reducer, ShardedReducer, ShardedParameters]
"""What a ``DistributedDataParallel`` drives (its ``reducer``)."""


def refuse_sharded(module: nn.Module) -> None:
    """Raise if ``module``'s parameters are ZeRO stage 3's shards already (it was wrapped before)."""
    if any(getattr(p, SHARD_MARK, False) for p in module.parameters()):
        raise ValueError("DistributedDataParallel: this module's parameters are sharded already (it was wrapped "
                         "with zero_stage=3 before): wrap it once, or wrap a fresh copy of the plain model")


def clip_sharded_grad_norm(ddp: Any, max_norm: float, norm_type: float) -> torch.Tensor:
    """Stage 2's clipping: the norm of the reducer's gradient shards over the ranks (a collective)."""
    grads = list(ddp.reducer.grad_shards) if ddp.reducer.fresh else []  # none since the last step
    return clip_grad_norm(grads, max_norm, norm_type, ddp.process_group)


def make_engine(ddp: Any) -> Engine:
    """The engine of ``ddp`` (a ``DistributedDataParallel`` whose settings are kept): the reducer of stage 0, stage
    2's sharded reducer, or stage 3's sharded parameters."""
    if ddp.zero_stage == 3:
        if ddp.parameters_to_ignore:
            raise ValueError(f"zero_stage=3 shards every parameter of the model, and "
                             f"{sorted(ddp.parameters_to_ignore)} "
                             "are set to be ignored: use zero_stage=0 or 2 with ignored parameters")
        return sharded_parameters(ddp.module, ddp.process_group, ddp.find_unused_parameters, ddp.stage3_settings)
    # torch's filter names a parameter "<module>.<name>", so the root's own are ".<name>".
    ignored = ddp.parameters_to_ignore
    trainable = [(n, p) for n, p in ddp.module.named_parameters()
                 if p.requires_grad and (n if "." in n else f".{n}") not in ignored]
    # torch's rule: a parameter of an nn.Embedding / nn.EmbeddingBag with sparse=True expects a sparse gradient.
    owner: dict[int, nn.Module] = {}
    for m in ddp.module.modules():
        for p in m.parameters(recurse=False):
            owner.setdefault(id(p), m)
    sparse = [isinstance(owner.get(id(p)), (nn.Embedding, nn.EmbeddingBag)) and bool(owner[id(p)].sparse)
              for _, p in trainable]
    if ddp.zero_stage == 2:
        return ShardedReducer(trainable, expect_sparse=sparse, process_group=ddp.process_group,
                              bucket_cap_mb=ddp.bucket_caps_given[0], bucket_caps_mb=ddp.bucket_caps_given[1],
                              find_unused_parameters=ddp.find_unused_parameters)
    return Reducer(
        trainable,
        expect_sparse=sparse,
        process_group=ddp.process_group,
        bucket_cap_mb=ddp.bucket_caps_given[0],
        bucket_caps_mb=ddp.bucket_caps_given[1],
        find_unused_parameters=ddp.find_unused_parameters,
        gradient_as_bucket_view=ddp.gradient_as_bucket_view,
        static_graph=ddp.static_graph,
        skip_unused=ddp.skip_all_reduce_unused_params,
    )

"""Which engine a ``DistributedDataParallel`` gets for its ``zero_stage``: stage 0's reducer, stage 2's sharded
reducer, or stage 3's sharded parameters. The one place ``ddp/`` meets ``zero/``: the wrapper asks here for what
depends on the stage (its engine, the gradient norm of sharded gradients, whether a module is sharded already).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ddpkit.parallel.common.observer import Observer, ObserverHandle
from ddpkit.parallel.common.reducer import Reducer
from ddpkit.parallel.ddp.args import EngineSettings
from ddpkit.parallel.zero.norm import clip_grad_norm
from ddpkit.parallel.zero.stage2 import ShardedReducer
from ddpkit.parallel.zero.stage3 import sharded_parameters
from ddpkit.parallel.zero.placement import SHARD_MARK

__all__ = ["Engine", "clip_sharded_grad_norm", "make_engine", "refuse_sharded"]


@runtime_checkable
class Engine(Protocol):
    """What a ``DistributedDataParallel`` drives (its ``reducer``): stage 0's :class:`Reducer`, stage 2's
    :class:`ShardedReducer`, stage 3's :class:`~ddpkit.parallel.zero.stage3.ShardedParameters`. What one of them
    cannot do it refuses, naming the stage that can (a comm hook, ``static_graph`` under stage 3)."""

    step: int
    """Synchronised backwards so far."""
    div_factor: int | None
    """What the gradients are averaged over (the wrapper sets it before each forward; ``join()`` changes it)."""

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] = ()) -> None:
        """The next backward synchronises (a forward outside ``no_sync()``)."""

    def disarm(self) -> None:
        """The next backward accumulates locally (``no_sync()``)."""

    def rebuild_if_due(self) -> bool:
        """Lay the buckets out again if due (a collective; every forward with grad enabled); whether it did."""

    def set_static_graph(self) -> None:
        """Turn on ``static_graph`` before the first backward (torch's ``_set_static_graph``)."""

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Let ``hook`` reduce each bucket."""

    def add_observer(self, observer: Observer) -> ObserverHandle:
        """Call ``observer`` at the engine's events."""


def refuse_sharded(module: nn.Module) -> None:
    """Raise if ``module``'s parameters are ZeRO stage 3's shards already (it was wrapped before)."""
    if any(getattr(p, SHARD_MARK, False) for p in module.parameters()):
        raise ValueError("DistributedDataParallel: this module's parameters are sharded already (it was wrapped "
                         "with zero_stage=3 before): wrap it once, or wrap a fresh copy of the plain model")


def clip_sharded_grad_norm(ddp: Any, max_norm: float, norm_type: float) -> torch.Tensor:
    """Stage 2's clipping: the norm of the reducer's gradient shards over the ranks (a collective)."""
    grads = list(ddp.reducer.grad_shards) if ddp.reducer.fresh else []  # none since the last step
    return clip_grad_norm(grads, max_norm, norm_type, ddp.process_group)


def make_engine(module: nn.Module, process_group: Any, settings: EngineSettings) -> Engine:
    """The engine of a ``DistributedDataParallel`` of ``module`` over ``process_group``: the reducer of stage 0,
    stage 2's sharded reducer, or stage 3's sharded parameters."""
    if settings.zero_stage == 3:
        if settings.parameters_to_ignore:
            raise ValueError(f"zero_stage=3 shards every parameter of the model, and "
                             f"{sorted(settings.parameters_to_ignore)} "
                             "are set to be ignored: use zero_stage=0 or 2 with ignored parameters")
        return sharded_parameters(module, process_group, settings.find_unused_parameters, settings.stage3)
    # torch's filter names a parameter "<module>.<name>", so the root's own are ".<name>".
    ignored = settings.parameters_to_ignore
    trainable = [(n, p) for n, p in module.named_parameters()
                 if p.requires_grad and (n if "." in n else f".{n}") not in ignored]
    # torch's rule: a parameter of an nn.Embedding / nn.EmbeddingBag with sparse=True expects a sparse gradient.
    owner: dict[int, nn.Module] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owner.setdefault(id(p), m)
    sparse = [isinstance(owner.get(id(p)), (nn.Embedding, nn.EmbeddingBag)) and bool(owner[id(p)].sparse)
              for _, p in trainable]
    if settings.zero_stage == 2:
        return ShardedReducer(trainable, expect_sparse=sparse, process_group=process_group,
                              bucket_cap_mb=settings.bucket_cap_mb, bucket_cap_mb_list=settings.bucket_cap_mb_list,
                              find_unused_parameters=settings.find_unused_parameters)
    return Reducer(
        trainable,
        expect_sparse=sparse,
        process_group=process_group,
        bucket_cap_mb=settings.bucket_cap_mb,
        bucket_cap_mb_list=settings.bucket_cap_mb_list,
        find_unused_parameters=settings.find_unused_parameters,
        gradient_as_bucket_view=settings.gradient_as_bucket_view,
        static_graph=settings.static_graph,
        skip_unused=settings.skip_all_reduce_unused_params,
    )

"""How ``ddpkit train`` keeps the replicas together: one object per ``--strategy``, so the loop has no branches.

The loop calls, for every optimizer step of ``grad_accum`` micro-batches:

``strategy.micro_batch(last)``
    the context of one micro-batch's forward and backward: DDP's
    ``no_sync()`` for all but the last, so gradients accumulate locally and
    the last backward reduces their sum;
``strategy.step(scaler, optimizer)``
    the optimizer step (through the grad scaler), with whatever the strategy
    does around it;
``strategy.consensus(optimizer)``
    before an evaluation or a checkpoint: make the replicas one model again
    (only local SGD lets them drift apart).

Strategies:

* ``ddp`` (also ``--engine torch``): the wrapper averages gradients in backward;
* ``optimizer``: :func:`ddpkit.DistributedOptimizer` (Horovod's recipe with a
  grad scaler: the averages first, then unscale and step);
* ``local-sgd``: :class:`ddpkit.LocalSGD`, parameters averaged every
  ``--local-sgd`` steps after ``--local-sgd-warmup`` synchronous ones;
* no wrapper (``--engine single`` and ``dp``): a plain step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ddpkit.parallel.local_sgd import LocalSGD
from ddpkit.parallel.optimizer import DistributedOptimizer
from ddpkit.parallel.zero import ZeroRedundancyOptimizer
from ddpkit.train.config import TrainConfig
from ddpkit.train.state import TrainState

__all__ = ["Strategy", "make_strategy"]


class Strategy:
    """A model whose wrapper averages gradients in backward (DDP), or no wrapper at all (see the module notes)."""

    def __init__(self, model: torch.nn.Module, accumulates: bool) -> None:
        self.model = model
        self.accumulates = accumulates
        """Whether micro-batches before the last run under ``no_sync()``."""

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if last or not self.accumulates else self.model.no_sync()

    def step(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        scaler.step(optimizer)
        scaler.update()

    def consensus(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to do: the replicas never drift apart."""

    def summary(self) -> dict[str, Any]:
        """What ``summary.json`` records of the strategy."""
        return {}


class HorovodStrategy(Strategy):
    """``--strategy optimizer``: the optimizer averages, so every micro-batch runs as it is."""

    def step(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        # Horovod's recipe with a grad scaler: the averages first, then unscale and step.
        optimizer.synchronize()  # type: ignore[attr-defined]
        with optimizer.skip_synchronize():  # type: ignore[attr-defined]
            scaler.step(optimizer)
        scaler.update()


class LocalSGDStrategy(Strategy):
    """``--strategy local-sgd``: local steps, the parameters averaged every period."""

    def __init__(self, model: torch.nn.Module, local: LocalSGD, config: TrainConfig) -> None:
        super().__init__(model, accumulates=True)
        self.local = local
        self.config = config

    def step(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        super().step(scaler, optimizer)
        self.local.step()

    def consensus(self, optimizer: torch.optim.Optimizer) -> None:
        # Parameters and optimizer state averaged, so an evaluation or a checkpoint sees one model, and a
        # resumed run continues exactly as the uninterrupted one.
        self.local.average(optimizer)

    def summary(self) -> dict[str, Any]:
        return {"local_sgd_period": self.config.local_sgd, "local_sgd_warmup": self.config.local_sgd_warmup,
                "parameter_averages": self.local.averages}


def make_strategy(state: TrainState, model: torch.nn.Module, config: TrainConfig) -> Strategy:
    """The strategy of ``config`` for ``model`` (as :func:`ddpkit.train.recipe.wrap` wrapped it).

    ``--strategy optimizer`` wraps ``state.optimizer`` in a DistributedOptimizer (the same param groups and
    state, so checkpoints are unchanged).
    """
    if config.engine in ("single", "dp"):
        return Strategy(model, accumulates=False)
    if config.zero:
        state.optimizer = _sharded(state.optimizer)
    if config.engine != "ddpkit" or config.strategy == "ddp":
        return Strategy(model, accumulates=True)
    if config.strategy == "optimizer":
        state.optimizer = DistributedOptimizer(
            state.optimizer, named_parameters=model.named_parameters(), backward_passes_per_step=config.grad_accum
        )
        return HorovodStrategy(model, accumulates=False)
    local = LocalSGD(model, period=config.local_sgd, warmup_steps=config.local_sgd_warmup)
    local.load_state_dict({"step_count": state.step})  # one local step per optimizer step, resumed ones too
    return LocalSGDStrategy(model, local, config)


def _sharded(plain: torch.optim.Optimizer) -> ZeroRedundancyOptimizer:
    """``--zero``: the same optimizer (class, groups, settings and state) sharded over the ranks.

    The state comes through the unsharded format, which is what checkpoints
    hold, so a run resumes at any world size and under any stage.
    """
    groups = [dict(g) for g in plain.param_groups]  # every setting is in the groups
    zero = ZeroRedundancyOptimizer(groups, type(plain), lr=plain.defaults["lr"])
    zero.load_state_dict(plain.state_dict())
    return zero

"""Lightning with ddpkit's DDP: ``Trainer(strategy=DDPKitStrategy())``, or ``Trainer(strategy="ddpkit")``.

:class:`DDPKitStrategy` is Lightning's own DDP strategy with the model wrapped
in :class:`ddpkit.DistributedDataParallel` instead of torch's: Lightning's
launching (its own processes, or ``ddpkit launch`` / torchrun / SLURM as the
cluster environment), process group, samplers, precision, checkpoints and
logging are unchanged. Its arguments are ``DDPStrategy``'s: ``DDP`` keywords
(``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``,
``bucket_cap_mb``, ``comm``, ...) go to ddpkit's wrapper, and ``ddp_comm_hook`` (with
``ddp_comm_state`` and ``ddp_comm_wrapper``) is registered on it on any device,
gloo included (Lightning registers it on CUDA only). Under ``comm="auto"`` the
decision's trials keep to a share of the fit's optimizer steps left (Lightning's
``trainer.estimated_stepping_batches``, where finite, less the global step), as
under ``ddpkit train``.

Importing this module registers the strategy names with Lightning:

``ddpkit``
    Lightning's launching as ``ddp`` (a script started again per process);
``ddpkit_spawn``, ``ddpkit_fork``
    as ``ddp_spawn`` and ``ddp_fork``;
``ddpkit_find_unused_parameters_true``, ``ddpkit_find_unused_parameters_false``
    ``ddpkit`` with that ``find_unused_parameters``.

Example::

    import lightning as L
    import ddpkit.integrations.lightning  # registers "ddpkit"

    trainer = L.Trainer(strategy="ddpkit", accelerator="cpu", devices=2, max_epochs=3)
    trainer.fit(model, datamodule)

Manual optimisation works as under torch's DDP: whether a ``manual_backward``
synchronises is decided when it starts (``trainer.strategy.block_backward_sync()``
around it skips the all-reduce). Needs the ``lightning`` package
(``pip install 'ddpkit[lightning]'``); ``pytorch_lightning`` alone is not
supported.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

try:
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError(
        "ddpkit.integrations.lightning needs Lightning: pip install 'ddpkit[lightning]' (or lightning)"
    ) from e

from ddpkit.comm.auto import AutoComm
from ddpkit.parallel.common.unused import UnusedParametersError
from ddpkit.parallel.ddp.wrapper import DistributedDataParallel

__all__ = ["DDPKitStrategy"]

_NAMES = (
    ("ddpkit", {"start_method": "popen"}, "ddpkit's DDP, Lightning's launching as 'ddp'"),
    ("ddpkit_spawn", {"start_method": "spawn"}, "ddpkit's DDP, processes spawned as 'ddp_spawn'"),
    ("ddpkit_fork", {"start_method": "fork"}, "ddpkit's DDP, processes forked as 'ddp_fork'"),
    ("ddpkit_find_unused_parameters_true", {"start_method": "popen", "find_unused_parameters": True},
     "ddpkit's DDP with find_unused_parameters=True"),
    ("ddpkit_find_unused_parameters_false", {"start_method": "popen", "find_unused_parameters": False},
     "ddpkit's DDP with find_unused_parameters=False"),
)


class DDPKitStrategy(DDPStrategy):
    """Lightning's DDP strategy on :class:`ddpkit.DistributedDataParallel` (see the module notes)."""

    strategy_name = "ddpkit"

    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        """Wrap the LightningModule in ddpkit's DDP, on this process's device."""
        device_ids = self.determine_ddp_device_ids()
        return DistributedDataParallel(module=model, device_ids=device_ids, **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        """Register ``ddp_comm_hook`` (wrapped in ``ddp_comm_wrapper``) on every device: ddpkit's hooks run on gloo."""
        hook = self._ddp_comm_hook
        if hook is None:
            return
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(self._ddp_comm_state, hook)

    def on_train_start(self) -> None:
        """``comm="auto"`` (an ``AutoComm`` registered without a run length): the fit's optimizer steps left (a
        resumed fit's: from its global step) bound its trials (:class:`~ddpkit.comm.auto.AutoComm`'s
        ``run_steps``)."""
        super().on_train_start()
        state = self.model.comm_state if isinstance(self.model, DistributedDataParallel) else None
        if isinstance(state, AutoComm) and state.run_steps is None and self.lightning_module is not None:
            trainer = self.lightning_module.trainer
            steps = trainer.estimated_stepping_batches  # (inf: unbounded; -1: an iterable of unknown length)
            if math.isfinite(steps) and steps - trainer.global_step >= 1:
                state.run_steps = int(steps - trainer.global_step)

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Manual optimisation: arm the reducer, or not, as this backward will (or will not) synchronise."""
        model, module = self.model, self.lightning_module
        if not isinstance(model, DistributedDataParallel) or module is None or module.automatic_optimization:
            return
        sync = torch.is_grad_enabled() and model.require_backward_grad_sync
        if sync:
            model.reducer.prepare_for_backward()
        else:
            model.reducer.disarm()
        model.require_forward_param_sync = sync

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Nothing to flush: a static graph's first backward reduces at its own end under ddpkit."""

    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, UnusedParametersError) and exception.args:
            exception.args = (
                f"{exception.args[0]}. In Lightning: Trainer(strategy='ddpkit_find_unused_parameters_true') or "
                "Trainer(strategy=DDPKitStrategy(find_unused_parameters=True))",
                *exception.args[1:],
            )

    def teardown(self) -> None:
        """Unwrap the model, then Lightning's teardown (the layer sync reverted, the environment torn down)."""
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``ddpkit`` and its variants (see the module notes) with ``strategy_registry``."""
        for name, params, description in _NAMES:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **params)


DDPKitStrategy.register_strategies(StrategyRegistry)

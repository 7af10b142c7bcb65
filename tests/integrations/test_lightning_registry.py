"""The Lightning strategy in one process, for the fast tier: the names it registers, and a fit at world 1 whose
model is ddpkit's DDP (the two-process parity with Lightning's own DDP is test_lightning_strategy.py's)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("lightning") is None:  # (looked for, not imported: importing Lightning's 2,000 modules
    # cost each pytest worker 3 s of its collection)
    pytest.skip("Lightning is an optional extra: pip install 'ddpkit[lightning]'", allow_module_level=True)


def test_the_strategy_names_are_registered_and_a_fit_wraps_the_model_in_ddpkits_ddp(tmp_path) -> None:
    import lightning as L
    from lightning.pytorch.strategies import StrategyRegistry

    import ddpkit
    from ddpkit.integrations.lightning import DDPKitStrategy

    names = {"ddpkit", "ddpkit_spawn", "ddpkit_fork", "ddpkit_find_unused_parameters_true",
             "ddpkit_find_unused_parameters_false"}
    assert names <= set(StrategyRegistry.available_strategies())

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, index):  # type: ignore[no-untyped-def]
            wrapped.append(type(self.trainer.strategy.model))
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    wrapped: list[type] = []
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    strategy = DDPKitStrategy(find_unused_parameters=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    assert wrapped == [ddpkit.DistributedDataParallel] * 3  # during the fit (Lightning unwraps it at the end)
    assert trainer.global_step == 3

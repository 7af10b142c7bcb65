"""Eight steps of Lightning fits on two CPU processes; rank 0 saves each one's final weights (tests/integrations).

usage: lightning_parity.py STRATEGY[,STRATEGY...] MODEL[,MODEL...] OUTDIR
  Fits every model with every strategy, in this order, and saves OUTDIR/STRATEGY-MODEL.pt.
  STRATEGY  ddp (torch's DDP) | ddpkit (the registered name) | ddpkit-object (DDPKitStrategy()) |
            ddpkit-auto (DDPKitStrategy(comm="auto"): eight steps are its exact start, DDP's bits) |
            ddp-rebound ("ddp" with torch's DistributedDataParallel rebound to ddpkit's before Lightning
            is imported, as users adopt a drop-in)
  MODEL     boring (a linear layer) | bn (convolution, BatchNorm, two heads) | manual (bn, manual
            optimisation, two micro-batches per step, the first under block_backward_sync)
"""

import sys

import torch

import ddpkit

strategies, models, out = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3]
if "ddp-rebound" in strategies:
    torch.nn.parallel.DistributedDataParallel = ddpkit.DDP
    torch.nn.parallel.distributed.DistributedDataParallel = ddpkit.DDP

import lightning as L  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ddpkit.integrations.lightning as ddpkit_lightning  # noqa: E402


class Boring(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class WithBatchNorm(Boring):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(1, 4, 3, padding=1), nn.BatchNorm1d(4), nn.ReLU(), nn.Flatten())
        self.layer = nn.Linear(4 * 32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.body(x.unsqueeze(1)))


class Manual(WithBatchNorm):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        half = len(x) // 2
        with self.trainer.strategy.block_backward_sync():
            self.manual_backward(nn.functional.cross_entropy(self(x[:half]), y[:half]))
        self.manual_backward(nn.functional.cross_entropy(self(x[half:]), y[half:]))
        opt.step()


def fit(strategy_name: str, model_name: str) -> None:
    L.seed_everything(0, workers=True)
    model = {"boring": Boring, "bn": WithBatchNorm, "manual": Manual}[model_name]()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(128, 32, generator=g), torch.randint(0, 2, (128,), generator=g))
    strategy = {"ddpkit-object": ddpkit_lightning.DDPKitStrategy(), "ddp-rebound": "ddp",
                "ddpkit-auto": ddpkit_lightning.DDPKitStrategy(comm="auto")}.get(strategy_name, strategy_name)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=8, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    auto_steps: list[int | None] = [None]
    if strategy_name == "ddpkit-auto":
        class Peek(L.Callback):  # the run length the strategy gave the comm hook's state when the fit started
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
                auto_steps[0] = trainer.strategy.model.comm_state.run_steps

        trainer.callbacks.append(Peek())
    trainer.fit(model, DataLoader(data, batch_size=8))
    line = (f"LIGHTNING rank {trainer.global_rank} {strategy_name} {model_name}: {type(trainer.strategy).__name__}, "
            f"model after teardown {type(trainer.strategy.model).__name__}, "
            f"env {type(trainer.strategy.cluster_environment).__name__}\n")
    if strategy_name == "ddpkit-auto":  # what bounds auto's trials: the fit's optimizer steps
        line += f"LIGHTNING rank {trainer.global_rank} {strategy_name} {model_name}: run_steps {auto_steps[0]}\n"
    sys.stdout.write(line)  # one write: the ranks share the pipe
    sys.stdout.flush()
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{out}/{strategy_name}-{model_name}.pt")


for strategy_name in strategies:
    for model_name in models:
        fit(strategy_name, model_name)

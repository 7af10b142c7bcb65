"""Lightning with ddpkit's DistributedDataParallel: ``Trainer(strategy="ddpkit")``; the rest is Lightning's.

    .venv/bin/pip install -e '.[lightning]'     # once: Lightning is an optional extra
    .venv/bin/python examples/lightning_ddpkit.py --devices 2

Lightning starts the processes (the script again per process), builds the process group and the samplers; the
strategy wraps the model in ``ddpkit.DistributedDataParallel`` instead of torch's. Under ``ddpkit launch`` (or
torchrun, SLURM) the launcher's processes are used instead: ``ddpkit launch --standalone --nproc-per-node 2
examples/lightning_ddpkit.py --devices 2``.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning as L
except ImportError:
    raise SystemExit("this example needs Lightning: .venv/bin/pip install -e '.[lightning]'") from None

import ddpkit.integrations.lightning  # noqa: F401 - registers the strategy names ("ddpkit", "ddpkit_spawn", ...)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=2, help="processes (CPU) or GPUs")
parser.add_argument("--accelerator", default="cpu", help="cpu, or gpu for one process per GPU (--devices of them)")
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))

    def on_train_start(self) -> None:
        wrapper = type(self.trainer.strategy.model)  # during the fit: the wrapper (Lightning unwraps it at teardown)
        self.wrapped_in = f"{wrapper.__module__}.{wrapper.__name__}"

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201 - Lightning's hook
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's hook
        return torch.optim.SGD(self.parameters(), lr=0.1)


g = torch.Generator().manual_seed(0)
x = torch.randn(2048, 32, generator=g)
y = (x[:, :16].sum(1) > x[:, 16:].sum(1)).long()
L.seed_everything(0, verbose=False)
trainer = L.Trainer(strategy="ddpkit", accelerator=args.accelerator, devices=args.devices, max_epochs=args.epochs,
                    enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False)
model = Classifier()
trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True))
if trainer.is_global_zero:
    print(f"trained {args.epochs} epochs on {trainer.world_size} processes, the model wrapped in {model.wrapped_in}; "
          f"last loss {trainer.callback_metrics['train_loss']:.4f}", flush=True)

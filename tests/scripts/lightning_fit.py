"""A two-process Lightning fit (tests/launcher/test_lightning.py): prints the environment Lightning chose."""
import torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset
class M(L.LightningModule):
    def __init__(self): super().__init__(); self.l = torch.nn.Linear(4, 1)
    def training_step(self, b, i): return torch.nn.functional.mse_loss(self.l(b[0]), b[1])
    def configure_optimizers(self): return torch.optim.SGD(self.parameters(), lr=0.1)
ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
t = L.Trainer(devices=2, strategy="ddp", accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
t.fit(M(), DataLoader(ds, batch_size=8))
print("LIGHTNING rank", t.global_rank, "world", t.world_size, "env", type(t.strategy.cluster_environment).__name__, flush=True)

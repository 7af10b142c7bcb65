"""``ddpkit train``'s default job written with torch alone, to run under ``torchrun`` (the start-up reference).

The same model (the tutorial's ConvNet), data (scikit-learn's digits scaled to
28x28, the fixed 80/20 split, normalised by the training mean and std), order
(torch's DistributedSampler, seed 0), batch (32 per process), optimizer (SGD,
lr 0.02 x world size, momentum 0.9), 8 epochs, an evaluation after each, and
the final weights saved by rank 0: what ``ddpkit train`` does by default, on
torch's DDP, sampler and launcher.

    torchrun --standalone --nproc-per-node 2 scripts/torch_train.py [OUTPUT_DIR]

``scripts/time_startup.py`` times it against ``ddpkit train``.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from ddpkit.models import ConvNet  # the model itself, to compare like with like

EPOCHS, BATCH, LR, MOMENTUM = 8, 32, 0.02, 0.9


def data() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    digits = load_digits()
    x = torch.from_numpy(digits.data.reshape(-1, 1, 8, 8).astype("float32") / 16.0)
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    y = torch.from_numpy(digits.target).long()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = order[: round(0.8 * len(y))], order[round(0.8 * len(y)) :]
    x = (x - x[train].mean()) / x[train].std()
    return (x[train], y[train]), (x[test], y[test])


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    (x, y), (tx, ty) = data()
    torch.manual_seed(0)
    model = DistributedDataParallel(ConvNet())
    opt = torch.optim.SGD(model.parameters(), lr=LR * world, momentum=MOMENTUM)
    sampler = DistributedSampler(range(len(y)), seed=0)
    start = time.perf_counter()
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        idx = torch.tensor(list(sampler))
        for b in range(0, len(idx), BATCH):
            batch = idx[b : b + BATCH]
            opt.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            mine = torch.arange(rank, len(ty), world)
            out = model.module(tx[mine])
            totals = torch.tensor([F.cross_entropy(out, ty[mine], reduction="sum").item(),
                                   (out.argmax(1) == ty[mine]).sum().item(), len(mine)], dtype=torch.float64)
        model.train()
        dist.all_reduce(totals)
        if rank == 0:
            print(f"epoch {epoch + 1}/{EPOCHS}: test loss {totals[0] / totals[2]:.4f}, "
                  f"test accuracy {totals[1] / totals[2]:.2%}", flush=True)
    if rank == 0:
        out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
        os.makedirs(out_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(out_dir, "model.pt"))
        print(f"{EPOCHS} epochs in {time.perf_counter() - start:.1f} s on {world} process(es)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Your own training loop that survives a crash: ddpkit.TrainState under ddpkit launch --max-restarts.

    .venv/bin/ddpkit launch --standalone --nproc-per-node 2 --max-restarts 3 examples/resumable_loop.py --out run

Kill any worker with ``kill -9`` while it runs: the launcher restarts the
group, ``state.restore`` brings back the newest valid checkpoint (model,
optimizer, sampler position mid-epoch, every rank's RNG), and the final
weights are bit-identical to a run that was never interrupted.
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

import ddpkit

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True, help="checkpoints go to OUT/ckpt, weights to OUT")
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--save-every", type=int, default=5)
args = parser.parse_args()

ctx = ddpkit.init()
torch.manual_seed(0)  # the same start on every rank (DDP also broadcasts rank 0's)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(512, 20, generator=g), torch.randint(0, 4, (512,), generator=g))
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sampler = ddpkit.DistributedSampler(data, seed=0)
# num_workers=0: the loader takes indices from the sampler batch by batch, so
# the sampler's saved position is exactly the batches trained so far. Its own
# generator: each new DataLoader iterator draws a seed, which would otherwise
# come from the global RNG and shift the dropout stream of a resumed run.
loader = DataLoader(data, batch_size=16, sampler=sampler, generator=torch.Generator())
ddp = ddpkit.DDP(model)

# Dropout draws from each rank's RNG: TrainState saves and restores those too.
state = ddpkit.TrainState(model=ddp, optimizer=opt, sampler=sampler)
step = state.restore(args.out / "ckpt")
if step:
    ddpkit.print0(f"resumed at step {step} (epoch {sampler.epoch})")
while step < args.steps:
    if sampler.state_dict()["consumed"] == sampler.num_samples:
        sampler.set_epoch(sampler.epoch + 1)  # else: the start, or resumed mid-epoch
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        step += 1
        if step % args.save_every == 0 or step == args.steps:
            state.save(args.out / "ckpt", step)
        if step == args.steps:
            break
if ctx.rank == 0:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(args.out / "final.safetensors"))
ddpkit.print0(f"done: {step} steps")
ddpkit.shutdown()

"""Peak memory of a rank training the 25 M MLP under ddpkit's DDP or FaultTolerance(deterministic=True), in
gradients' worth (the peak resident set of rank 0 over the size of the model's gradient).

Run each engine in a launch of its own (the peak is the process's):

    OMP_NUM_THREADS=1 ddpkit launch --standalone --nproc-per-node 2 scripts/ft_memory.py --engine ddp
    OMP_NUM_THREADS=1 ddpkit launch --standalone --nproc-per-node 2 scripts/ft_memory.py --shards-per-rank 4
"""

import argparse
import resource

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--engine", choices=["ddp", "deterministic"], default="deterministic")
parser.add_argument("--shards-per-rank", type=int, default=1, help="virtual shards per rank (V = this x the world)")
parser.add_argument("--hidden", type=int, default=4640, help="MLP width (4640: about 25 M parameters)")
parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()

ctx = ddpkit.init()
world = ctx.world_size
torch.manual_seed(0)
model = nn.Sequential(nn.Flatten(), nn.Linear(784, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                      nn.ReLU(), nn.Linear(args.hidden, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
total = args.batch * world * args.steps
data = TensorDataset(torch.randn(total, 784), torch.randint(0, 10, (total,)))
if args.engine == "ddp":
    ddp = ddpkit.DDP(model)
    for i in range(args.steps):
        lo = (i * world + ctx.rank) * args.batch
        x, y = data[lo : lo + args.batch]
        F.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    what = "ddpkit DDP"
else:
    v = world * args.shards_per_rank
    ft = ddpkit.FaultTolerance(model, optimizer, data, batch_size=args.batch * world, virtual_shards=v,
                               deterministic=True, shuffle=False)
    for step in ft.steps(max_steps=args.steps):
        for x, y in step:
            F.cross_entropy(model(x), y).backward()
        assert step.sync()
        optimizer.step()
        optimizer.zero_grad()
    what = f"FaultTolerance(deterministic=True), V = {v}"
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
gradient = sum(p.numel() * p.element_size() for p in model.parameters())
if ctx.rank == 0:
    print(f"{what} at world {world}: peak resident {peak / 1e6:.0f} MB = {peak / gradient:.1f} gradients of "
          f"{gradient / 1e6:.0f} MB", flush=True)
ddpkit.shutdown()

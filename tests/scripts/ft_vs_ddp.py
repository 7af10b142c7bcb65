"""FaultTolerance's default (summed) mode at V = 4 x the world, nobody dying, against ddpkit's DDP trained on the
batches a DistributedSampler deals (rank r: positions r, r + n, ... of each step's global batch). For a model
without batch normalisation prints how many micro-batches each step gave and whether every parameter is bit for
bit DDP's; for one with it, how many micro-batches (one per shard: a shard's batch statistics stay its own)."""

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

ctx = ddpkit.init()
world, rank, steps, batch = ctx.world_size, ctx.rank, 6, 16 * ctx.world_size
torch.manual_seed(0)
x, y = torch.randn(steps * batch, 20), torch.randint(0, 3, (steps * batch,))


def train(net: nn.Module) -> tuple[list[int], bool]:
    ddp = ddpkit.DistributedDataParallel(copy.deepcopy(net))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for i in range(steps):
        xb, yb = x[i * batch : (i + 1) * batch][rank::world], y[i * batch : (i + 1) * batch][rank::world]
        F.cross_entropy(ddp(xb), yb).backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
    model = copy.deepcopy(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ft = ddpkit.FaultTolerance(model, opt, TensorDataset(x, y), batch_size=batch, virtual_shards=4 * world,
                               shuffle=False)
    micro = set()
    for step in ft.steps(max_steps=steps):
        n = 0
        for xb, yb in step:
            F.cross_entropy(model(xb), yb).backward()
            n += 1
        micro.add(n)
        assert step.sync()
        opt.step()
        opt.zero_grad()
    ours, theirs = dict(model.named_parameters()), dict(ddp.module.named_parameters())
    return sorted(micro), all(ours[k].equal(theirs[k]) for k in theirs)


torch.manual_seed(0)
micro, equal = train(nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3)))
print("MICRO", micro, "EQUAL", equal, flush=True)
torch.manual_seed(0)
micro, _ = train(nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 3)))
print("BATCH NORM MICRO", micro, flush=True)
ddpkit.shutdown()

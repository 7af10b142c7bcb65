"""Train a tiny model with DDP on fixed per-rank data; rank 0 prints the final parameters' checksum."""

import hashlib

import torch
from torch import nn

import ddpkit

ctx = ddpkit.init()
torch.manual_seed(0)
model = ddpkit.DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(100 + ctx.rank)
for _ in range(10):
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
if ctx.rank == 0:
    print("CHECKSUM", ctx.world_size, digest, flush=True)
ddpkit.shutdown()

"""The deterministic mode on a gradient of three numbers: fewer than the blocks of an ordered reduce-scatter at
world 4 (its last blocks are empty). Prints each parameter's bits, to compare across world sizes."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

ctx = ddpkit.init()
torch.manual_seed(0)
model = nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 2), torch.randn(64, 1)
ft = ddpkit.FaultTolerance(model, opt, TensorDataset(x, y), batch_size=16, virtual_shards=8, deterministic=True,
                           shuffle=False)
for step in ft.steps(max_steps=3):
    for xb, yb in step:
        torch.nn.functional.mse_loss(model(xb), yb).backward()
    assert step.sync()
    opt.step()
    opt.zero_grad()
print("BITS", ctx.rank, [float(v).hex() for p in model.parameters() for v in p.detach().reshape(-1)], flush=True)

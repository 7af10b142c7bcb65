"""A torchrun-style script with parameter servers: trains a few async steps and never calls close()."""

import json
import os

import torch
from torch import nn

import ddpkit

ddpkit.init()
model = nn.Linear(4, 1)
opt = ddpkit.ParameterServerOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, mode="async", staleness=1)
for _ in range(5):
    x = torch.randn(8, 4)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
    opt.step()
print("REPORT " + json.dumps({"rank": ddpkit.rank(), "world": ddpkit.world_size(), "steps": opt.stats.steps,
                              "servers": os.environ["DDPKIT_NUM_SERVERS"]}), flush=True)

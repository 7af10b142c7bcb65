"""A script that calls ``ft.steps()`` twice (a phase of one epoch, then the rest), as users write warm-up phases;
``KILL=member:step`` SIGKILLs that member in that step's first micro-batch, ``SLEEP`` paces the steps (so that a
replacement joins during the second loop). Prints each member's final weights' digest."""

import hashlib
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

ddpkit.init()
torch.manual_seed(0)
x = torch.randn(600, 20)
y = (x[:, :10].sum(1) > 0).long()
net = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 2))
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
member = int(os.environ.get("DDPKIT_FT_MEMBER", "0"))
kill = tuple(map(int, os.environ["KILL"].split(":"))) if os.environ.get("KILL") else None
ft = ddpkit.FaultTolerance(net, opt, TensorDataset(x, y), batch_size=48, virtual_shards=6, deterministic=True)


def train(steps) -> None:
    for step in steps:
        for i, (xb, yb) in enumerate(step):
            F.cross_entropy(net(xb), yb).backward()
            if i == 0 and kill == (member, step.index):
                os.kill(os.getpid(), signal.SIGKILL)
        if step.sync():
            opt.step()
        opt.zero_grad()
        time.sleep(float(os.environ.get("SLEEP", "0")))


train(ft.steps(epochs=1))
train(ft.steps(epochs=2))
digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in net.state_dict().values())).hexdigest()
print(f"DONE member {member} committed {ft.committed} loops {ft.loops_done} weights {digest[:16]}", flush=True)

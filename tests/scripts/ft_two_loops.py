"""A script that calls ``ft.steps()`` twice (a phase of one epoch, then the rest), as users write warm-up phases;
``KILL=member:step`` SIGKILLs that member in that step's first micro-batch; ``GROW=N``: in the second loop, after a
step applied by fewer than N workers, the members wait (at most 120 s, once) for the next membership, a
replacement's admission, so that it joins during the second loop however long its interpreter takes to start.
Prints each member's final weights' digest."""

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


grow = int(os.environ.get("GROW", "0"))
waited = False


def wait_for_a_join() -> None:
    global waited
    waited = True
    deadline = time.monotonic() + 120
    while ft.membership.latest().generation == ft.view.generation and time.monotonic() < deadline:
        time.sleep(0.01)


def train(steps, wait: bool) -> None:
    for step in steps:
        for i, (xb, yb) in enumerate(step):
            F.cross_entropy(net(xb), yb).backward()
            if i == 0 and kill == (member, step.index):
                os.kill(os.getpid(), signal.SIGKILL)
        if step.sync():
            opt.step()
        opt.zero_grad()
        if wait and step.synced and ft.world_size < grow and not waited and ft.committed < 2 * ft.steps_per_epoch:
            wait_for_a_join()


train(ft.steps(epochs=1), wait=False)
train(ft.steps(epochs=2), wait=True)
digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in net.state_dict().values())).hexdigest()
print(f"DONE member {member} committed {ft.committed} loops {ft.loops_done} weights {digest[:16]}", flush=True)

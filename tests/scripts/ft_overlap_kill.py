"""A DDP script under ``ddpkit launch --on-failure continue`` in the summed mode, its buckets small: each step's
buckets go out during its backward.

Environment: ``KILL=MEMBER:STEP`` (that member SIGKILLs itself inside that step's backward, after the later
layers' buckets went out), ``HOOK=NAME`` (``ddpkit.hooks.NAME`` registered), ``OUT`` (each member writes
``OUT.MEMBER.json``: its world size, steps applied, a digest of its weights, whether every applied step reduced
all 48 samples, the steps done again).
"""
import json
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
x = torch.randn(480, 20)
y = (x[:, :10].sum(1) > 0).long()
member = int(os.environ.get("DDPKIT_FT_MEMBER", "0"))
KILL = tuple(map(int, os.environ.get("KILL", "-1:-1").split(":")))
state = {"step": -1}



class Tripwire(torch.autograd.Function):
    """Between the first layer and the rest: its backward runs once the later layers' gradients are in."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        if (member, state["step"]) == KILL:
            time.sleep(0.05)  # the later layers' buckets are out by now
            os.kill(os.getpid(), signal.SIGKILL)
        return g


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(20, 256), nn.Linear(256, 256), nn.Linear(256, 2)

    def forward(self, t):
        return self.c(torch.relu(self.b(torch.relu(Tripwire.apply(self.a(t))))))


net = Net()
hook = os.environ.get("HOOK")
model = ddpkit.DistributedDataParallel(net, bucket_cap_mb=0.1)  # a bucket per layer
if hook:
    model.register_comm_hook(None, getattr(ddpkit.hooks, hook))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
ft = ddpkit.FaultTolerance(model, opt, TensorDataset(x, y), batch_size=48, virtual_shards=6)
trained, discarded = {}, []
for step in ft.steps(epochs=2):
    state["step"] = step.index
    for xb, yb in step:
        F.cross_entropy(model(xb), yb).backward()
    if step.sync():
        opt.step()
        trained[step.index] = sum(step.trained)
    else:
        discarded.append(step.index)
    opt.zero_grad()
if os.environ.get("OUT"):
    sd = {k: v.clone() for k, v in net.state_dict().items()}
    digest = sum(float(v.double().sum()) for v in sd.values())
    with open(f"{os.environ['OUT']}.{member}.json", "w") as f:
        json.dump({"member": member, "world": ft.world_size, "committed": ft.committed, "digest": digest,
                   "trained_all_48": all(v == 48 for v in trained.values()), "discarded": discarded,
                   "changes": len(ft.changes)}, f)

"""A library user's script under ``ddpkit launch --on-failure continue``: ddpkit.FaultTolerance on a small model.

Environment: ``KILL=MEMBER:STEP[,MEMBER:STEP...]`` makes that member SIGKILL itself at the start of that step
(in the middle of its micro-batches); ``DET=1`` the deterministic mode; ``EPOCHS`` (default 2); ``SLEEP`` seconds
after each step (time for a replacement to start); ``PIDS`` a file each worker adds its PID to; ``OUT`` where the
first member saves the final state dict and a JSON account (its membership changes, steps, the samples each step
reduced).
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
x = torch.randn(600, 20)
y = (x[:, :10].sum(1) > 0).long()
model = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
ft = ddpkit.FaultTolerance(model, opt, TensorDataset(x, y), batch_size=48, virtual_shards=6,
                           deterministic=os.environ.get("DET") == "1", state={"scheduler": sched})
member = int(os.environ.get("DDPKIT_FT_MEMBER", "0"))
if os.environ.get("PIDS"):
    with open(os.environ["PIDS"], "a") as f:
        f.write(f"{os.getpid()}\n")
kills = {tuple(map(int, k.split(":"))) for k in os.environ.get("KILL", "").split(",") if k}
trained = {}
for step in ft.steps(epochs=int(os.environ.get("EPOCHS", "2"))):
    for i, (xb, yb) in enumerate(step):
        if i == 1 and (member, step.index) in kills:
            os.kill(os.getpid(), signal.SIGKILL)
        F.cross_entropy(model(xb), yb).backward()
    if step.sync():
        opt.step()
        sched.step()
        trained[step.index] = step.trained
    opt.zero_grad()
    time.sleep(float(os.environ.get("SLEEP", "0")))
if ft.rank == 0 and os.environ.get("OUT"):
    torch.save(model.state_dict(), os.environ["OUT"] + ".pt")
    with open(os.environ["OUT"] + ".json", "w") as f:
        json.dump({"world_size": ft.world_size, "committed": ft.committed, "lr": opt.param_groups[0]["lr"],
                   "changes": [c.__dict__ for c in ft.changes], "trained": trained}, f)

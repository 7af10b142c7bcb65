"""A multi-node job for the launcher's failure tests: ``nodes.py MODE``.

``crash``: rank ``CRASH_RANK`` raises at step 3 of round 0 (a restart round succeeds); with ``GO_FILE`` set, at
the first step after that file exists (the job then runs up to 300 steps).
``long``: trains slowly for a minute in round 0 (to be killed or cut off), briefly after a restart.
Every rank prints ``PID <rank> <pid>`` first, ``TRAINING <rank> round <n>`` once its first step's all-reduce
is done (every rank is in), and ``DONE <rank> round <n>`` at the end.
"""

import os
import sys
import time

import torch
from torch import nn

import ddpkit

mode = sys.argv[1]
ctx = ddpkit.init()
print("PID", ctx.rank, os.getpid(), flush=True)
round_ = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
model = ddpkit.DDP(nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
go = os.environ.get("GO_FILE")
for step in range(8 if (mode == "crash" and not go) or round_ > 0 else 300):
    time.sleep(0.2)
    due = os.path.exists(go) if go else step == 3
    if mode == "crash" and round_ == 0 and due and ctx.rank == int(os.environ["CRASH_RANK"]):
        raise RuntimeError(f"deliberate failure on rank {ctx.rank}")
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    if step == 0:
        print("TRAINING", ctx.rank, "round", round_, flush=True)
ddpkit.barrier()
print("DONE", ctx.rank, "round", round_, flush=True)

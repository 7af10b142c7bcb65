"""A job that goes wrong on purpose, for the stall inspector's tests.

``stall.py stop``: rank 1 (``STALL_RANK``) stops itself (SIGSTOP) in the middle of training.
``stall.py extra``: rank 1 issues one barrier the others do not.
``stall.py slow``: rank 1 computes (alive) for a while before a barrier.
``stall.py ok``: trains to the end.
``stall.py zero3``: a ZeRO-3 model; rank 1 exits cleanly while rank 0 alone calls ``state_dict()`` (the DDP habit
``if rank == 0: torch.save(model.state_dict())``), a collective every rank must call.
"""

import os
import signal
import sys
import time

import torch
from torch import nn

import ddpkit

mode = sys.argv[1]
ctx = ddpkit.init()
torch.manual_seed(0)
if mode == "zero3":
    model = ddpkit.DDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)), zero_stage=3)
    model(torch.randn(4, 8)).sum().backward()
    if ctx.rank == 0:
        model.state_dict()
    sys.exit(0)
model = ddpkit.DDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(8):
    time.sleep(0.05)
    if step == 4 and ctx.rank == int(os.environ.get("STALL_RANK", "1")):
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif mode == "extra":
            ddpkit.barrier()
        elif mode == "slow":
            time.sleep(float(os.environ.get("SLOW_S", "6")))
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
ddpkit.barrier()
print("finished", ctx.rank, flush=True)

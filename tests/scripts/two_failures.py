"""Both ranks fail: rank 1 first (exit 1), rank 0 a moment later (exit 3), at a shared deadline."""

import os
import time

import torch
import torch.distributed as dist

import ddpkit

ctx = ddpkit.init()
deadline = torch.tensor([time.time() + 1.0], dtype=torch.float64)
dist.broadcast(deadline, src=0)  # one clock for both ranks
# 30 ms: less than one poll period of a launcher that polls, so only an
# exit-time order tells the two apart.
delay = 0.0 if ctx.rank == 1 else 0.03
time.sleep(max(0.0, deadline.item() + delay - time.time()))
print(f"rank {ctx.rank} fails now", flush=True)
os._exit(1 if ctx.rank == 1 else 3)

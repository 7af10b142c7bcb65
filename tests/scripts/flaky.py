"""Fails on rank 0 in the first attempt only; succeeds after a restart."""

import os

import torch
import torch.distributed as dist

import ddpkit

ctx = ddpkit.init()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if restart == 0 and ctx.rank == 0:
    raise RuntimeError("first attempt fails on purpose")
t = torch.ones(1)
dist.all_reduce(t)
print(f"FLAKY ok rank={ctx.rank} restart={restart} max={os.environ['TORCHELASTIC_MAX_RESTARTS']} sum={t.item():g}", flush=True)

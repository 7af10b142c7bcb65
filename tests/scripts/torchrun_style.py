"""A script written for torchrun, with no ddpkit in it: plain torch.distributed from env://."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
assert rank == dist.get_rank(), (rank, dist.get_rank())
local_rank = int(os.environ["LOCAL_RANK"])
t = torch.tensor([float(rank)])
dist.all_reduce(t)
print(f"TORCHRUN-STYLE rank={rank} local_rank={local_rank} world={dist.get_world_size()} sum={t.item():g}", flush=True)
dist.destroy_process_group()

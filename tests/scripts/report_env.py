"""Worker for launcher/runtime tests: init, all-reduce, print what this rank sees as JSON."""

import json
import os
import sys

import torch
import torch.distributed as dist

import ddpkit

ctx = ddpkit.init()
value = torch.tensor([float(ctx.rank)])
dist.all_reduce(value)
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS",
        "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
        "DDPKIT_RDZV_ROUND", "ROLE_NAME"]
print("REPORT " + json.dumps({
    "rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank,
    "local_world_size": ctx.local_world_size, "node_rank": ctx.node_rank, "scheme": ctx.scheme,
    "backend": ctx.backend, "device": str(ctx.device), "sum": value.item(), "argv": sys.argv[1:],
    "env": {k: os.environ.get(k) for k in keys},
}), flush=True)
ddpkit.shutdown()

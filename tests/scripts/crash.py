"""Rank 1 raises after start-up; the others block (in a collective, then asleep).

Each worker also starts a grandchild (`sleep`) and records its pid in the
directory given as argv[1], so the test can check that nothing is left behind.
"""

import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ddpkit

ctx = ddpkit.init()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
Path(sys.argv[1], f"rank{ctx.rank}.pid").write_text(f"{child.pid}\n")
ddpkit.barrier()


def load_shard(rank):
    raise ValueError(f"shard {rank} is corrupt")


if ctx.rank == 1:
    load_shard(ctx.rank)
t = torch.ones(1)
dist.all_reduce(t)
time.sleep(120)

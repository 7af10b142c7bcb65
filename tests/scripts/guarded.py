"""A job that waits for a go file, for the job-secret tests: ``guarded.py DIR``.

Rank 0 writes DIR/port (the rendezvous port) once the job has met; every rank
then waits for DIR/go, all-reduces ones and prints the sum.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ddpkit

folder = Path(sys.argv[1])
ctx = ddpkit.init()
if ctx.rank == 0:
    (folder / "port.tmp").write_text(os.environ["MASTER_PORT"])
    os.replace(folder / "port.tmp", folder / "port")
deadline = time.monotonic() + 60
while not (folder / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
t = torch.ones(3)
dist.all_reduce(t)
time.sleep(1.5)  # rank 0's inspector reports refusals once a second
ddpkit.barrier()
print("sum", ctx.rank, t.tolist(), flush=True)

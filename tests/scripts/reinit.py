"""``ddpkit.init()``, a collective, ``ddpkit.shutdown()``, twice in one process (as a script that switches backend
does): prints each sum."""

import os

import torch
import torch.distributed as dist

import ddpkit

for attempt in ("first", "second"):
    ddpkit.init(backend="gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    print(os.environ["RANK"], attempt, t.item(), flush=True)
    ddpkit.shutdown()

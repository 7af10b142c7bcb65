"""The smallest ddpkit job: every rank contributes its rank, all-reduce sums them.

Run it with ``ddpkit launch --nproc-per-node 2 examples/hello_allreduce.py``
(or under torchrun, mpirun or srun: ddpkit.init() reads any of them).
"""

import torch
import torch.distributed as dist

import ddpkit

ctx = ddpkit.init()
value = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(value)  # every rank gets 1 + 2 + ... + world_size
expected = ctx.world_size * (ctx.world_size + 1) / 2
print(f"rank {ctx.rank}/{ctx.world_size} on {ctx.device} ({ctx.backend}): all-reduce sum = {value.item():g}")
ddpkit.print0(f"ok: sum {value.item():g} == {expected:g}" if value.item() == expected else "MISMATCH")
ddpkit.shutdown()

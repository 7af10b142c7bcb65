"""A stale-synchronous loop under ``ddpkit launch --on-failure continue``: every gradient is all ones.

With SGD at lr 1 each step moves every element by minus the shares the step's all-reduce brought, so the final
values count what was applied: a dead worker's in-flight share applied on some survivors and not on others would
show as survivors that differ (``applied``: after steps of no gradient have brought every real one, before the
replicas are averaged). Environment: ``KILL=MEMBER:STEP`` (that member SIGKILLs itself before that step),
``STALENESS`` (2), ``STEPS`` (40), ``SLEEP`` seconds per step (0.02), ``JOINED`` (a file: a worker whose optimizer
raises at its construction, a refused replacement, writes why there, and the others wait for it before their last
five steps, so that a replacement meets a running job however slowly it starts). Each worker prints one JSON
line.
"""

import json
import os
import signal
import time
from pathlib import Path

import torch

import ddpkit

ddpkit.init()
member = int(os.environ["DDPKIT_FT_MEMBER"])
kill = tuple(map(int, os.environ["KILL"].split(":"))) if os.environ.get("KILL") else None
param = torch.nn.Parameter(torch.zeros(1000))
staleness = int(os.environ.get("STALENESS", "2"))
joined = Path(os.environ["JOINED"]) if os.environ.get("JOINED") else None
try:
    opt = ddpkit.StaleSynchronousOptimizer(torch.optim.SGD([param], lr=1.0), staleness=staleness)
except RuntimeError as e:
    if joined is not None:
        joined.write_text(str(e))
    raise
steps = int(os.environ.get("STEPS", "40"))
for step in range(steps):
    if kill == (member, step):
        os.kill(os.getpid(), signal.SIGKILL)
    if joined is not None and step == steps - 5:  # the last five steps after the replacement was refused
        deadline = time.monotonic() + 120
        while not joined.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"member {member}: no replacement came in 120 s")
            time.sleep(0.05)
    opt.zero_grad()
    param.sum().backward()
    opt.step()
    time.sleep(float(os.environ.get("SLEEP", "0.02")))
for _ in range(staleness + 1):  # steps of no gradient: every real step's all-reduce has come and been applied
    param.grad.zero_()
    opt.step()
applied = param[0].item()  # before the replicas are averaged, which would hide a difference
opt.synchronize()
print(json.dumps({"member": member, "applied": applied, "value": param[0].item(),
                  "uniform": bool(param.eq(param[0]).all()), "world": opt.world, "stats": opt.stats()}), flush=True)

"""DiLoCo under ``ddpkit launch --on-failure continue``: member ``m``'s inner gradient is all ``3 * 2 ** m``.

With inner SGD at lr 1 each inner step moves every element by ``-3 * 2 ** m``; the outer SGD at lr 1 without
momentum then moves the global model by the mean pseudo-gradient of the members that took part in the outer
step, so the survivors' final values show which outer steps they applied (two that differ would print different
values, the powers of two tell every set of members apart, and a third or a half of each sum is exact).
Environment: ``KILL=MEMBER:STEP`` (that member SIGKILLs itself before that inner step), ``INSIDE=1`` (instead:
a thread kills it ``INSIDE_S`` seconds into that step's outer step, whose exchange it has begun), ``SYNC_EVERY``
(4), ``STEPS`` (24), ``NUMEL`` (elements; 2**20), ``SLEEP`` seconds per inner step (0.01), ``CODEC`` (fp32).
Each worker prints one JSON line.
"""

import json
import os
import signal
import threading
import time

import torch

import ddpkit

ddpkit.init()
member = int(os.environ["DDPKIT_FT_MEMBER"])
kill = tuple(map(int, os.environ["KILL"].split(":"))) if os.environ.get("KILL") else None
inside = os.environ.get("INSIDE") == "1"
model = torch.nn.Linear(1, int(os.environ.get("NUMEL", str(2**20))), bias=False)
torch.nn.init.zeros_(model.weight)
inner = torch.optim.SGD(model.parameters(), lr=1.0)
outer = torch.optim.SGD(model.parameters(), lr=1.0)
diloco = ddpkit.DiLoCo(model, sync_every=int(os.environ.get("SYNC_EVERY", "4")), outer_optimizer=outer,
                       codec=os.environ.get("CODEC", "fp32"))
for step in range(int(os.environ.get("STEPS", "24"))):
    if kill == (member, step):
        if not inside:
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(float(os.environ.get("INSIDE_S", "0.002")), os.kill, (os.getpid(), signal.SIGKILL)).start()
    model.weight.grad = torch.full_like(model.weight, float(3 * 2**member))
    inner.step()
    diloco.step(samples=1)
    time.sleep(float(os.environ.get("SLEEP", "0.01")))
diloco.sync()
w = model.weight.detach().reshape(-1)
print(json.dumps({"member": member, "value": w[0].item(), "uniform": bool(w.eq(w[0]).all()),
                  "world": diloco.world_size, "samples": diloco.samples, "outer_steps": diloco.syncs,
                  "changes": diloco.changes}), flush=True)

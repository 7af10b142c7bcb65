"""DDP(comm=$COMM, "auto" by default) on an MLP across two testbed nodes; a pause 30 steps after a decision still
in force (past the drift's first look, 25 steps after it, which a loaded machine may use to re-open a decision: then
the next one), in which the test changes the link (the files PAUSE_DIR/decided and PAUSE_DIR/changed); ends a few
steps after the first decision made after the pause. Prints each rank's step of the pause and decisions as one JSON
line."""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit

ctx = ddpkit.init()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
model = ddpkit.DistributedDataParallel(net, comm=os.environ.get("COMM", "auto"))
state = model.reducer.comm_state
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(ctx.rank)
folder = Path(os.environ["PAUSE_DIR"])
paused_at = None
for step in range(1, 900):
    x, y = torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    latest = state.decisions[-1] if state.decisions else None
    if paused_at is None and latest and state.phase.name == "DECIDED" and step == latest["step"] + 30:
        paused_at = step  # the decision stood its first look (25 steps after it): now the link changes
        if ctx.rank == 0:
            (folder / "decided").write_text(str(step))
        deadline = time.monotonic() + 120
        while not (folder / "changed").exists():
            assert time.monotonic() < deadline, "the link was not changed"
            time.sleep(0.05)
    if paused_at is not None and latest["step"] > paused_at and step >= latest["step"] + 3:
        break
record = [{k: d[k] for k in ("step", "chosen", "tried_s", "predicted_s", "exact_step_s")} for d in state.decisions]
print("DECISIONS", ctx.rank, paused_at, json.dumps(record), flush=True)
sys.exit(0 if paused_at is not None and state.decisions[-1]["step"] > paused_at else 3)

"""DDP(comm=$COMM, "auto" by default) on an MLP across two testbed nodes; a pause after the first decision's baseline, in which the
test changes the link (the files PAUSE_DIR/decided and PAUSE_DIR/changed); ends a few steps after the second
decision. Prints each rank's decisions as one JSON line."""

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
for step in range(1, 600):
    x, y = torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    if len(state.decisions) == 1 and paused_at is None and step == state.decisions[0]["step"] + 30:
        paused_at = step  # the baseline is taken (25 steps after the decision): now the link changes
        if ctx.rank == 0:
            (folder / "decided").write_text(str(step))
        deadline = time.monotonic() + 120
        while not (folder / "changed").exists():
            assert time.monotonic() < deadline, "the link was not changed"
            time.sleep(0.05)
    if len(state.decisions) == 2 and step >= state.decisions[1]["step"] + 3:
        break
record = [{k: d[k] for k in ("step", "chosen", "tried_s")} for d in state.decisions]
print("DECISIONS", ctx.rank, paused_at, json.dumps(record), flush=True)
sys.exit(0 if len(state.decisions) == 2 else 3)

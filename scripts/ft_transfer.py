"""Time a live join's state transfer: a replacement receives a model of ``--mb`` MB from a peer.

Run under ``ddpkit launch --on-failure continue --max-restarts 1``: member 1 SIGKILLs itself at step 2, its
replacement joins at a step boundary and receives the model, optimizer and step from member 0 in 25 MiB buckets
over gloo. The replacement prints one line: the bytes it received and the seconds from the view that admitted it
to the state in place (the group's set-up, the agreement, the transfer and the load).

    ddpkit launch --standalone --nproc-per-node 2 --on-failure continue --max-restarts 1 \
        scripts/ft_transfer.py --mb 1024
"""

import argparse
import os
import signal
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--mb", type=int, default=1024, help="the model's size in MB (float32)")
parser.add_argument("--steps", type=int, default=40)
args = parser.parse_args()

ddpkit.init()
torch.manual_seed(0)
width = 4096
layers = max(1, round(args.mb * 2**20 / 4 / (width * width)))
model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
data = TensorDataset(torch.randn(64, width))
member = int(os.environ.get("DDPKIT_FT_MEMBER", "0"))
ft = ddpkit.FaultTolerance(model, optimizer, data, batch_size=4, virtual_shards=2)
for step in ft.steps(max_steps=args.steps):
    if member == 1 and step.index == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    for (x,) in step:
        model(x).square().mean().backward()
    if step.sync():
        optimizer.step()
    optimizer.zero_grad()
    time.sleep(0.2)
if member >= 2:
    for change in ft.changes:
        print(f"state of {sum(p.numel() for p in model.parameters()) * 4 / 2**20:.0f} MB: received "
              f"{change.transferred / 2**20:.0f} MiB, joined {change.rebuilt - change.noticed:.2f} s after the view "
              f"that admitted it", flush=True)

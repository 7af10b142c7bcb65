"""Training that goes on when a worker dies: ddpkit.FaultTolerance under ddpkit launch --on-failure continue.

    .venv/bin/ddpkit launch --standalone --nproc-per-node 4 --on-failure continue --max-restarts 2 \
        examples/fault_tolerant.py --epochs 5

Each worker prints its PID as it starts, and ``--step-time`` (default 0.05 s) paces the steps so the run lasts
long enough to kill one by hand (about 20 s at 3 epochs). Kill any worker (kill -9 PID) while it trains: the others go on in the same processes within a
fraction of a second, its share of each step spread over them, and (with --max-restarts) a
replacement joins and gets the state from a peer. The final weights, printed as a checksum, are
the same bits as the run without a failure (--deterministic).
"""

import argparse
import hashlib
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=64, help="the global batch of every step")
parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                    help="bitwise equal to the run without a failure (default on)")
parser.add_argument("--ddp", action="store_true",
                    help="train through ddpkit.DistributedDataParallel, as a DDP script does (the same bits)")
parser.add_argument("--comm-hook", choices=("none", "fp16", "bf16"), default="none",
                    help="with --ddp: the wrapper's comm hook (deterministic: the shards are added in that dtype, "
                         "the same bits at any number of workers)")
parser.add_argument("--step-time", type=float, default=0.05,
                    help="seconds each step waits (a stand-in for a larger model), so there is time to kill a worker")
args = parser.parse_args()
if args.comm_hook != "none" and not args.ddp:
    parser.error(f"--comm-hook {args.comm_hook} needs --ddp (a comm hook belongs to the DDP wrapper)")

ddpkit.init()
torch.manual_seed(0)
x = torch.randn(4096, 32)
y = (x[:, :16].sum(1) > x[:, 16:].sum(1)).long()
net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 2))
model = ddpkit.DistributedDataParallel(net) if args.ddp else net  # a DDP script keeps its wrapper
if args.comm_hook != "none":
    model.register_comm_hook(None, getattr(ddpkit.hooks, f"{args.comm_hook}_compress_hook"))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)

ft = ddpkit.FaultTolerance(model, optimizer, TensorDataset(x, y), batch_size=args.batch_size, virtual_shards=4,
                           deterministic=args.deterministic, state={"scheduler": scheduler})
print(f"worker {ft.rank} of {ft.world_size}: pid {os.getpid()} (kill -9 it to try the mode)", flush=True)
for step in ft.steps(epochs=args.epochs):
    time.sleep(args.step_time)
    loss_sum = torch.zeros(1)
    for xb, yb in step:  # this worker's shards of the step, one micro-batch each
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        loss_sum += loss.detach() * len(yb)
    if step.sync(values=loss_sum):  # False: the world changed mid-step; the same step comes again
        optimizer.step()
        scheduler.step()
        if (step.index + 1) % ft.steps_per_epoch == 0 and ft.rank == 0:
            print(f"epoch {step.epoch + 1}: last step's loss {float(step.values[0]) / step.samples:.4f} "
                  f"({ft.world_size} workers)", flush=True)
    optimizer.zero_grad()

if ft.rank == 0:
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()
    print(f"done: {ft.committed} steps, {len(ft.changes)} membership change(s), weights {digest[:16]}", flush=True)

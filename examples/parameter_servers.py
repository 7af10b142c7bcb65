"""Parameter servers: the workers push gradients and pull parameters, synchronously or asynchronously.

    .venv/bin/ddpkit launch --standalone --nproc-per-node 2 --num-servers 1 examples/parameter_servers.py --mode async

The launcher starts the servers beside the workers (``--num-servers K``: the parameters are cut across them) and
stops them when the workers are done. ``--mode sync`` waits for every worker's gradient of a step, as the
seed's synchronous parameter server; ``--mode async`` applies each gradient as it comes, a worker running at
most ``--staleness`` steps ahead of the slowest. Each worker prints the staleness of the parameters it trained on.
"""

import argparse

import torch
from torch import nn

import ddpkit

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--mode", choices=["sync", "async"], default="async")
parser.add_argument("--staleness", type=int, default=2, help="--mode async: the bound on a worker's lead")
parser.add_argument("--steps", type=int, default=40)
args = parser.parse_args()

ctx = ddpkit.init()
torch.manual_seed(0)  # the servers take worker 0's initial parameters either way
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = ddpkit.ParameterServerOptimizer(model.parameters(), torch.optim.SGD, lr=0.05, mode=args.mode,
                                      **({"staleness": args.staleness} if args.mode == "async" else {}))
g = torch.Generator().manual_seed(ctx.rank)  # each worker its own samples
for step in range(args.steps):
    x = torch.randn(16, 8, generator=g)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    loss.backward()
    opt.step()  # push this worker's gradients, pull the servers' parameters
ddpkit.barrier()
opt.pull()  # every worker now holds the servers' parameters
print(f"worker {ctx.rank}: last loss {loss.item():.4f}; staleness of the parameters it trained on: "
      f"{opt.stats.as_dict()['staleness_histogram']}", flush=True)
opt.close()  # the servers exit once every worker closed
ddpkit.shutdown()

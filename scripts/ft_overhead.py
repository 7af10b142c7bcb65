"""The cost of ddpkit.FaultTolerance when nothing fails: its step against ddpkit's DDP, interleaved in the same ranks.

Three copies of one model train on the same synthetic batches, a step of each in turn (the order rotating):
ddpkit's DistributedDataParallel, FaultTolerance (all-reduced, one shard per rank) and FaultTolerance with
``deterministic=True`` (the shards' gradients added along a fixed tree over the shards). Rank 0 prints each one's median
step and the ratio to DDP's with its quartiles (per rotation). Run it under any launcher (FaultTolerance then uses
the default group):

    OMP_NUM_THREADS=1 ddpkit launch --standalone --nproc-per-node 2 scripts/ft_overhead.py --hidden 4640
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--hidden", type=int, default=4640, help="MLP width (4640: about 25 M parameters)")
parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--shards-per-rank", type=int, default=1,
                    help="virtual shards per rank (V = this x the world size; the docs recommend 4 for spares)")
args = parser.parse_args()

ctx = ddpkit.init()
world = ctx.world_size


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                         nn.ReLU(), nn.Linear(args.hidden, 10))


total = (args.steps + args.warmup) * args.batch * world
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(total, 784, generator=g), torch.randint(0, 10, (total,), generator=g))
ddp_model = ddpkit.DDP(mlp())
ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
engines = {}
for name, det in (("fault-tolerance", False), ("deterministic", True)):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ft = ddpkit.FaultTolerance(model, opt, data, batch_size=args.batch * world, virtual_shards=world * args.shards_per_rank,
                               deterministic=det, shuffle=False)
    engines[name] = (model, opt, ft.steps(max_steps=args.steps + args.warmup))


def ddp_step(i: int) -> None:
    lo = (i * world + ctx.rank) * args.batch
    x, y = data[lo : lo + args.batch]
    F.cross_entropy(ddp_model(x), y).backward()
    ddp_opt.step()
    ddp_opt.zero_grad()


def ddp_micro_step(i: int) -> None:
    """DDP's step trained as the deterministic mode trains it: a micro-batch per shard (gradients accumulated
    under no_sync, reduced with the last): the floor of the deterministic mode's cost at V > n."""
    lo, size = (i * world + ctx.rank) * args.batch, args.batch // args.shards_per_rank
    for k in range(args.shards_per_rank):
        x, y = data[lo + k * size : lo + (k + 1) * size]
        if k < args.shards_per_rank - 1:
            with ddp_model.no_sync():
                F.cross_entropy(ddp_model(x), y).backward()
        else:
            F.cross_entropy(ddp_model(x), y).backward()
    ddp_opt.step()
    ddp_opt.zero_grad()


def ft_step(name: str) -> None:
    model, opt, steps = engines[name]
    step = next(steps)
    for x, y in step:
        F.cross_entropy(model(x), y).backward()
    assert step.sync()
    opt.step()
    opt.zero_grad()


runs = {"ddp": ddp_step, "fault-tolerance": lambda i: ft_step("fault-tolerance"),
        "deterministic": lambda i: ft_step("deterministic")}
if args.shards_per_rank > 1:
    runs["ddp, micro/shard"] = ddp_micro_step
times: dict[str, list[float]] = {name: [] for name in runs}
order = list(runs)
for i in range(args.steps + args.warmup):
    order = order[1:] + order[:1]
    for name in order:
        ddpkit.barrier()
        start = time.perf_counter()
        runs[name](i)
        elapsed = torch.tensor([time.perf_counter() - start])
        torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)  # a step lasts as its slowest rank
        if i >= args.warmup:
            times[name].append(float(elapsed))
if ctx.rank == 0:
    params = sum(p.numel() for p in ddp_model.parameters())
    print(f"{params / 1e6:.1f} M parameters, {world} ranks, {args.batch} samples per rank, {args.steps} steps, "
          f"V = {world * args.shards_per_rank}")
    ddp = times["ddp"]
    for name, ts in times.items():
        ratios = sorted(t / d for t, d in zip(ts, ddp))
        q = statistics.quantiles(ratios, n=4)
        print(f"{name:16s} median step {1e3 * statistics.median(ts):8.1f} ms   / ddp {statistics.median(ratios):.3f} "
              f"(quartiles {q[0]:.3f}-{q[2]:.3f})")
ddpkit.shutdown()

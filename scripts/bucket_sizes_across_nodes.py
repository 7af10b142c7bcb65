"""Whether DDP's bucket size changes the step across slow links: the measurement behind ``comm="auto"`` keeping the
model's ``bucket_cap_mb`` (docs/comm-auto.md, "What it does not do").

Makes two testbed nodes (network namespaces on one bridge, every cable shaped with ``tc tbf``,
:mod:`ddpkit.bench.sections.links.testbed`; needs root), starts ``ddpkit launch --nnodes 2 --nproc-per-node 1``
in each, and trains one model (``--model``, one of ``ddpkit train``'s language models, on random symbols, batch
``--batch-size``, SGD) under ddpkit's DDP at each ``--caps`` (MB; 0: the default, ``bucket_cap_mb=None``),
interleaved step by step, each from the same weights. Prints the slowest rank's median step of each cap over
``--steps`` steps (the first two left out), with its quartiles, and each cap's buckets:

    .venv/bin/python scripts/bucket_sizes_across_nodes.py --rate 1gbit --model gpt
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path


def worker(model_name: str, caps: list[float], steps: int, batch_size: int) -> None:
    """One rank of the job: a step of every cap in turn, each step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import ddpkit
    from ddpkit.models import build_model

    ctx = ddpkit.init(backend="gloo")
    torch.manual_seed(0)
    base = build_model(model_name)
    models = [ddpkit.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap or None) for cap in caps]
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
    g = torch.Generator().manual_seed(ctx.rank)
    times: list[list[float]] = [[] for _ in caps]
    for step in range(steps + 2):
        x = torch.randint(0, 65, (batch_size, 64), generator=g)
        for k, (model, opt) in enumerate(zip(models, optimizers)):
            dist.barrier()
            start = time.perf_counter()
            logits = model(x[:, :-1])
            F.cross_entropy(logits.flatten(0, -2), x[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if step >= 2:  # the first two: buckets rebuilt, connections made
                times[k].append(float(took))
    if ctx.rank == 0:
        for cap, model, t in zip(caps, models, times):
            q = statistics.quantiles(t, n=4)
            params = [p for p in model.module.parameters() if p.requires_grad]
            sizes = ", ".join(f"{sum(params[i].numel() for i in idx) * 4 / 1e6:.2f}" for idx in model.bucket_indices())
            name = f"{cap:>6g} MB" if cap else "default"  # 0: torch's default, 25 MiB after a first of 1 MiB
            print(f"cap {name}: median {statistics.median(t) * 1e3:7.1f} ms ({q[0] * 1e3:.1f}-{q[2] * 1e3:.1f}),"
                  f" buckets of {sizes} MB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="1gbit", help="every cable's rate (100mbit, 1gbit, ...; none: unshaped)")
    parser.add_argument("--model", default="gpt", help="gpt (0.8 M), gpt-10m, gpt-25m")
    parser.add_argument("--caps", type=float, nargs="+", default=[0, 0.25, 1, 4, 25, 100],
                        help="bucket_cap_mb values (0: the default, None)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.model, args.caps, args.steps, args.batch_size)
        return
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "src"))
    from ddpkit.bench.sections.links.testbed import Testbed

    with Testbed(2) as testbed:
        testbed.shape(None if args.rate == "none" else args.rate)
        script = [__file__, "--worker", "--model", args.model, "--steps", str(args.steps), "--batch-size",
                  str(args.batch_size), "--caps", *(str(c) for c in args.caps)]
        codes = testbed.launch(script)
    if any(codes):
        sys.exit(f"a launcher failed: exit codes {codes}")


if __name__ == "__main__":
    main()

"""Which all-reduce algorithm is fastest across slow links with several ranks per node: the measurement behind
``comm="auto"`` keeping the backend's own (docs/comm-auto.md, "What it does not do").

Makes two testbed nodes (network namespaces on one bridge, every cable shaped with ``tc tbf``,
:mod:`ddpkit.bench.sections.links.testbed`; needs root), starts ``ddpkit launch --nnodes 2 --nproc-per-node 2`` in
each, and times one all-reduce of ``--elements`` float32 values, interleaved, with gloo's own algorithm (``native``)
and ddpkit's ``hierarchical`` (a tree inside each node, a ring between the nodes' first ranks, which sends each
byte across the link once where a ring over all four ranks sends it one and a half times) and ``ring``
(:mod:`ddpkit.comm.algorithms`). Prints the slowest rank's median of each over ``--rounds`` rounds (the first
left out):

    .venv/bin/python scripts/algorithms_across_nodes.py --rate 1gbit --elements 4000000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ALGORITHMS = ("native", "hierarchical", "ring")


def worker(elements: int, rounds: int) -> None:
    """One rank of the job: every algorithm in turn, each round."""
    import torch
    import torch.distributed as dist

    import ddpkit
    from ddpkit.comm.allreduce import all_reduce

    ctx = ddpkit.init(backend="gloo")
    tensor = torch.randn(elements)
    times: dict[str, list[float]] = {name: [] for name in ALGORITHMS}
    for round_ in range(rounds + 1):
        for name in ALGORITHMS:
            dist.barrier()
            start = time.perf_counter()
            all_reduce(tensor, "sum", name, local_size=ctx.local_world_size)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if round_:  # the first round sets up connections
                times[name].append(float(took))
            tensor.div_(ctx.world_size)  # keeps the values finite
    if ctx.rank == 0:
        megabytes = elements * 4 / 1e6
        for name in ALGORITHMS:
            spread = ", ".join(f"{t * 1e3:.0f}" for t in times[name])
            print(f"{name:<13} median {statistics.median(times[name]) * 1e3:8.1f} ms for {megabytes:.1f} MB "
                  f"({spread})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="1gbit", help="every cable's rate (100mbit, 1gbit, ...; none: unshaped)")
    parser.add_argument("--elements", type=int, default=4_000_000, help="float32 values all-reduced")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.elements, args.rounds)
        return
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "src"))
    from ddpkit.bench.sections.links.testbed import Testbed

    with Testbed(2) as testbed:
        testbed.shape(None if args.rate == "none" else args.rate)
        script = [__file__, "--worker", "--elements", str(args.elements), "--rounds", str(args.rounds)]
        codes = testbed.launch(script, nproc_per_node=2)
    if any(codes):
        sys.exit(f"a launcher failed: exit codes {codes}")


if __name__ == "__main__":
    main()

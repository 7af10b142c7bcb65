"""How long ``comm="auto"``'s probe of the link takes across a shaped link, up to 64 MiB and up to a model's largest
bucket: the measurement behind the probe's stop at the largest bucket (docs/comm-auto.md, "How it decides").

Makes two testbed nodes (network namespaces on one bridge, every cable shaped with ``tc tbf``,
:mod:`ddpkit.bench.sections.links.testbed`; needs root), starts ``ddpkit launch --nnodes 2 --nproc-per-node 1`` in
each, and times :func:`ddpkit.comm.link_model.probe_link` on rank 0, first without a bound, then with
``most_bytes`` (``--most-bytes``, default 3.24 MB: the GPT of ``ddpkit bench links``), printing each one's time
and the link it measured:

    .venv/bin/python scripts/probe_across_nodes.py --rate 1gbit
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def worker(most_bytes: int) -> None:
    """One rank: the probe without a bound, then up to ``most_bytes``."""
    import torch
    import torch.distributed as dist

    import ddpkit
    from ddpkit.comm.link_model import probe_link

    ctx = ddpkit.init(backend="gloo")
    for bound in (None, most_bytes):
        dist.barrier()
        start = time.perf_counter()
        link = probe_link(None, torch.device("cpu"), most_bytes=bound)
        took = time.perf_counter() - start
        if ctx.rank == 0:
            print(f"up to {'64 MiB' if bound is None else f'{bound / 1e6:.2f} MB'}: {took:.2f} s, {link.describe()}",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="1gbit", help="every cable's rate (100mbit, 1gbit, ...; none: unshaped)")
    parser.add_argument("--most-bytes", type=int, default=3_240_000, help="the largest bucket's bytes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.most_bytes)
        return
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "src"))
    from ddpkit.bench.sections.links.testbed import Testbed

    with Testbed(2) as testbed:
        testbed.shape(None if args.rate == "none" else args.rate)
        codes = testbed.launch([__file__, "--worker", "--most-bytes", str(args.most_bytes)])
    if any(codes):
        sys.exit(f"a launcher failed: exit codes {codes}")


if __name__ == "__main__":
    main()

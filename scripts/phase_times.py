"""Per-phase step times of ddpkit's DDP and torch's on the same steps, and where ddpkit's reducer spends its time.

The engines alternate step by step (the one going first alternates too) with
a barrier before each step, so skew between ranks and drift in the machine's
speed are left out. Printed, for rank 0: the median forward, backward and
optimizer times of each engine, the plain model's backward, and the time
per step inside the main methods of ddpkit's reducer (a method's figure
includes the methods it calls).

Run: .venv/bin/python scripts/phase_times.py [--workload transformer] [--steps 150] [--mlp-hidden 660]
[--ddpkit-bucket-cap-mb 4]   (OMP_NUM_THREADS=1 is set for the ranks)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

PHASES = ("forward", "backward", "optimizer", "step")
REDUCER_METHODS = ("_on_ready", "_stage_one", "_stage", "_launch", "_wait_all", "_write_back", "_finish_backward")


def _timed(cls: type, name: str, spent: dict[str, float]) -> None:
    """Wrap ``cls.name`` so that its time accumulates in ``spent[name]``."""
    method = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start

    setattr(cls, name, wrapper)


def _worker(rank: int, opts: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import ddpkit
    from ddpkit._reference import torch_ddp
    from ddpkit.bench.config import BenchConfig
    from ddpkit.bench.engines import _workload
    from ddpkit.parallel.reducer import Reducer

    torch.set_num_threads(1)
    ddpkit.init(backend="gloo")
    spent: dict[str, float] = {}
    for name in REDUCER_METHODS:
        _timed(Reducer, name, spent)
    base, x, y = _workload(opts.workload, BenchConfig(workloads=(opts.workload,), mlp_hidden=opts.mlp_hidden))
    models = {"ddpkit": ddpkit.DDP(copy.deepcopy(base), bucket_cap_mb=opts.ddpkit_bucket_cap_mb),
              "torch": torch_ddp(copy.deepcopy(base)), "plain": copy.deepcopy(base)}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in models.items()}
    times: dict[str, dict[str, list[float]]] = {k: {p: [] for p in PHASES} for k in models}
    warmup = 5
    for step in range(warmup + opts.steps):
        engines = ["ddpkit", "torch"] if step % 2 == 0 else ["torch", "ddpkit"]
        if step == warmup:
            spent.clear()
        for engine in engines + ["plain"]:
            model, opt = models[engine], optimizers[engine]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if step >= warmup:
                for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    times[engine][phase].append(1000.0 * seconds)
    if rank == 0:
        print(f"{opts.workload}, world size {dist.get_world_size()}, {opts.steps} steps per engine, medians in ms")
        print(f"{'phase':<10} {'ddpkit':>8} {'torch':>8} {'diff':>7} {'plain':>8}")
        for phase in PHASES:
            a, b, c = (statistics.median(times[k][phase]) for k in ("ddpkit", "torch", "plain"))
            print(f"{phase:<10} {a:8.2f} {b:8.2f} {a - b:+7.2f} {c:8.2f}")
        print("ddpkit's reducer, ms per step (a method includes what it calls):")
        for name in REDUCER_METHODS:
            print(f"  {name:<18} {1000.0 * spent.get(name, 0.0) / opts.steps:7.2f}")
    ddpkit.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="transformer", choices=["convnet", "mlp", "resnet", "transformer",
                                                                      "linear200"])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mlp-hidden", type=int, default=4640)
    parser.add_argument("--ddpkit-bucket-cap-mb", type=float, default=None,
                        help="ddpkit's bucket cap only (torch keeps its default)")
    opts = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    import ddpkit

    ddpkit.spawn(_worker, opts.world_size, args=(opts,), backend="gloo")


if __name__ == "__main__":
    main()

"""Per-phase step times of ddpkit's DDP and torch's on the same steps, and where ddpkit's reducer spends its time.

The engines alternate step by step (the one going first alternates too) with
a barrier before each step, so skew between ranks and drift in the machine's
speed are left out. Printed, for rank 0: the median forward, backward and
optimizer times of each engine, the plain model's backward, and then, from
extra ddpkit steps run under ``cProfile`` (which slows every Python call, so
these figures are relative), the time per step inside the main functions of
ddpkit's engine (a function's figure includes the functions it calls).

Run: .venv/bin/python scripts/phase_times.py [--workload transformer] [--steps 150] [--mlp-hidden 660]
[--ddpkit-bucket-cap-mb 4]   (OMP_NUM_THREADS=1 is set for the ranks)
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import statistics
import time

PHASES = ("forward", "backward", "optimizer", "step")
ENGINE_FUNCTIONS = (("reducer.py", "_on_ready"), ("staging.py", "stage_one"), ("staging.py", "stage"),
                    ("reducer.py", "launch"), ("reducer.py", "wait_all"), ("staging.py", "write_back"),
                    ("reducer.py", "_finish_backward"))
"""(file, function) of ddpkit's engine whose cumulative time is reported."""


def _engine_times(profile: cProfile.Profile, steps: int) -> dict[str, float]:
    """Milliseconds per step inside each of :data:`ENGINE_FUNCTIONS`, from ``profile``."""
    found = dict.fromkeys((f for _, f in ENGINE_FUNCTIONS), 0.0)
    for (path, _, function), row in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        for file, name in ENGINE_FUNCTIONS:
            if function == name and path.endswith(os.path.join("parallel", file)):
                found[name] += row[3]  # cumulative seconds
    return {name: 1000.0 * seconds / steps for name, seconds in found.items()}


def _worker(rank: int, opts: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import ddpkit
    from ddpkit._reference import torch_ddp
    from ddpkit.bench.bench_config import BenchConfig
    from ddpkit.bench.workloads import workload

    torch.set_num_threads(1)
    ddpkit.init(backend="gloo")
    base, x, y = workload(opts.workload, BenchConfig(workloads=(opts.workload,), mlp_hidden=opts.mlp_hidden))
    models = {"ddpkit": ddpkit.DDP(copy.deepcopy(base), bucket_cap_mb=opts.ddpkit_bucket_cap_mb),
              "torch": torch_ddp(copy.deepcopy(base)), "plain": copy.deepcopy(base)}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in models.items()}
    times: dict[str, dict[str, list[float]]] = {k: {p: [] for p in PHASES} for k in models}
    warmup = 5
    for step in range(warmup + opts.steps):
        engines = ["ddpkit", "torch"] if step % 2 == 0 else ["torch", "ddpkit"]
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
    profile = cProfile.Profile()
    model, opt = models["ddpkit"], optimizers["ddpkit"]
    for _ in range(opts.steps):
        dist.barrier()
        profile.enable()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        profile.disable()
    spent = _engine_times(profile, opts.steps)
    if rank == 0:
        print(f"{opts.workload}, world size {dist.get_world_size()}, {opts.steps} steps per engine, medians in ms")
        print(f"{'phase':<10} {'ddpkit':>8} {'torch':>8} {'diff':>7} {'plain':>8}")
        for phase in PHASES:
            a, b, c = (statistics.median(times[k][phase]) for k in ("ddpkit", "torch", "plain"))
            print(f"{phase:<10} {a:8.2f} {b:8.2f} {a - b:+7.2f} {c:8.2f}")
        print("ddpkit's engine under cProfile, ms per step (a function includes what it calls):")
        for name, ms in spent.items():
            print(f"  {name:<18} {ms:7.2f}")
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

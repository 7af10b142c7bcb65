"""``ddpkit bench --memory``: peak memory per rank of each engine, each in processes of its own.

A process's peak resident set (``ru_maxrss``) only grows, so each engine and
workload runs in fresh processes: the peak is read after the warm-up and
``min(--steps, 10)`` training steps, minus the peak before the model was
built (the interpreter, torch, the process group). What is left is the
model, its gradients, the optimizer's state, the batch, the activations and
what the engine adds (buckets, staging); both engines are measured the same
way, so the difference is the engines'. The largest value over the ranks is
reported.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
from pathlib import Path

from ddpkit.bench.config import BenchConfig

MEMORY_STEPS = 10
"""Training steps after the warm-up before the peak is read."""


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _worker(rank: int, cfg: BenchConfig, name: str, engine: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from ddpkit.bench.engines import _stepper, _workload
    from ddpkit.runtime.group import init, shutdown

    torch.set_num_threads(1)
    init(backend="gloo")
    dist.barrier()
    before = _peak_mb()
    model, x, y = _workload(name, cfg)
    if engine == "ddpkit":
        from ddpkit.parallel.ddp import DistributedDataParallel

        model = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb)
    else:
        from ddpkit._reference import torch_ddp

        model = torch_ddp(model, bucket_cap_mb=cfg.bucket_cap_mb)
    step = _stepper(model, x, y)
    for _ in range(cfg.warmup + min(cfg.steps, MEMORY_STEPS)):
        step()
    grown = torch.tensor([_peak_mb() - before])
    dist.all_reduce(grown, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps(grown.item()))
    shutdown()


def measure_memory(cfg: BenchConfig) -> dict[str, dict[str, float]]:
    """``{workload: {"ddpkit_mb": ..., "torch_mb": ...}}``, each measured in its own processes."""
    from ddpkit.runtime.spawn import spawn

    found: dict[str, dict[str, float]] = {}
    for name in (w for w in cfg.workloads if w != "dp"):
        for engine in ("ddpkit", "torch"):
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "peak.json")
                spawn(_worker, cfg.world_size, args=(cfg, name, engine, out), backend="gloo")
                found.setdefault(name, {})[f"{engine}_mb"] = json.loads(Path(out).read_text())
    return found


def format_memory(found: dict[str, dict[str, float]]) -> str:
    lines = ["peak memory per rank above the process's own baseline, in MB (the largest over ranks):",
             f"{'workload':<11} {'ddpkit':>9} {'torch':>9} {'ddpkit/torch':>12}"]
    for name, m in found.items():
        ratio = m["ddpkit_mb"] / m["torch_mb"] if m["torch_mb"] > 0 else float("nan")
        lines.append(f"{name:<11} {m['ddpkit_mb']:>9.1f} {m['torch_mb']:>9.1f} {ratio:>12.3f}")
    return "\n".join(lines)

"""``ddpkit bench --memory``: peak memory per rank of each engine, each in processes of its own.

A process's peak resident set (``ru_maxrss``) only grows, so each engine and
workload runs in fresh processes (``MEMORY_REPEATS`` times, engines
alternating, the median reported; glibc's mmap threshold fixed, see
``_FIXED_MMAP_THRESHOLD``): the peak is read after the warm-up and
``min(--steps, 10)`` training steps, minus the peak before the model was
built (the interpreter, torch, the process group). What is left is the
model, its gradients, the optimizer's state, the batch, the activations and
what the engine adds (buckets, staging); both engines are measured the same
way, and both engines' code is imported before the baseline, so the
difference is the engines'. The largest value over the ranks is reported.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
from pathlib import Path
from typing import Any

from ddpkit.bench.config import BenchConfig
from ddpkit.bench.engines import BATCH_FIELD

MEMORY_STEPS = 10
"""Training steps after the warm-up before the peak is read."""


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _worker(rank: int, cfg: BenchConfig, name: str, engine: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    # Both engines' code is loaded before the baseline (torch's DDP comes with ``import torch``):
    # the one-time cost of importing a module is not memory the engine needs per model.
    from ddpkit._reference import torch_ddp
    from ddpkit.bench.engines import _stepper, _workload
    from ddpkit.parallel.ddp import DistributedDataParallel
    from ddpkit.runtime.group import init, shutdown

    torch.set_num_threads(1)
    init(backend="gloo")
    dist.barrier()
    before = _peak_mb()
    model, x, y = _workload(name, cfg)
    if engine == "ddpkit":
        model = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb)
    else:
        model = torch_ddp(model, bucket_cap_mb=cfg.bucket_cap_mb)
    step = _stepper(model, x, y)
    for _ in range(cfg.warmup + min(cfg.steps, MEMORY_STEPS)):
        step()
    grown = torch.tensor([_peak_mb() - before])
    dist.all_reduce(grown, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps(grown.item()))
    shutdown()


MEMORY_REPEATS = 3
"""Fresh-process measurements per engine and workload (engines alternating); the median is reported."""

_FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc: every allocation above 64 KiB is its own mapping, returned on free. Without it glibc raises the
threshold as large blocks are freed and serves later tensors from its heap, where the peak then depends
on the order of allocations and frees (measured: the same engine and workload 128 MB in one run, 136 MB in
the next); with it the peak follows the tensors alive at once (runs within about 1 MB)."""


def measure_memory(cfg: BenchConfig) -> dict[str, dict[str, Any]]:
    """``{workload: {"ddpkit_mb": median, "torch_mb": median, "ddpkit_runs": [...], "torch_runs": [...]}}``.

    Each measurement runs in processes of its own.
    """
    import statistics

    from ddpkit.runtime.spawn import spawn

    found: dict[str, dict[str, Any]] = {}
    saved = {k: os.environ.get(k) for k in _FIXED_MMAP_THRESHOLD}
    os.environ.update(_FIXED_MMAP_THRESHOLD)  # read by each new process at start
    try:
        for name in (w for w in cfg.workloads if w in BATCH_FIELD):  # the DDP workloads, not dp or strategies
            runs: dict[str, list[float]] = {"ddpkit": [], "torch": []}
            for r in range(MEMORY_REPEATS):
                for engine in ("ddpkit", "torch") if r % 2 == 0 else ("torch", "ddpkit"):
                    with tempfile.TemporaryDirectory() as tmp:
                        out = os.path.join(tmp, "peak.json")
                        spawn(_worker, cfg.world_size, args=(cfg, name, engine, out), backend="gloo")
                        runs[engine].append(json.loads(Path(out).read_text()))
            found[name] = {**{f"{e}_mb": statistics.median(v) for e, v in runs.items()},
                           **{f"{e}_runs": v for e, v in runs.items()}}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return found


def format_memory(found: dict[str, dict[str, Any]]) -> str:
    lines = [f"peak memory per rank above the process's own baseline, in MB (the largest over ranks; median of "
             f"{MEMORY_REPEATS} runs in fresh processes, range in brackets):",
             f"{'workload':<11} {'ddpkit':>21} {'torch':>21} {'ddpkit/torch':>12}"]

    def cell(m: dict[str, Any], engine: str) -> str:
        runs = m.get(f"{engine}_runs") or [m[f"{engine}_mb"]]
        return f"{m[f'{engine}_mb']:.1f} [{min(runs):.1f}-{max(runs):.1f}]"

    for name, m in found.items():
        ratio = m["ddpkit_mb"] / m["torch_mb"] if m["torch_mb"] > 0 else float("nan")
        lines.append(f"{name:<11} {cell(m, 'ddpkit'):>21} {cell(m, 'torch'):>21} {ratio:>12.3f}")
    return "\n".join(lines)

"""``ddpkit bench --memory``: peak memory per rank of each engine, each in processes of its own.

A process's peak resident set (``ru_maxrss``) only grows, so each engine and
workload runs in processes of its own (``MEMORY_REPEATS`` times, engines
alternating, the median reported; forked from the bench's server, see
:mod:`ddpkit.bench.runners.ranks`; glibc's mmap threshold fixed, see
``MMAP_THRESHOLD``): the peak is read after the warm-up and
``min(--steps, 10)`` training steps, minus the peak before the model was
built (the interpreter, torch, the process group, and the some 800 modules,
about 65 MB, that constructing the first optimizer imports: torch._dynamo and
its dependencies). What is left is the
model, its gradients, the optimizer's state, the batch, the activations and
what the engine adds (buckets, staging); both engines are measured the same
way, and both engines' code is imported before the baseline, so the
difference is the engines'. The largest value over the ranks is reported.

Two figures per run:

* *private*: the peak of the process's own memory (anonymous pages: tensors,
  the heap, Python objects), taken as the peak resident set minus the pages
  mapped from files (shared libraries' code and data) at the time of
  reading, above the private memory in use at the baseline. File pages are
  shared between the ranks of a machine and are only paged in, never given
  back without memory pressure, so they are counted at their final (largest)
  size. This is the memory each rank costs, and the headline.
* *rss*: the peak resident set (``ru_maxrss``) above the resident set in use
  at the baseline (not above an earlier peak, which imports and the process
  group's set-up may have left higher than what is in use). It also counts the
  code pages of whatever parts of libtorch and Python the engine executes
  (about 0.5 MB more for ddpkit, whose reducer calls other kernels than
  torch's C++ one), which the ranks share.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
from pathlib import Path
from typing import Any

from ddpkit.bench.bench_config import BenchConfig
from ddpkit.bench.report.summary import memory_ratio
from ddpkit.bench.workloads import BATCH_FIELD

MEMORY_STEPS = 10
"""Training steps after the warm-up before the peak is read."""


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _status_mb(*fields: str) -> float:
    """The sum of these ``/proc/self/status`` fields (``"RssFile"``, ...), in MB; 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            return sum(int(line.split()[1]) for line in f if line.split(":")[0] in fields) / 1024.0
    except OSError:
        return 0.0


def in_use() -> tuple[float, float]:
    """(resident set, private memory) in use now, in MB: the baseline."""
    return _status_mb("VmRSS"), _status_mb("RssAnon")


def peaks() -> tuple[float, float]:
    """(peak resident set, peak private memory) so far, in MB (see the module notes)."""
    peak = _peak_mb()
    return peak, peak - _status_mb("RssFile", "RssShmem")


def _worker(rank: int, cfg: BenchConfig, name: str, engine: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    # Both engines' code is loaded before the baseline (torch's DDP comes with ``import torch``):
    # the one-time cost of importing a module is not memory the engine needs per model.
    from ddpkit._reference import torch_ddp
    from ddpkit.bench.workloads import stepper, workload
    from ddpkit.parallel.ddp.wrapper import DistributedDataParallel
    from ddpkit.runtime.devices import comm_tensor
    from ddpkit.runtime.group import init, shutdown

    torch.set_num_threads(1)
    # Constructing the first optimizer imports torch._dynamo and its dependencies (some 800 modules, about
    # 65 MB), whichever engine runs: a one-time cost too, paid before the baseline.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    init()  # the backend spawn() gave these ranks (gloo)
    fix_mmap_threshold()
    dist.barrier()
    before = in_use()
    model, x, y = workload(name, cfg)
    if engine == "ddpkit":
        model = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb)
    else:
        model = torch_ddp(model, bucket_cap_mb=cfg.bucket_cap_mb)
    step = stepper(model, x, y)
    for _ in range(cfg.warmup + min(cfg.steps, MEMORY_STEPS)):
        step()
    grown = comm_tensor([after - first for after, first in zip(peaks(), before)])
    dist.all_reduce(grown, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps(dict(zip(("rss", "private"), grown.tolist()))))
    shutdown()


MEMORY_REPEATS = 3
"""Measurements (each in processes of its own) per engine and workload (engines alternating); the median is reported."""

MMAP_THRESHOLD = 65536
"""glibc: every allocation above 64 KiB is its own mapping, returned on free. Without it glibc raises the
threshold as large blocks are freed and serves later tensors from its heap, where the peak then depends
on the order of allocations and frees (measured: the same engine and workload 128 MB in one run, 136 MB in
the next); with it the peak follows the tensors alive at once (runs within about 1 MB)."""

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def fix_mmap_threshold() -> None:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` in this process from now on (what
    ``MALLOC_MMAP_THRESHOLD_`` does from a process's start; it also stops glibc moving it); nothing where the C
    library has no ``mallopt``."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def measure_memory(cfg: BenchConfig) -> dict[str, dict[str, Any]]:
    """``{workload: {"ddpkit_mb": ..., "torch_mb": ..., "ddpkit_runs": [...], "torch_runs": [...], and the same
    with "rss" for the resident set}}``: private memory (see the module notes), median and runs, in MB.

    Each measurement runs in processes of its own.
    """
    import statistics

    from ddpkit.bench.runners.ranks import spawn_ranks

    found: dict[str, dict[str, Any]] = {}
    for name in (w for w in cfg.workloads if w in BATCH_FIELD):  # the DDP workloads, not dp or strategies
        runs: dict[str, list[dict[str, float]]] = {"ddpkit": [], "torch": []}
        for r in range(MEMORY_REPEATS):
            for engine in ("ddpkit", "torch") if r % 2 == 0 else ("torch", "ddpkit"):
                with tempfile.TemporaryDirectory() as tmp:
                    out = os.path.join(tmp, "peak.json")
                    spawn_ranks(_worker, cfg.world_size, args=(cfg, name, engine, out))
                    runs[engine].append(json.loads(Path(out).read_text()))
        found[name] = {}
        for e, v in runs.items():
            for kind, suffix in (("private", ""), ("rss", "_rss")):
                values = [run[kind] for run in v]
                found[name][f"{e}{suffix}_mb"] = statistics.median(values)
                found[name][f"{e}{suffix}_runs"] = values
    return found


def format_memory(found: dict[str, dict[str, Any]]) -> str:
    lines = [f"peak memory per rank above the process's own baseline, in MB (the largest over ranks; median of "
             f"{MEMORY_REPEATS} runs in processes of their own, range in brackets); private: the process's own pages, "
             "rss: with the shared code pages it touched:",
             f"{'workload':<11} {'ddpkit private':>21} {'torch private':>21} {'ratio':>6} "
             f"{'ddpkit rss':>8} {'torch rss':>9} {'ratio':>6}"]

    def cell(m: dict[str, Any], engine: str) -> str:
        runs = m.get(f"{engine}_runs") or [m[f"{engine}_mb"]]
        return f"{m[f'{engine}_mb']:.1f} [{min(runs):.1f}-{max(runs):.1f}]"

    for name, m in found.items():
        rss = (f"{m['ddpkit_rss_mb']:>10.1f} {m['torch_rss_mb']:>9.1f} {memory_ratio(m, '_rss'):>6.3f}"
               if "ddpkit_rss_mb" in m else "")
        lines.append(f"{name:<11} {cell(m, 'ddpkit'):>21} {cell(m, 'torch'):>21} {memory_ratio(m):>6.3f} {rss}")
    return "\n".join(lines)

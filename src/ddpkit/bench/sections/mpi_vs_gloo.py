"""``ddpkit bench backends``: the mpi backend against gloo, both in the same ranks, interleaved.

For each world size, one ``mpirun`` job of ranks whose default group is the
``mpi`` backend and which also hold a gloo group over the same ranks. Then:

* **bus bandwidth** of an in-place float32 all-reduce, 4 KiB to 256 MiB: for
  each size, rounds alternating mpi and gloo (which goes first alternates
  too); a round's time is its slowest rank's; the figure the median over
  rounds. ``busbw`` = bytes / time x 2(p-1)/p (nccl-tests' definition), and
  the ratio mpi / gloo with the quartiles of the per-round ratios;
* **the DDP step** of each workload (:mod:`ddpkit.bench.workloads`): three
  engines on copies of one model, run in turn step by step (the order
  rotating): ddpkit's DDP over mpi, ddpkit's DDP over gloo, and torch's DDP
  over gloo. Reported: each engine's median step, and torch-on-gloo's step
  over ddpkit-on-mpi's per rotation, its median with a distribution-free 95 %
  confidence interval (:func:`ddpkit.bench.report.stats.median_ci`) and the verdict
  (faster when the whole interval lies above 1).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpkit.bench.bench_config import WorkloadSizes
from ddpkit.runtime.options import ConfigError, option, plain, writable_file

__all__ = ["BackendsBenchConfig", "format_bandwidth", "format_steps", "run"]

KIB = 1024
WORKLOADS = ("mlp", "convnet", "resnet", "transformer")


@dataclass(kw_only=True)
class BackendsBenchConfig(WorkloadSizes):
    """What ``ddpkit bench backends`` measures."""

    sizes: tuple[int, ...] = option(
        tuple(4 * KIB * 4**k for k in range(9)), "all-reduce sizes in bytes (default 4 KiB to 256 MiB, powers of 4)",
        metavar="BYTES",
    )
    world_sizes: tuple[int, ...] = option((2, 3), "world sizes to measure", metavar="N")
    iters: int = option(20, "timed rounds per size (fewer above 16 MiB: at least 5, about 2 s of each backend)")
    workloads: tuple[str, ...] = option(WORKLOADS, f"DDP workloads, among {', '.join(WORKLOADS)}", metavar="NAME")
    ddp: bool = option(True, "time the DDP steps too (--no-ddp: the all-reduce alone)", negate="--no-ddp",
                       negate_only=True)
    steps: int = option(30, "timed steps per engine and workload")
    warmup: int = option(3, "untimed steps per engine first")
    json_path: Path | None = option(None, "also write the results to this JSON file", flags=["--json"])
    progress: bool = option(True, "print a line to stderr as each part starts", negate="--no-progress",
                            negate_only=True)

    device = "cpu"
    """The ranks' device (:func:`ddpkit.bench.workloads.workload` reads it): the CPU, where MPI and gloo compete."""

    def __post_init__(self) -> None:
        self.sizes, self.world_sizes, self.workloads = tuple(self.sizes), tuple(self.world_sizes), \
            tuple(self.workloads)
        if not self.sizes or min(self.sizes) < 4:
            raise ConfigError(f"--sizes {' '.join(map(str, self.sizes))}: each must be at least 4 bytes")
        if not self.world_sizes or min(self.world_sizes) < 2:
            raise ConfigError(f"--world-sizes {' '.join(map(str, self.world_sizes))}: each must be at least 2")
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        if unknown:
            raise ConfigError(f"--workloads {' '.join(unknown)}: choose among {', '.join(WORKLOADS)}")
        if self.iters < 1 or self.steps < 1 or self.warmup < 0:
            raise ConfigError(f"--iters {self.iters} and --steps {self.steps} must be at least 1, --warmup "
                              f"{self.warmup} 0 or more")
        if self.json_path is not None:
            self.json_path = writable_file(self.json_path, "--json")


def _say(cfg: BackendsBenchConfig, text: str) -> None:
    if cfg.progress:
        print(f"ddpkit bench backends: {text}", file=sys.stderr, flush=True)


def _bandwidth(cfg: BackendsBenchConfig, groups: dict[str, Any]) -> list[dict]:
    import torch
    import torch.distributed as dist

    from ddpkit.runtime.devices import comm_device, comm_tensor

    world = dist.get_world_size()
    rows = []
    for nbytes in cfg.sizes:
        t = torch.ones(nbytes // 4, device=comm_device())
        rounds = cfg.iters if nbytes <= 16 * 2**20 else max(5, min(cfg.iters, int(4e9 / nbytes)))
        times: dict[str, list[float]] = {name: [] for name in groups}
        names = list(groups)
        for r in range(rounds + 1):
            for name in names[r % 2:] + names[: r % 2]:
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t, group=groups[name])
                took = comm_tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the round ends with its slowest rank
                if r:
                    times[name].append(took.item())
        ratios = [g / m for m, g in zip(times["mpi"], times["gloo"])]
        bus = 2 * (world - 1) / world * nbytes
        row = {"world_size": world, "bytes": nbytes, "rounds": rounds, "ratio": statistics.median(ratios),
               "ratio_iqr": _iqr(ratios)}
        for name, ts in times.items():
            row[f"{name}_s"] = statistics.median(ts)
            row[f"{name}_busbw_gbs"] = bus / statistics.median(ts) / 1e9
        rows.append(row)
    return rows


def _steps(cfg: BackendsBenchConfig, groups: dict[str, Any]) -> list[dict]:
    import copy

    import torch.distributed as dist

    from ddpkit._reference import torch_ddp
    from ddpkit.bench.report.stats import median_ci, verdict
    from ddpkit.bench.workloads import stepper, workload
    from ddpkit.parallel.ddp.wrapper import DistributedDataParallel

    rows = []
    for name in cfg.workloads:
        base, x, y = workload(name, cfg)  # type: ignore[arg-type] - WorkloadSizes and device: what it reads
        engines = {
            "ddpkit_mpi": DistributedDataParallel(copy.deepcopy(base), process_group=groups["mpi"]),
            "ddpkit_gloo": DistributedDataParallel(copy.deepcopy(base), process_group=groups["gloo"]),
            "torch_gloo": torch_ddp(copy.deepcopy(base), process_group=groups["gloo"]),
        }
        steps = {engine: stepper(model, x, y) for engine, model in engines.items()}
        for step in steps.values():
            for _ in range(cfg.warmup):
                step()
        times: dict[str, list[float]] = {engine: [] for engine in steps}
        order = list(steps)
        for r in range(cfg.steps):
            for engine in order[r % 3:] + order[: r % 3]:
                dist.barrier()
                times[engine].append(steps[engine]())
        speedup = [t / m for m, t in zip(times["ddpkit_mpi"], times["torch_gloo"])]
        ci = median_ci(speedup)
        rows.append({"world_size": dist.get_world_size(), "workload": name,
                     "params": sum(p.numel() for p in base.parameters()), "steps": cfg.steps,
                     **{f"{engine}_ms": 1000 * statistics.median(ts) for engine, ts in times.items()},
                     "speedup_vs_torch_gloo": statistics.median(speedup), "speedup_ci95": ci,
                     "verdict": {"faster": "slower", "slower": "faster", "level": "level"}[verdict(ci)],
                     "speedup_vs_ddpkit_gloo": statistics.median(
                         [g / m for m, g in zip(times["ddpkit_mpi"], times["ddpkit_gloo"])])})
        del engines, steps
    return rows


def _iqr(xs: list[float]) -> tuple[float, float]:
    from ddpkit.bench.report.stats import quartiles

    return quartiles(xs)


def _worker(rank: int, cfg: BackendsBenchConfig, out: str) -> None:
    import torch
    import torch.distributed as dist

    from ddpkit.runtime.group import init, shutdown

    torch.set_num_threads(1)
    ctx = init()
    if ctx.backend != "mpi":
        raise RuntimeError(f"ddpkit bench backends runs on the mpi backend, and these ranks have {ctx.backend}")
    groups = {"mpi": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    if rank == 0:
        _say(cfg, f"world {ctx.world_size}: all-reduce, {len(cfg.sizes)} sizes")
    bandwidth = _bandwidth(cfg, groups)
    if rank == 0 and cfg.ddp:
        _say(cfg, f"world {ctx.world_size}: DDP steps of {', '.join(cfg.workloads)}")
    steps = _steps(cfg, groups) if cfg.ddp else []
    if rank == 0:
        Path(out).write_text(json.dumps({"bandwidth": bandwidth, "steps": steps}))
    shutdown()


def run(cfg: BackendsBenchConfig) -> dict[str, list[dict]]:
    """Measure at each world size (one mpirun job each), print both tables, and return the rows.

    Raises:
        ddpkit.runtime.mpirun.MpirunError: no mpirun of mpi4py's MPI here.
        ddpkit.WorkerError: a rank failed.
    """
    from ddpkit.bench.runners.ranks import spawn_ranks

    found: dict[str, list[dict]] = {"bandwidth": [], "steps": []}
    for i, world in enumerate(cfg.world_sizes, 1):
        _say(cfg, f"world size {world} ({i}/{len(cfg.world_sizes)}): one mpirun job of {world} ranks")
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "results.json")
            spawn_ranks(_worker, world, args=(cfg, out), backend="mpi")
            got = json.loads(Path(out).read_text())
        for key in found:
            found[key] += got[key]
    print(format_bandwidth(found["bandwidth"]), flush=True)
    if found["steps"]:
        print(format_steps(found["steps"]), flush=True)
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps({"settings": plain(cfg), **found}, indent=2) + "\n")
    return found


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def format_bandwidth(rows: list[dict]) -> str:
    """The bus-bandwidth table: one line per world size and message size."""
    lines = ["all-reduce bus bandwidth, mpi (mpi4py) and gloo in the same ranks, interleaved",
             f"{'world':>5} {'size':>9} {'mpi GB/s':>9} {'gloo GB/s':>9} {'mpi/gloo':>9} {'IQR':>13} {'rounds':>6}"]
    for r in rows:
        lines.append(f"{r['world_size']:>5} {_size(r['bytes']):>9} {r['mpi_busbw_gbs']:>9.3f} "
                     f"{r['gloo_busbw_gbs']:>9.3f} {r['ratio']:>8.2f}x {r['ratio_iqr'][0]:>6.2f}-"
                     f"{r['ratio_iqr'][1]:<6.2f} {r['rounds']:>6}")
    return "\n".join(lines)


def format_steps(rows: list[dict]) -> str:
    """The DDP-step table: each engine's median step, and the speed-up of ddpkit on mpi over torch on gloo."""
    lines = ["DDP step (median ms): ddpkit over mpi, ddpkit over gloo, torch over gloo; speed-up = torch-gloo / "
             "ddpkit-mpi per rotation, median [95 % CI]",
             f"{'world':>5} {'workload':<12} {'params':>10} {'ddpkit-mpi':>10} {'ddpkit-gloo':>11} "
             f"{'torch-gloo':>10} {'speed-up':>9} {'95 % CI':>13}  verdict"]
    for r in rows:
        lines.append(f"{r['world_size']:>5} {r['workload']:<12} {r['params']:>10,} {r['ddpkit_mpi_ms']:>10.1f} "
                     f"{r['ddpkit_gloo_ms']:>11.1f} {r['torch_gloo_ms']:>10.1f} {r['speedup_vs_torch_gloo']:>8.2f}x "
                     f"{r['speedup_ci95'][0]:>6.2f}-{r['speedup_ci95'][1]:<6.2f}  {r['verdict']}")
    return "\n".join(lines)

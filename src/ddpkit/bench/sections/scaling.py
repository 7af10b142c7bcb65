"""``ddpkit bench --scaling``: how both engines scale with the world size and with the model size.

Each point is one :func:`ddpkit.bench.sections.engines.bench_workload` measurement
(both engines interleaved, medians with quartiles) in processes of their own at
that world size:

weak scaling
    the same batch per rank at every world size (the global batch grows):
    ideal throughput grows linearly with the world size;
strong scaling
    the same global batch at every world size (per rank: the workload's
    batch x the largest world size / this world size): ideal step time
    falls linearly;
model size
    the MLP at about each of ``--mlp-sizes`` parameters, at ``--world-size``:
    step time of both engines and their ratio.

Throughput is samples per second over all ranks (global batch / median step).
Efficiency is throughput / (throughput at the smallest world size x world size
/ that world size): 1 is perfect scaling. On a machine with fewer cores than
ranks, efficiency falls for reasons that have nothing to do with either
engine; the JSON records the CPU count beside the figures.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ddpkit.bench.bench_config import BenchConfig
from ddpkit.bench.report.console import machine, say
from ddpkit.bench.report.table import note_lines
from ddpkit.bench.sections.engines import bench_workload
from ddpkit.bench.workloads import BATCH_FIELD
from ddpkit.runtime.options import plain


@dataclass(kw_only=True)
class ScalingPoint:
    """One measured point of a sweep (times in ms, medians over steps)."""

    sweep: str
    """``weak``, ``strong`` or ``size``."""
    workload: str
    world_size: int
    params: int
    batch_per_rank: int
    ddpkit_ms: float
    torch_ms: float
    ratio: float
    ratio_iqr: tuple[float, float]
    steps: int

    def throughput(self, engine: str) -> float:
        """Samples per second over all ranks."""
        step_ms = self.ddpkit_ms if engine == "ddpkit" else self.torch_ms
        return self.batch_per_rank * self.world_size / (step_ms / 1000.0)


def mlp_hidden_for(params: float) -> int:
    """The hidden width of :class:`ddpkit.models.MLP` (784-h-h-10) closest to ``params`` parameters."""
    # 784h + h + h*h + h + 10h + 10 parameters: solve h^2 + 796h + 10 = params.
    return max(1, round((-796 + math.sqrt(796**2 + 4 * max(0.0, params - 10))) / 2))


def plan(cfg: BenchConfig) -> dict[int, list[tuple[str, str, BenchConfig]]]:
    """The measurements of each world size: ``(sweep, workload, settings)``."""
    worlds = sorted(set(cfg.world_sizes)) or list(range(1, (os.cpu_count() or 1) + 1))
    names = [w for w in cfg.workloads if w in BATCH_FIELD]  # the DDP workloads (not dp, nor strategies)
    jobs: dict[int, list[tuple[str, str, BenchConfig]]] = {w: [] for w in worlds}
    quiet = {"json_path": None, "plot": None, "scaling": False, "world_sizes": (), "report": None, "trace": None}
    for w in worlds:
        for name in names:
            field = BATCH_FIELD[name]
            jobs[w].append(("weak", name, replace(cfg, world_size=w, **quiet)))
            strong = max(1, getattr(cfg, field) * max(worlds) // w)
            jobs[w].append(("strong", name, replace(cfg, world_size=w, **{field: strong}, **quiet)))
    for size in cfg.mlp_sizes:
        jobs.setdefault(cfg.world_size, []).append(
            ("size", "mlp", replace(cfg, mlp_hidden=mlp_hidden_for(size), **quiet)))
    return jobs


def _worker(rank: int, jobs: list[tuple[str, str, BenchConfig]], out: str) -> None:
    import torch

    from ddpkit.runtime.group import init, shutdown

    torch.set_num_threads(1)
    ctx = init()  # the backend spawn() gave these ranks (gloo)
    points = []
    for sweep, name, cfg in jobs:
        say(cfg, f"scaling: {sweep} {name}, world size {ctx.world_size}")
        r = bench_workload(name, cfg)
        points.append(asdict(ScalingPoint(
            sweep=sweep, workload=name, world_size=ctx.world_size, params=r.params,
            batch_per_rank=getattr(cfg, BATCH_FIELD[name]), ddpkit_ms=r.ddpkit_ms, torch_ms=r.torch_ms,
            ratio=r.ratio, ratio_iqr=tuple(r.ratio_iqr), steps=r.steps)))
    if rank == 0:
        Path(out).write_text(json.dumps(points))
    shutdown()


def efficiency(points: list[ScalingPoint], point: ScalingPoint, engine: str) -> float:
    """Throughput relative to linear scaling from the smallest world size of the same sweep and workload."""
    same = [p for p in points if p.sweep == point.sweep and p.workload == point.workload]
    base = min(same, key=lambda p: p.world_size)
    ideal = base.throughput(engine) * point.world_size / base.world_size
    return point.throughput(engine) / ideal


def format_scaling(points: list[ScalingPoint]) -> str:
    """Two tables within :data:`~ddpkit.bench.report.table.WIDTH` columns: the step times, then the throughput."""
    def key(p: ScalingPoint) -> str:
        return f"{p.sweep:<7} {p.workload:<11} {p.world_size:>5} {p.params:>12,}"

    lines = [*note_lines("ddpkit bench --scaling: gloo, 1 thread per rank; step times are medians in ms, "
                         "throughput in samples/s over all ranks, efficiency against linear scaling from the "
                         "sweep's smallest world"),
             f"{'sweep':<7} {'workload':<11} {'world':>5} {'params':>12} {'batch/rank':>10} {'ddpkit ms':>9} "
             f"{'torch ms':>9} {'ratio':>6}"]
    lines += [f"{key(p)} {p.batch_per_rank:>10} {p.ddpkit_ms:>9.2f} {p.torch_ms:>9.2f} "
              f"{p.ratio:>6.3f}" for p in points]
    lines += ["", f"{'sweep':<7} {'workload':<11} {'world':>5} {'params':>12} {'ddpkit/s':>9} {'torch/s':>9} "
                  f"{'eff ddpkit':>10} {'eff torch':>9}"]
    for p in points:
        eff = (f"{efficiency(points, p, 'ddpkit'):>10.0%} {efficiency(points, p, 'torch'):>9.0%}"
               if p.sweep != "size" else f"{'-':>10} {'-':>9}")
        lines.append(f"{key(p)} {p.throughput('ddpkit'):>9.1f} {p.throughput('torch'):>9.1f} {eff}")
    return "\n".join(lines)


def plot_scaling(points: list[ScalingPoint], path: Path) -> list[Path]:
    """Write the world-size plot to ``path`` and the model-size plot beside it; return both paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    sweeps = [s for s in ("weak", "strong") if any(p.sweep == s for p in points)]
    if sweeps:
        fig, axes = plt.subplots(len(sweeps), 2, figsize=(11, 4 * len(sweeps)), squeeze=False)
        for row, sweep in zip(axes, sweeps):
            mine = [p for p in points if p.sweep == sweep]
            for name in dict.fromkeys(p.workload for p in mine):
                line = sorted((p for p in mine if p.workload == name), key=lambda p: p.world_size)
                worlds = [p.world_size for p in line]
                for engine, style in (("ddpkit", "-"), ("torch", "--")):
                    drawn = row[0].plot(worlds, [p.throughput(engine) for p in line], style, marker="o",
                                        label=f"{name} {engine}")
                    row[1].plot(worlds, [efficiency(points, p, engine) for p in line], style, marker="o",
                                color=drawn[0].get_color(), label=f"{name} {engine}")
                base = line[0]
                row[0].plot(worlds, [base.throughput("ddpkit") * w / base.world_size for w in worlds], ":",
                            color="grey", label=f"{name} ideal")
            row[1].axhline(1.0, linestyle=":", color="grey", label="ideal")
            row[0].set_yscale("log")  # workloads differ by orders of magnitude
            row[0].set_title(f"{sweep} scaling: throughput")
            row[0].set_ylabel("samples / s (all ranks)")
            row[1].set_title(f"{sweep} scaling: efficiency")
            row[1].set_ylabel("throughput / ideal")
            for ax in row:
                ax.set_xticks(sorted({p.world_size for p in mine}))
                ax.set_xlabel("world size (processes)")
                ax.grid(True, alpha=0.3)
                ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    sizes = sorted((p for p in points if p.sweep == "size"), key=lambda p: p.params)
    if sizes:
        size_path = path.with_name(f"{path.stem}-sizes{path.suffix}")
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        params = [p.params for p in sizes]
        left.plot(params, [p.ddpkit_ms for p in sizes], "-", marker="o", label="ddpkit")
        left.plot(params, [p.torch_ms for p in sizes], "--", marker="o", label="torch")
        left.set_ylabel("median step (ms)")
        right.errorbar(params, [p.ratio for p in sizes], fmt="o-",
                       yerr=[[p.ratio - p.ratio_iqr[0] for p in sizes], [p.ratio_iqr[1] - p.ratio for p in sizes]])
        right.axhline(1.0, linestyle=":", color="grey")
        right.set_ylabel("ddpkit / torch (median, IQR)")
        for ax in (left, right):
            ax.set_xscale("log")
            ax.set_xlabel("MLP parameters")
            ax.grid(True, alpha=0.3)
        left.legend()
        left.set_title(f"model size, world size {sizes[0].world_size}")
        fig.tight_layout()
        fig.savefig(size_path, dpi=100)
        plt.close(fig)
        written.append(size_path)
    return written


def run_scaling(cfg: BenchConfig) -> list[ScalingPoint]:
    """Measure every sweep in processes of their own per world size; print, plot and (``--json``) save them."""
    from ddpkit.bench.runners.ranks import spawn_ranks

    before = machine()
    points: list[ScalingPoint] = []
    for world, jobs in sorted(plan(cfg).items()):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "points.json")
            spawn_ranks(_worker, world, args=(jobs, out))
            points += [ScalingPoint(**p) for p in json.loads(Path(out).read_text())]
    order = {"weak": 0, "strong": 1, "size": 2}
    points.sort(key=lambda p: (order[p.sweep], p.workload, p.world_size, p.params))
    table = format_scaling(points)
    print(table, flush=True)
    written = plot_scaling(points, cfg.plot or Path("bench-scaling.png"))
    print("plots: " + ", ".join(map(str, written)), flush=True)
    if cfg.json_path is not None:
        settings = plain(cfg)
        data = {
            "settings": settings, "backend": "gloo", "threads_per_rank": 1, "machine_at_start": before,
            "machine_at_end": machine(), "points": [asdict(p) for p in points],
            "efficiency": [{"sweep": p.sweep, "workload": p.workload, "world_size": p.world_size,
                            "ddpkit": efficiency(points, p, "ddpkit"), "torch": efficiency(points, p, "torch")}
                           for p in points if p.sweep != "size"],
        }
        cfg.json_path.write_text(json.dumps(data, indent=2) + "\n")
        if cfg.report is not None:
            from ddpkit.bench.report.summary import write_scaling_report

            print(f"report: {write_scaling_report(cfg, data, table, written)}", flush=True)
    return points


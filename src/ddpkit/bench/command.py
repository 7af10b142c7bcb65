"""``ddpkit bench``: ddpkit's DistributedDataParallel side by side with torch's, and the command's other tables.

The measurement of one workload, its interleaving and the overlap figures are
:mod:`ddpkit.bench.sections.engines`'s; this module runs the command: the workloads in turn (or ``--scaling``,
``--zero``, ``--memory`` instead), the progress lines, the JSON and the report.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ddpkit.bench.bench_config import BenchConfig
from ddpkit.bench.report.console import machine, say
from ddpkit.bench.sections.engines import WorkloadResult, bench_workload, format_results
from ddpkit.runtime.options import plain

__all__ = ["BenchConfig", "run"]


def _worker(rank: int, cfg: BenchConfig, out: str) -> None:
    from ddpkit.runtime.group import init, shutdown

    torch.set_num_threads(1)
    init()  # the backend spawn() gave these ranks (gloo; nccl with --device cuda, which also picks each GPU)
    from ddpkit.bench.sections.dp_vs_ddp import bench_dp_vs_ddp

    results, dp, strategies = [], None, None
    for i, name in enumerate(cfg.workloads, 1):
        say(cfg, f"{name} ({i}/{len(cfg.workloads)}): {cfg.steps} steps per engine"
             + (f", more until the ratio's IQR is within {cfg.target_spread:g} of it" if cfg.target_spread else ""))
        start = time.monotonic()
        if cfg.compile and name in ("dp", "strategies"):
            say(cfg, f"{name} skipped: --compile times the DDP workloads")
            continue
        if name == "dp":
            dp = asdict(bench_dp_vs_ddp(cfg))
            say(cfg, f"dp done in {time.monotonic() - start:.0f} s")
            continue
        if name == "strategies":
            from ddpkit.bench.sections.averaging import bench_averaging

            strategies = [asdict(r) for r in bench_averaging(cfg)]
            say(cfg, f"strategies done in {time.monotonic() - start:.0f} s")
            continue
        result = bench_workload(name, cfg)
        results.append(asdict(result))
        say(cfg, f"{name} done in {time.monotonic() - start:.0f} s: {result.steps} steps per engine, ratio "
             f"{result.ratio:.3f} (IQR {result.ratio_iqr[0]:.3f}-{result.ratio_iqr[1]:.3f})")
    if rank == 0:
        Path(out).write_text(json.dumps({"ddp": results, "dp": dp, "strategies": strategies}))
    shutdown()


def run(cfg: BenchConfig) -> list[WorkloadResult]:
    """Run the benchmarks in ``cfg.world_size`` processes of their own and print the table (``--scaling``: the sweeps
    of :mod:`ddpkit.bench.sections.scaling` instead, returning no rows).

    Returns:
        One :class:`WorkloadResult` per workload (rank 0's timings).

    Raises:
        ddpkit.WorkerError: a rank failed.
    """
    from ddpkit.bench.runners.ranks import spawn_ranks

    if cfg.scaling:
        from ddpkit.bench.sections.scaling import run_scaling

        run_scaling(cfg)
        return []
    if cfg.zero and cfg.zero_cap_mb:
        from ddpkit.bench.sections.capped import format_capped, measure_capped

        capped = measure_capped(cfg)
        table = format_capped(capped)
        print(table, flush=True)
        if cfg.report is not None:
            from ddpkit.bench.report.summary import table_page

            summary = cfg.report / "summary.md"
            summary.write_text(table_page("ddpkit bench --zero --zero-cap-mb", cfg, table))
            print(f"report: {summary}", flush=True)
        if cfg.json_path is not None:
            cfg.json_path.write_text(json.dumps({"settings": plain(cfg), "capped": capped}, indent=2) + "\n")
        return []
    if cfg.zero:
        from ddpkit.bench.sections.zero import format_zero, measure_zero

        found = measure_zero(cfg)
        table = format_zero(found)
        print(table, flush=True)
        if cfg.report is not None:
            from ddpkit.bench.sections.zero import write_zero_report

            print(f"report: {write_zero_report(cfg, found, table)}", flush=True)
        if cfg.json_path is not None:
            cfg.json_path.write_text(json.dumps({"settings": plain(cfg), "zero": found}, indent=2) + "\n")
        return []
    before = machine()
    backend = "gloo"
    if cfg.device == "cuda":
        from ddpkit.runtime.options import ConfigError

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if cfg.world_size > gpus:
            raise ConfigError(f"--device cuda runs one rank per GPU, and --world-size {cfg.world_size} is more than "
                              f"the {gpus} GPU(s) here: use --world-size {max(gpus, 1)}" if gpus else
                              "--device cuda: CUDA is not available here; use --device cpu")
        backend = "nccl"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        spawn_ranks(_worker, cfg.world_size, args=(cfg, out), backend=backend)
        raw = json.loads(Path(out).read_text())
    if cfg.memory:
        from ddpkit.bench.sections.memory import measure_memory

        raw["memory"] = measure_memory(cfg)
    after = machine()
    results = [WorkloadResult(**r) for r in raw["ddp"]]
    if results:
        print(format_results(results, cfg.world_size, cfg.compile_backend if cfg.compile else None, cfg.device),
              flush=True)
    if raw["dp"] is not None:
        from ddpkit.bench.sections.dp_vs_ddp import DPResult, format_dp

        print(format_dp(DPResult(**raw["dp"])), flush=True)
    if raw.get("strategies"):
        from ddpkit.bench.sections.averaging import AveragingResult, format_averaging

        print(format_averaging([AveragingResult(**r) for r in raw["strategies"]], cfg), flush=True)
    if raw.get("memory"):
        from ddpkit.bench.sections.memory import format_memory

        print(format_memory(raw["memory"]), flush=True)
    print(f"load average (1 min) {before['load_average'][0]:.2f} at start, {after['load_average'][0]:.2f} at end, "
          f"{before['cpu_count']} CPUs" if before["load_average"] else "", flush=True)
    if cfg.json_path is not None:
        settings = plain(cfg)
        report = {"settings": settings, "world_size": cfg.world_size, "backend": backend, "threads_per_rank": 1,
                  "machine_at_start": before, "machine_at_end": after, **raw}
        cfg.json_path.write_text(json.dumps(report, indent=2) + "\n")
        if cfg.report is not None:
            from ddpkit.bench.report.summary import write_report

            print(f"report: {write_report(cfg, report)}", flush=True)
    return results

"""The ``strategies`` workload of plain ``ddpkit bench``: ways of averaging on ddpkit's engine side by side (DDP,
DistributedOptimizer, local SGD, PowerSGD). ``ddpkit bench strategies``, the consistency models as whole training
runs, is :mod:`ddpkit.bench.sections.strategies`.

For each of ``--strategy-workloads`` every rank trains four copies of one
model on the same data:

* ``ddp``: :class:`ddpkit.DistributedDataParallel`, gradients averaged every step;
* ``optimizer``: :func:`ddpkit.DistributedOptimizer` (Horovod's way), the same averages;
* ``local-sgd``: :class:`ddpkit.LocalSGD` with ``--local-sgd-period`` H, no
  warm-up: local steps, parameters averaged every H steps;
* ``powersgd``: DDP with :func:`ddpkit.hooks.powersgd_hook` at rank
  ``--powersgd-rank`` (compressing from the third step, so during all timed steps);
* ``ft``, ``ft:4n``: :class:`ddpkit.FaultTolerance` (the engine of ``--on-failure
  continue``, here on the job's group: what the mode costs when nothing fails),
  all-reduced, at ``V`` = the world size and at 4 virtual shards per rank (the
  setting for spares); ``ft-det``, ``ft-det:4n``: the same with
  ``deterministic=True`` (the shards added along a fixed tree).

Rounds interleave the strategies (the first of a round rotates), each timed
over a block of H steps (one averaging period, so local SGD's step time
includes its share of an averaging). Reported: the median time per step,
its quartiles, the ratio to DDP (median of per-round ratios), and the bytes
handed to collectives per step and rank (all-reduce and broadcast payloads,
counted during the timed blocks: what a rank sends in a ring is about twice
that).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit.bench.bench_config import BenchConfig
from ddpkit.bench.report.stats import quartiles
from ddpkit.bench.report.table import note_lines
from ddpkit.bench.workloads import sync_device, workload
from ddpkit.comm.powersgd import PowerSGDState, powersgd_hook
from ddpkit.parallel.ddp.wrapper import DistributedDataParallel
from ddpkit.parallel.horovod_optimizer import DistributedOptimizer
from ddpkit.parallel.local_sgd import LocalSGD
from ddpkit.runtime.events import ByteCounter
from ddpkit.runtime.group import barrier
from ddpkit.parallel.fault_tolerance.steps import FaultTolerance

__all__ = ["METHODS", "AveragingResult", "bench_averaging", "format_averaging"]

METHODS = ("ddp", "optimizer", "local-sgd", "powersgd", "ft", "ft:4n", "ft-det", "ft-det:4n")


@dataclass(kw_only=True)
class AveragingResult:
    """One strategy on one workload: ms per step (median and quartiles over blocks), its ratio to DDP, bytes."""

    workload: str
    strategy: str
    ms: float
    iqr_ms: tuple[float, float]
    ratio_to_ddp: float
    ratio_iqr: tuple[float, float]
    bytes_per_step: float
    blocks: int
    steps_per_block: int


def _tolerant(base: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, shards_per_rank: int,
              deterministic: bool) -> Callable[[], None]:
    """A step of :class:`FaultTolerance` on a copy of ``base``: every rank's step trains this rank's batch's
    worth of samples (the global batch is ``x`` on every rank), in ``shards_per_rank`` shards per rank."""
    world = dist.get_world_size()
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data_x, data_y = x.repeat(world, *[1] * (x.dim() - 1)), y.repeat(world)
    ft = FaultTolerance(model, opt, TensorDataset(data_x, data_y), batch_size=len(data_x),
                        virtual_shards=world * shards_per_rank, deterministic=deterministic, shuffle=False,
                        fetch=lambda idx: (data_x[idx], data_y[idx]))
    it = ft.steps(max_steps=steps)

    def step() -> None:
        s = next(it)
        for xb, yb in s:
            nn.functional.cross_entropy(model(xb), yb).backward()
        if s.sync():
            opt.step()
        opt.zero_grad()

    return step


def _steppers(base: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: BenchConfig,
              steps: int) -> dict[str, Callable[[], None]]:
    def sgd(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def loop(model: nn.Module, opt: torch.optim.Optimizer,
             after: Callable[[], Any] = lambda: None) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            after()

        return step

    ddp = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cfg.bucket_cap_mb)
    plain = copy.deepcopy(base)
    hvd = DistributedOptimizer(sgd(plain), named_parameters=plain.named_parameters(), bucket_cap_mb=cfg.bucket_cap_mb)
    local_model = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cfg.bucket_cap_mb)
    local = LocalSGD(local_model, period=cfg.local_sgd_period)
    compressed = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cfg.bucket_cap_mb)
    compressed.register_comm_hook(
        PowerSGDState(None, matrix_approximation_rank=cfg.powersgd_rank, start_powerSGD_iter=2), powersgd_hook
    )
    return {"ddp": loop(ddp, sgd(ddp)), "optimizer": loop(plain, hvd),
            "local-sgd": loop(local_model, sgd(local_model), local.step),
            "powersgd": loop(compressed, sgd(compressed)),
            **{name: _tolerant(base, x, y, steps, per_rank, det)
               for name, per_rank, det in (("ft", 1, False), ("ft:4n", 4, False), ("ft-det", 1, True),
                                           ("ft-det:4n", 4, True))}}


def _bench_one(name: str, cfg: BenchConfig) -> list[AveragingResult]:
    base, x, y = workload(name, cfg)
    block = cfg.local_sgd_period
    rounds, warmup = max(1, -(-cfg.steps // block)), max(cfg.warmup, 2)  # PowerSGD compresses from its third step
    steps = _steppers(base, x, y, cfg, warmup + rounds * block)
    for _ in range(warmup):
        for step in steps.values():
            step()
    counter = ByteCounter()
    times: dict[str, list[float]] = {s: [] for s in steps}
    sent: dict[str, int] = dict.fromkeys(steps, 0)
    for r in range(rounds):
        order = METHODS[r % len(METHODS):] + METHODS[: r % len(METHODS)]
        for strategy in order:
            barrier()
            before = counter.total
            with counter.counting():
                sync_device(x)
                start = time.perf_counter()
                for _ in range(block):
                    steps[strategy]()
                sync_device(x)  # on CUDA, the block's queued work done
                took = time.perf_counter() - start
            times[strategy].append(took / block)
            sent[strategy] += counter.total - before
    out = []
    for strategy in METHODS:
        ratios = [a / b for a, b in zip(times[strategy], times["ddp"])]
        out.append(AveragingResult(
            workload=name, strategy=strategy, ms=1000 * statistics.median(times[strategy]),
            iqr_ms=quartiles(times[strategy], 1000.0), ratio_to_ddp=statistics.median(ratios),
            ratio_iqr=quartiles(ratios), bytes_per_step=sent[strategy] / (rounds * block), blocks=rounds,
            steps_per_block=block,
        ))
    return out


def bench_averaging(cfg: BenchConfig) -> list[AveragingResult]:
    """Every rank calls it; rank 0's timings are returned on every rank."""
    results = [r for name in cfg.strategy_workloads for r in _bench_one(name, cfg)]
    box = [results]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def format_averaging(rows: list[AveragingResult], cfg: BenchConfig) -> str:
    lines = [
        *note_lines(f"strategies on ddpkit's engine, world size {cfg.world_size}: local SGD averages every "
                    f"{cfg.local_sgd_period} steps, PowerSGD at rank {cfg.powersgd_rank}; ft: FaultTolerance "
                    "(the fault-tolerant mode's engine, nothing failing) at V = the world size and at 4 shards per "
                    "rank, all-reduced and deterministic (-det)"),
        f"{'workload':<11} {'strategy':<10} {'ms/step':>8} {'IQR':>13} {'/ DDP':>6} {'ratio IQR':>11} "
        f"{'MB sent/step':>12} {'/ DDP':>6}",
    ]
    ddp_bytes = {r.workload: r.bytes_per_step for r in rows if r.strategy == "ddp"}
    for r in rows:
        share = r.bytes_per_step / ddp_bytes[r.workload] if ddp_bytes.get(r.workload) else float("nan")
        lines.append(
            f"{r.workload:<11} {r.strategy:<10} {r.ms:>8.2f} {r.iqr_ms[0]:>6.2f}-{r.iqr_ms[1]:<6.2f} "
            f"{r.ratio_to_ddp:>6.3f} {r.ratio_iqr[0]:>5.3f}-{r.ratio_iqr[1]:<5.3f} {r.bytes_per_step / 1e6:>12.3f} "
            f"{share:>6.3f}"
        )
    lines += note_lines(
        "ms/step: median over blocks of one averaging period (so local SGD's includes its averaging); / DDP: median "
        "of per-round ratios to ddpkit's DDP; MB sent/step: payload handed to collectives per rank"
    )
    return "\n".join(lines)

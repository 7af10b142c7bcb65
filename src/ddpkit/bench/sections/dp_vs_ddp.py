"""DataParallel against DistributedDataParallel at the same number of replicas: what the seeds say in words.

Both train the tutorial's ConvNet on the same global batch, ``samples_per_rank``
images per replica: DDP with one process per replica (gloo, one thread
each; NCCL and one GPU each with ``--device cuda``), DataParallel in rank 0's
process with one replica per rank, in threads, on the CPU or on the ranks'
GPUs (the other ranks wait meanwhile, so each engine has the machine to
itself). Rounds alternate which engine goes first; the ratio DP / DDP is the
median over rounds, with its interquartile range. DDP takes ``--bucket-cap-mb``;
``--steps`` and ``--warmup`` count rounds (``--block``, ``--target-spread`` and
``--trace`` are the engine table's).
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddpkit.bench.bench_config import BenchConfig
from ddpkit.bench.workloads import bench_device, stepper
from ddpkit.models import ConvNet
from ddpkit.parallel.ddp.wrapper import DistributedDataParallel
from ddpkit.parallel.dp import DataParallel
from ddpkit.runtime.group import barrier

__all__ = ["DPResult", "bench_dp_vs_ddp", "format_dp"]


@dataclass(kw_only=True)
class DPResult:
    """Median step times in milliseconds and the per-round ratio DP / DDP."""

    replicas: int
    global_batch: int
    dp_ms: float
    ddp_ms: float
    ratio: float
    ratio_q1: float
    ratio_q3: float
    rounds: int


def bench_dp_vs_ddp(cfg: BenchConfig) -> DPResult:
    """Every rank calls it; rank 0's figures are returned on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(cfg.samples_per_rank * world, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (len(x),), generator=g)
    torch.manual_seed(0)
    base = ConvNet()
    device = bench_device(cfg)
    ddp = stepper(DistributedDataParallel(copy.deepcopy(base).to(device), bucket_cap_mb=cfg.bucket_cap_mb),
                  x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device))
    dp = None
    if rank == 0:
        # One replica per rank: CPU replicas in threads, or on CUDA the ranks' GPUs, driven from the first.
        devices = ["cpu"] * world if device.type == "cpu" else list(range(world))
        first = torch.device("cpu") if device.type == "cpu" else torch.device("cuda", 0)
        dp = stepper(DataParallel(copy.deepcopy(base).to(first), device_ids=devices), x.to(first), y.to(first))
    times: dict[str, list[float]] = {"dp": [], "ddp": []}
    rounds = cfg.warmup + cfg.steps
    for r in range(rounds):
        for engine in ("dp", "ddp") if r % 2 == 0 else ("ddp", "dp"):
            barrier()
            if engine == "ddp":
                took = ddp()
            elif dp is not None:
                took = dp()
            else:
                continue
            if r >= cfg.warmup and rank == 0:
                times[engine].append(took)
    barrier()
    result = None
    if rank == 0:
        ratios = [a / b for a, b in zip(times["dp"], times["ddp"])]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        result = DPResult(
            replicas=world, global_batch=len(x), dp_ms=1000 * statistics.median(times["dp"]),
            ddp_ms=1000 * statistics.median(times["ddp"]), ratio=statistics.median(ratios),
            ratio_q1=q[0], ratio_q3=q[2], rounds=len(ratios),
        )
    box = [result]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def format_dp(r: DPResult) -> str:
    return (
        f"DataParallel vs DDP, ConvNet, {r.replicas} replicas, global batch {r.global_batch}: "
        f"DP {r.dp_ms:.2f} ms, DDP {r.ddp_ms:.2f} ms per step; DP / DDP {r.ratio:.2f} "
        f"(IQR {r.ratio_q1:.2f}-{r.ratio_q3:.2f}, {r.rounds} rounds)"
    )

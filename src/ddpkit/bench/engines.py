"""``ddpkit bench``: ddpkit's DistributedDataParallel side by side with torch's.

For each workload, every rank runs the same SGD training steps (zero_grad,
forward, loss, backward, step) on two copies of one model, one wrapped in
ddpkit's DDP and one in torch's, alternating blocks of steps between the two
engines (the first engine of a block alternates too) so that drift in the
machine's speed hits both alike. Each step is timed on rank 0; the report is
the median step time of each engine and the ratio ddpkit / torch, taken as the
median over pairs of steps run back to back (one of each engine), which
cancels most of the drift a shared machine adds.

Overlap: how much of the gradient all-reduce is hidden behind backward.

* ``compute``: median step of the plain module, no communication at all;
* ``comm``: median time to all-reduce the gradients alone (ddpkit's buckets,
  launched back to back, then waited for);
* ``hidden`` = ``(compute + comm - step) / comm``, clipped to [0, 1]: the part
  of the communication that did not add to the step time;
* ``exposed`` (ddpkit only, measured directly): how long the end of
  backward stayed blocked on communication (the bench times the reducer's
  wait for its buckets from outside; the engine keeps no such figure). A rank
  that finishes backward early also waits for the slower one, so each step
  counts the wait of the rank that arrived last (the minimum over ranks),
  which is communication alone; then the median over steps. ``direct`` =
  ``1 - exposed / comm``. On a shared machine the estimate above is the
  noisier of the two: it subtracts medians taken at different moments and
  charges rank skew to communication.

Workloads:

* ``convnet``: the tutorial's MNIST ConvNet (:class:`ddpkit.train.models.ConvNet`),
  ``samples_per_rank`` 28x28 images per rank and step; compute-bound;
* ``mlp``: :class:`ddpkit.train.models.MLP` with ``mlp_hidden`` 4640 (about 25 M
  parameters, 100 MB of float32 gradients) on ``mlp_batch`` images per rank;
  communication-bound;
* ``transformer``: a 6-layer ``nn.TransformerEncoder`` (d_model 256, 8 heads,
  feed-forward 1024, no dropout) and a linear head over the mean token, on 8
  sequences of 32 tokens per rank (74 parameters, 4.7 M);
* ``linear200``: 200 ``Linear(16, 16)`` layers with tanh between them, on
  ``mlp_batch`` rows per rank: 400 tiny parameters, so the step is dominated
  by what the engine does per parameter.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.bench.config import BenchConfig


@dataclass(kw_only=True)
class WorkloadResult:
    """The figures of one workload (times in milliseconds, medians over steps)."""

    workload: str
    params: int
    ddpkit_ms: float
    torch_ms: float
    ratio: float
    compute_ms: float
    comm_ms: float
    hidden_ddpkit: float
    hidden_torch: float
    exposed_ddpkit_ms: float
    hidden_ddpkit_direct: float
    buckets: int


class _Encoder(nn.Module):
    """The ``transformer`` workload: encoder layers, mean over tokens, a 10-way head."""

    def __init__(self, d_model: int = 256, layers: int = 6) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead=8, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


def _linear200() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(200):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers)


def _workload(name: str, cfg: BenchConfig) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    from ddpkit.train.models import MLP, ConvNet

    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    batch = {"convnet": cfg.samples_per_rank, "transformer": 8}.get(name, cfg.mlp_batch)
    shape = {"transformer": (batch, 32, 256), "linear200": (batch, 16)}.get(name, (batch, 1, 28, 28))
    x = torch.randn(*shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    torch.manual_seed(0)
    models = {"convnet": ConvNet, "mlp": lambda: MLP(hidden=cfg.mlp_hidden), "transformer": _Encoder,
              "linear200": _linear200}
    return models[name](), x, y


def _stepper(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        return time.perf_counter() - start

    return step


def _comm_only(buffers: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    works = [dist.all_reduce(b, async_op=True) for b in buffers]
    for w in works:
        w.wait()
    return time.perf_counter() - start


def _time_waits(reducer: Any) -> list[float]:
    """Record how long each end of backward waits for communication; returns the growing list."""
    waits: list[float] = [0.0]
    wait_all = reducer._wait_all

    def timed() -> None:
        start = time.perf_counter()
        wait_all()
        waits.append(time.perf_counter() - start)

    reducer._wait_all = timed  # this instance only, for this benchmark
    return waits


def _median_ms(xs: list[float]) -> float:
    return 1000.0 * statistics.median(xs)


def _bench_workload(name: str, cfg: BenchConfig) -> WorkloadResult:
    from ddpkit._reference import torch_ddp
    from ddpkit.parallel.ddp import DistributedDataParallel

    base, x, y = _workload(name, cfg)
    ours = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cfg.bucket_cap_mb)
    theirs = torch_ddp(copy.deepcopy(base), bucket_cap_mb=cfg.bucket_cap_mb)
    plain = copy.deepcopy(base)
    steps = {"ddpkit": _stepper(ours, x, y), "torch": _stepper(theirs, x, y), "compute": _stepper(plain, x, y)}
    for _ in range(cfg.warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    exposed: list[float] = []
    waits = _time_waits(ours.reducer)
    buffers = [torch.zeros_like(b.flat) for b in ours.reducer.buckets]
    comm: list[float] = []
    rounds = -(-cfg.steps // cfg.block)
    for r in range(rounds):
        order = ["ddpkit", "torch"] if r % 2 == 0 else ["torch", "ddpkit"]
        for engine in order + ["compute"]:
            dist.barrier()
            for _ in range(cfg.block):
                times[engine].append(steps[engine]())
                if engine == "ddpkit":
                    exposed.append(waits[-1])
        dist.barrier()
        for _ in range(cfg.block):
            comm.append(_comm_only(buffers))
    waits = [torch.zeros(len(exposed), dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(waits, torch.tensor(exposed, dtype=torch.float64))
    exposed = torch.stack(waits).min(dim=0).values.tolist()
    compute, comm_ms = _median_ms(times["compute"]), _median_ms(comm)
    ddpkit_ms, torch_ms = _median_ms(times["ddpkit"]), _median_ms(times["torch"])

    def hidden(step_ms: float) -> float:
        return min(1.0, max(0.0, (compute + comm_ms - step_ms) / comm_ms))

    return WorkloadResult(
        workload=name, params=sum(p.numel() for p in base.parameters()),
        ddpkit_ms=ddpkit_ms, torch_ms=torch_ms,
        ratio=statistics.median(a / b for a, b in zip(times["ddpkit"], times["torch"])),
        compute_ms=compute, comm_ms=comm_ms, hidden_ddpkit=hidden(ddpkit_ms), hidden_torch=hidden(torch_ms),
        exposed_ddpkit_ms=_median_ms(exposed),
        hidden_ddpkit_direct=min(1.0, max(0.0, 1.0 - _median_ms(exposed) / comm_ms)), buckets=len(ours.reducer.buckets),
    )


def _worker(rank: int, cfg: BenchConfig, out: str) -> None:
    from ddpkit.runtime.group import init, shutdown

    torch.set_num_threads(1)
    init(backend="gloo")
    from ddpkit.bench.dp import bench_dp_vs_ddp

    results = [asdict(_bench_workload(name, cfg)) for name in cfg.workloads if name != "dp"]
    dp = asdict(bench_dp_vs_ddp(cfg)) if "dp" in cfg.workloads else None
    if rank == 0:
        Path(out).write_text(json.dumps({"ddp": results, "dp": dp}))
    shutdown()


def format_results(results: list[WorkloadResult], world_size: int) -> str:
    """A plain-text table of the results."""
    lines = [
        f"ddpkit bench: world size {world_size}, gloo, 1 thread per rank; median step times in ms",
        f"{'workload':<11} {'params':>10} {'ddpkit':>9} {'torch':>9} {'ratio':>6}   "
        f"{'compute':>8} {'comm':>8} {'hidden ddpkit/torch':>20} {'exposed':>8} {'direct':>7}",
    ]
    for r in results:
        lines.append(
            f"{r.workload:<11} {r.params:>10,} {r.ddpkit_ms:>9.2f} {r.torch_ms:>9.2f} {r.ratio:>6.3f}   "
            f"{r.compute_ms:>8.2f} {r.comm_ms:>8.2f} {r.hidden_ddpkit:>10.0%} /{r.hidden_torch:>7.0%} "
            f"{r.exposed_ddpkit_ms:>8.2f} {r.hidden_ddpkit_direct:>7.0%}"
        )
    lines.append(
        "ratio = median over back-to-back step pairs of ddpkit / torch (lower is better); compute = step without communication; comm = "
        "all-reduce of the gradients alone; hidden = (compute + comm - step) / comm; exposed = "
        "ddpkit's median wait for communication at the end of backward; direct = 1 - exposed / comm"
    )
    return "\n".join(lines)


def run(cfg: BenchConfig) -> list[WorkloadResult]:
    """Run the benchmarks in ``cfg.world_size`` fresh processes and print the table.

    Returns:
        One :class:`WorkloadResult` per workload (rank 0's timings).

    Raises:
        ddpkit.WorkerError: a rank failed.
    """
    from ddpkit.runtime.spawn import spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        spawn(_worker, cfg.world_size, args=(cfg, out), backend="gloo")
        raw = json.loads(Path(out).read_text())
    results = [WorkloadResult(**r) for r in raw["ddp"]]
    if results:
        print(format_results(results, cfg.world_size), flush=True)
    if raw["dp"] is not None:
        from ddpkit.bench.dp import DPResult, format_dp

        print(format_dp(DPResult(**raw["dp"])), flush=True)
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(raw, indent=2) + "\n")
    return results

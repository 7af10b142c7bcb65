"""``ddpkit bench``: ddpkit's DistributedDataParallel side by side with torch's.

For each workload, every rank runs the same SGD training steps (zero_grad,
forward, loss, backward, step) on two copies of one model, one wrapped in
ddpkit's DDP and one in torch's, alternating blocks of steps between the two
engines (the first engine of a block alternates too) so that drift in the
machine's speed hits both alike. Each step is timed on rank 0; the report is
the median step time of each engine and the ratio ddpkit / torch, taken as the
median over pairs of steps run back to back (one of each engine), which
cancels most of the drift a shared machine adds; each with its quartiles
(IQR) and the number of steps. The ratio can fall on the other side of 1
than the two medians suggest when the pairs disagree; the IQR then shows it.
``--target-spread F`` keeps adding rounds until the ratio's IQR is at most
``F`` times its median, or ``--time-budget`` seconds have passed.

Progress goes to stderr: a bar on a terminal, one line per workload
otherwise. ``--json`` (checked writable before anything runs) holds the
results, the settings, the torch/ddpkit/Python versions, the CPU count and
the load average at start and end, so two runs can be compared by a script.

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
* ``resnet``: :class:`ddpkit.train.models.ResNet` (ResNet-8, BatchNorm after every
  convolution, 16/32/64 channels) on ``resnet_batch`` 28x28 images per rank: both
  engines broadcast its BatchNorm buffers from rank 0 before every forward;
* ``transformer``: a 6-layer ``nn.TransformerEncoder`` (d_model 256, 8 heads,
  feed-forward 1024, no dropout) and a linear head over the mean token, on
  ``transformer_batch`` (8) sequences of 32 tokens per rank (74 parameters, 4.7 M);
* ``linear200``: 200 ``Linear(16, 16)`` layers with tanh between them, on
  ``mlp_batch`` rows per rank: 400 tiny parameters, so the step is dominated
  by what the engine does per parameter.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
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
from ddpkit.runtime.options import plain

BATCH_FIELD = {"convnet": "samples_per_rank", "mlp": "mlp_batch", "linear200": "mlp_batch",
               "transformer": "transformer_batch", "resnet": "resnet_batch"}
"""The setting that holds each workload's batch per rank."""


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
    steps: int = 0
    """Timed steps per engine (rounds x block; more than ``--steps`` with ``--target-spread``)."""
    ddpkit_iqr_ms: tuple[float, float] = (0.0, 0.0)
    torch_iqr_ms: tuple[float, float] = (0.0, 0.0)
    ratio_iqr: tuple[float, float] = (0.0, 0.0)
    """Quartiles (25 %, 75 %) of the step times and of the per-pair ratios."""
    ratio_ci: tuple[float, float] = (0.0, 0.0)
    """95 % confidence interval of the median ratio (:func:`median_ci`): where the ratio itself lies, not the pairs."""
    overlap_ddpkit: float | None = None
    overlap_torch: float | None = None
    """Share of all-reduce time that ran while gradients were still being computed, from the traced steps'
    spans (:mod:`ddpkit.bench.trace`); None without communication (world size 1)."""


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
    from ddpkit.train.models import MLP, ConvNet, ResNet

    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    batch = getattr(cfg, BATCH_FIELD[name])
    shape = {"transformer": (batch, 32, 256), "linear200": (batch, 16)}.get(name, (batch, 1, 28, 28))
    x = torch.randn(*shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    torch.manual_seed(0)
    models = {"convnet": ConvNet, "mlp": lambda: MLP(hidden=cfg.mlp_hidden), "transformer": _Encoder,
              "linear200": _linear200, "resnet": ResNet}
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


def quartiles(xs: list[float], scale: float = 1.0) -> tuple[float, float]:
    """The 25 % and 75 % quartiles of ``xs`` (both the value itself for one sample), times ``scale``."""
    if len(xs) < 2:
        return (scale * xs[0], scale * xs[0]) if xs else (0.0, 0.0)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return scale * q1, scale * q3


def median_ci(xs: list[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free confidence interval of the median of ``xs`` (95 % for ``z=1.96``).

    Order statistics: the count of samples below the true median is
    Binomial(n, 1/2), so the interval runs from the ``n/2 - z*sqrt(n)/2``-th
    to the ``n/2 + z*sqrt(n)/2``-th smallest sample (normal approximation,
    rounded outwards). It assumes nothing about the ratios' distribution, only
    that the pairs are independent. With 10 samples or fewer it is the
    whole range.
    """
    if not xs:
        return (0.0, 0.0)
    ordered = sorted(xs)
    n = len(ordered)
    half = z * n**0.5 / 2
    lo = max(0, int(n / 2 - half) - 1)
    hi = min(n - 1, -int(-(n / 2 + half)))  # ceil, as an index from 0 that counts 1 past the rank
    return ordered[lo], ordered[hi]


def verdict(ci: tuple[float, float]) -> str:
    """``faster`` or ``slower`` when the ratio's confidence interval lies on one side of 1, else ``level``."""
    if ci[1] < 1.0:
        return "faster"
    if ci[0] > 1.0:
        return "slower"
    return "level"


def relative_spread(xs: list[float]) -> float:
    """IQR / median: how tight a set of ratios is (0 for fewer than two)."""
    if len(xs) < 2:
        return 0.0
    q1, q3 = quartiles(xs)
    return (q3 - q1) / statistics.median(xs)


def _progress_bar(name: str, cfg: BenchConfig) -> Any:
    """Rank 0's bar over the timed steps, on a terminal only (a redirected log gets the per-workload lines)."""
    from tqdm import tqdm

    shown = cfg.progress and dist.get_rank() == 0 and sys.stderr.isatty()
    return tqdm(total=cfg.steps, desc=name, unit="step", leave=False, disable=not shown, file=sys.stderr)


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
    started = time.monotonic()
    bar = _progress_bar(name, cfg)
    r = 0
    while r < rounds or _more_rounds(times, cfg, started):
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
        bar.update(cfg.block)
        r += 1
    bar.close()
    overlaps = _traced_steps(name, cfg, ours, theirs, x, y)
    waits = [torch.zeros(len(exposed), dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(waits, torch.tensor(exposed, dtype=torch.float64))
    exposed = torch.stack(waits).min(dim=0).values.tolist()
    compute, comm_ms = _median_ms(times["compute"]), _median_ms(comm)
    ddpkit_ms, torch_ms = _median_ms(times["ddpkit"]), _median_ms(times["torch"])

    def hidden(step_ms: float) -> float:
        return min(1.0, max(0.0, (compute + comm_ms - step_ms) / comm_ms))

    ratios = _pair_ratios(times)
    return WorkloadResult(
        workload=name, params=sum(p.numel() for p in base.parameters()),
        ddpkit_ms=ddpkit_ms, torch_ms=torch_ms, steps=len(times["ddpkit"]),
        ddpkit_iqr_ms=quartiles(times["ddpkit"], 1000.0), torch_iqr_ms=quartiles(times["torch"], 1000.0),
        ratio=statistics.median(ratios), ratio_iqr=quartiles(ratios), ratio_ci=median_ci(ratios),
        overlap_ddpkit=overlaps[0],
        overlap_torch=overlaps[1],
        compute_ms=compute, comm_ms=comm_ms, hidden_ddpkit=hidden(ddpkit_ms), hidden_torch=hidden(torch_ms),
        exposed_ddpkit_ms=_median_ms(exposed),
        hidden_ddpkit_direct=min(1.0, max(0.0, 1.0 - _median_ms(exposed) / comm_ms)), buckets=len(ours.reducer.buckets),
    )


TRACED_STEPS = 10
"""Steps per engine traced after the timed ones (tracing perturbs the steps it records)."""


def _traced_steps(name: str, cfg: BenchConfig, ours: nn.Module, theirs: nn.Module, x: torch.Tensor,
                  y: torch.Tensor) -> tuple[float | None, float | None]:
    """Trace a few more steps of each engine: their overlap, and (``--trace``) their spans on file."""
    from ddpkit.bench import trace

    rank = dist.get_rank()
    recorders = [trace.instrument(ours, "ddpkit", rank), trace.instrument(theirs, "torch", rank)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (ours, theirs)]
    for _ in range(min(cfg.steps, TRACED_STEPS)):
        for recorder, model, opt in zip(recorders, (ours, theirs), optimizers):
            dist.barrier()
            recorder.step(model, opt, x, y)
    if cfg.trace is not None:
        path = cfg.trace.with_name(f"{cfg.trace.stem}-{name}{cfg.trace.suffix}") if len(cfg.workloads) > 1 \
            else cfg.trace
        trace.write(path, recorders)
    return trace.median_overlap(recorders[0]), trace.median_overlap(recorders[1])


def _pair_ratios(times: dict[str, list[float]]) -> list[float]:
    """ddpkit / torch for each pair of steps run back to back (one of each engine)."""
    return [a / b for a, b in zip(times["ddpkit"], times["torch"])]


def _more_rounds(times: dict[str, list[float]], cfg: BenchConfig, started: float) -> bool:
    """``--target-spread``: whether to add a round (rank 0 decides, every rank follows)."""
    if not cfg.target_spread:
        return False
    go = torch.tensor([0])
    if dist.get_rank() == 0:
        loose = relative_spread(_pair_ratios(times)) > cfg.target_spread
        go[0] = int(loose and time.monotonic() - started < cfg.time_budget)
    dist.broadcast(go, src=0)
    return bool(go.item())


def _say(cfg: BenchConfig, message: str) -> None:
    if cfg.progress and dist.get_rank() == 0:
        print(f"ddpkit bench: {message}", file=sys.stderr, flush=True)


def _worker(rank: int, cfg: BenchConfig, out: str) -> None:
    from ddpkit.runtime.group import init, shutdown

    torch.set_num_threads(1)
    init(backend="gloo")
    from ddpkit.bench.dp import bench_dp_vs_ddp

    results, dp, strategies = [], None, None
    for i, name in enumerate(cfg.workloads, 1):
        _say(cfg, f"{name} ({i}/{len(cfg.workloads)}): {cfg.steps} steps per engine"
             + (f", more until the ratio's IQR is within {cfg.target_spread:g} of it" if cfg.target_spread else ""))
        start = time.monotonic()
        if name == "dp":
            dp = asdict(bench_dp_vs_ddp(cfg))
            _say(cfg, f"dp done in {time.monotonic() - start:.0f} s")
            continue
        if name == "strategies":
            from ddpkit.bench.strategies import bench_strategies

            strategies = [asdict(r) for r in bench_strategies(cfg)]
            _say(cfg, f"strategies done in {time.monotonic() - start:.0f} s")
            continue
        result = _bench_workload(name, cfg)
        results.append(asdict(result))
        _say(cfg, f"{name} done in {time.monotonic() - start:.0f} s: {result.steps} steps per engine, ratio "
             f"{result.ratio:.3f} (IQR {result.ratio_iqr[0]:.3f}-{result.ratio_iqr[1]:.3f})")
    if rank == 0:
        Path(out).write_text(json.dumps({"ddp": results, "dp": dp, "strategies": strategies}))
    shutdown()


def format_results(results: list[WorkloadResult], world_size: int) -> str:
    """A plain-text table of the results, its columns as the README defines them."""
    lines = [
        f"ddpkit bench: world size {world_size}, gloo, 1 thread per rank; median step times in ms",
        f"{'workload':<11} {'params':>10} {'steps':>5} {'ddpkit ms':>9} {'torch ms':>9} {'ratio':>6} {'ratio IQR':>11} "
        f"{'95% CI':>11} {'ddpkit is':>9}  "
        f"{'compute ms':>10} {'comm alone ms':>13} {'exposed ms':>10} {'hidden direct':>13} "
        f"{'overlap ddpkit/torch':>20}",
    ]

    def share(x: float | None) -> str:
        return "-" if x is None else f"{x:.0%}"

    for r in results:
        lines.append(
            f"{r.workload:<11} {r.params:>10,} {r.steps:>5} {r.ddpkit_ms:>9.2f} {r.torch_ms:>9.2f} {r.ratio:>6.3f} "
            f"{r.ratio_iqr[0]:>5.3f}-{r.ratio_iqr[1]:<5.3f} {r.ratio_ci[0]:>5.3f}-{r.ratio_ci[1]:<5.3f} "
            f"{verdict(r.ratio_ci):>9}  {r.compute_ms:>10.2f} {r.comm_ms:>13.2f} "
            f"{r.exposed_ddpkit_ms:>10.2f} {r.hidden_ddpkit_direct:>13.0%} "
            f"{share(r.overlap_ddpkit):>11} /{share(r.overlap_torch):>7}"
        )
    lines.append(
        "ratio = median over back-to-back step pairs of ddpkit / torch, with its quartiles (lower is better; it can "
        "sit on the other side of 1 than the two medians when the pairs disagree, which the IQR shows); 95% CI = "
        "confidence interval of that median (order statistics; more --steps narrow it), and ddpkit is faster or "
        "slower when it lies on one side of 1, else level; compute = "
        "step without communication; comm alone = all-reduce of the gradients with nothing else running; exposed = "
        "ddpkit's median wait for communication at the end of backward; hidden direct = 1 - exposed / comm alone; "
        f"overlap = share of all-reduce time that ran while gradients were still being computed, from the spans of "
        f"{TRACED_STEPS} traced steps per engine (see --trace)"
    )
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """What a later run needs to compare with this one: versions, CPUs, and the load now."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("ddpkit")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        ours = "0+unknown"
    return {"torch": torch.__version__, "ddpkit": ours, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def run(cfg: BenchConfig) -> list[WorkloadResult]:
    """Run the benchmarks in ``cfg.world_size`` fresh processes and print the table (``--scaling``: the sweeps
    of :mod:`ddpkit.bench.scaling` instead, returning no rows).

    Returns:
        One :class:`WorkloadResult` per workload (rank 0's timings).

    Raises:
        ddpkit.WorkerError: a rank failed.
    """
    from ddpkit.runtime.spawn import spawn

    if cfg.scaling:
        from ddpkit.bench.scaling import run_scaling

        run_scaling(cfg)
        return []
    before = machine()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        spawn(_worker, cfg.world_size, args=(cfg, out), backend="gloo")
        raw = json.loads(Path(out).read_text())
    if cfg.memory:
        from ddpkit.bench.memory import measure_memory

        raw["memory"] = measure_memory(cfg)
    after = machine()
    results = [WorkloadResult(**r) for r in raw["ddp"]]
    if results:
        print(format_results(results, cfg.world_size), flush=True)
    if raw["dp"] is not None:
        from ddpkit.bench.dp import DPResult, format_dp

        print(format_dp(DPResult(**raw["dp"])), flush=True)
    if raw.get("strategies"):
        from ddpkit.bench.strategies import StrategyResult, format_strategies

        print(format_strategies([StrategyResult(**r) for r in raw["strategies"]], cfg), flush=True)
    if raw.get("memory"):
        from ddpkit.bench.memory import format_memory

        print(format_memory(raw["memory"]), flush=True)
    print(f"load average (1 min) {before['load_average'][0]:.2f} at start, {after['load_average'][0]:.2f} at end, "
          f"{before['cpu_count']} CPUs" if before["load_average"] else "", flush=True)
    if cfg.json_path is not None:
        settings = plain(cfg)
        report = {"settings": settings, "world_size": cfg.world_size, "backend": "gloo", "threads_per_rank": 1,
                  "machine_at_start": before, "machine_at_end": after, **raw}
        cfg.json_path.write_text(json.dumps(report, indent=2) + "\n")
        if cfg.report is not None:
            from ddpkit.bench.report import write_report

            print(f"report: {write_report(cfg, report)}", flush=True)
    return results

"""One workload timed on both engines: ddpkit's DistributedDataParallel and torch's, interleaved.


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

The workloads are :mod:`ddpkit.bench.workloads`; the command's entry is
:mod:`ddpkit.bench.command`.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.bench.bench_config import BenchConfig
from ddpkit.bench.report.console import progress_bar
from ddpkit.bench.report.stats import (
    median_ci,
    median_ms,
    pair_ratios,
    quartiles,
    relative_spread,
    verdict,
)
from ddpkit.bench.report.table import note_lines
from ddpkit.bench.runners.dispatch import engine_us, top_level_ops
from ddpkit.bench.workloads import stepper, sync_device, workload
from ddpkit.comm.bucket_hooks import noop_hook
from ddpkit.parallel.common import trace
from ddpkit.parallel.common.observer import Observer, WaitEvent
from ddpkit.runtime.devices import comm_tensor
from ddpkit.runtime.group import barrier

__all__ = ["TRACED_STEPS", "WorkloadResult", "bench_workload", "format_engine_cost", "format_results"]


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
    spans (:mod:`ddpkit.parallel.common.trace`); None without communication (world size 1)."""
    ddpkit_noop_ms: float | None = None
    torch_noop_ms: float | None = None
    noop_ratio: float | None = None
    noop_ratio_iqr: tuple[float, float] | None = None
    """Both engines with the same no-op comm hook (``--engine-cost``, always with ``--device cuda``): no
    communication on either side, so the ratio is the engines' own cost. Fair at world 1 too, where ddpkit
    skips the all-reduce that torch's DDP still runs."""
    param_tensors: int = 0
    """The model's parameter tensors (what per-parameter work is paid for)."""
    engine_us: dict[str, float] | None = None
    engine_ops: dict[str, int] | None = None
    """``--engine-cost``: per engine (``ddpkit``, ``torch``, ``torch batched`` where torch's DDP takes
    ``batched_grad_copy``, and ``python hook``: :func:`python_hooks`, no engine), with the no-op hook, the µs per
    step beyond the plain model's step and the aten operations dispatched per step beyond the plain model's (see
    :mod:`ddpkit.bench.runners.dispatch`)."""
    ddpkit_peak_mib: float | None = None
    torch_peak_mib: float | None = None
    """``--device cuda``: peak GPU memory of each engine's steps (its model copy, gradients, optimizer state,
    activations, buckets) above what was allocated before it was built; the largest over the ranks."""


class ExposedWaits(Observer):
    """How long each end of backward of one engine waited for communication (an observer of it)."""

    def __init__(self) -> None:
        self.last = 0.0
        """The latest wait, in seconds."""

    def on_wait(self, event: WaitEvent) -> None:
        self.last = event.end - event.start


def compiled(model: nn.Module, backend: str) -> nn.Module:
    """``model`` under ``torch.compile`` with ``backend``; the first calls compile it."""
    return torch.compile(model, backend=backend)  # type: ignore[return-value]


def comm_only(buffers: list[torch.Tensor]) -> float:
    """Seconds to all-reduce ``buffers`` back to back with nothing else running."""
    sync_device(buffers[0])
    start = time.perf_counter()
    works = [dist.all_reduce(b, async_op=True) for b in buffers]
    for w in works:
        w.wait()
    sync_device(buffers[0])
    return time.perf_counter() - start


def _engines(cfg: BenchConfig) -> dict[str, Callable[[nn.Module], nn.Module]]:
    """How each engine wraps a copy of the model: the two DDPs, and with ``--engine-cost`` both again with the
    same no-op comm hook."""
    from ddpkit._reference import torch_ddp, torch_ddp_accepts
    from ddpkit.parallel.ddp.wrapper import DistributedDataParallel

    def ours(m: nn.Module) -> nn.Module:
        return DistributedDataParallel(m, bucket_cap_mb=cfg.bucket_cap_mb)

    def theirs(m: nn.Module) -> nn.Module:
        return torch_ddp(m, bucket_cap_mb=cfg.bucket_cap_mb)

    def batched(m: nn.Module) -> nn.Module:  # one copy per bucket instead of one per parameter (torch >= 2.12)
        return torch_ddp(m, bucket_cap_mb=cfg.bucket_cap_mb, batched_grad_copy=True)

    def quiet(wrap: Callable[[nn.Module], nn.Module]) -> Callable[[nn.Module], nn.Module]:
        def wrapped(m: nn.Module) -> nn.Module:
            ddp = wrap(m)
            ddp.register_comm_hook(None, noop_hook)
            return ddp
        return wrapped

    engines = {"ddpkit": ours, "torch": theirs}
    if cfg.measures_engine_cost:
        engines |= {"ddpkit noop": quiet(ours), "torch noop": quiet(theirs)}
        if torch_ddp_accepts("batched_grad_copy"):
            engines["torch batched noop"] = quiet(batched)
        engines["python hook noop"] = python_hooks
    return engines


def _nothing(_param: torch.Tensor) -> None:
    return None


def python_hooks(m: nn.Module) -> nn.Module:
    """The plain model with a no-op Python post-accumulate-grad hook on each parameter: what any engine that runs
    Python per parameter pays before its hook does anything (the autograd engine taking the GIL and handing the
    parameter over), the floor under ddpkit's per-parameter cost."""
    for param in m.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(_nothing)
    return m


def peak_mib(base: nn.Module, wrap: Callable[[nn.Module], nn.Module], x: torch.Tensor, y: torch.Tensor,
             steps: int) -> float:
    """Peak CUDA memory (MiB) of building ``wrap`` around a copy of ``base`` and training it ``steps`` steps,
    above what was allocated before (a collective: the largest over the ranks)."""
    gc.collect()
    torch.cuda.synchronize(x.device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(x.device)
    torch.cuda.reset_peak_memory_stats(x.device)
    model = wrap(copy.deepcopy(base))
    step = stepper(model, x, y)
    for _ in range(steps):
        step()
    peak = comm_tensor([(torch.cuda.max_memory_allocated(x.device) - before) / 2**20], torch.float64)
    del model, step
    gc.collect()
    torch.cuda.empty_cache()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def bench_workload(name: str, cfg: BenchConfig) -> WorkloadResult:
    base, x, y = workload(name, cfg)
    engines = _engines(cfg)
    peaks = {}
    if x.is_cuda:  # before the timed copies exist, one engine at a time
        # The plain model's steps first, so that what any first step allocates once for good (cuBLAS's and cuDNN's
        # workspaces) is in the baseline of both engines, not in the first one measured.
        warm = stepper(copy.deepcopy(base), x, y)
        for _ in range(max(cfg.warmup, 3)):
            warm()
        del warm
        peaks = {engine: peak_mib(base, engines[engine], x, y, max(cfg.warmup, 3)) for engine in ("ddpkit", "torch")}
    run = {engine: wrap(copy.deepcopy(base)) for engine, wrap in engines.items()}
    ours, theirs = run["ddpkit"], run["torch"]
    run["compute"] = copy.deepcopy(base)
    if cfg.compile:
        run = {k: compiled(m, cfg.compile_backend) for k, m in run.items()}
    steps = {k: stepper(m, x, y) for k, m in run.items()}
    for _ in range(max(cfg.warmup, 3) if cfg.compile else cfg.warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    exposed: list[float] = []
    waits = ExposedWaits()
    ours.register_observer(waits)
    buffers = [torch.zeros_like(b.flat) for b in ours.reducer.buckets]
    comm: list[float] = []
    rounds = -(-cfg.steps // cfg.block)
    started = time.monotonic()
    bar = progress_bar(name, cfg)
    r = 0
    while r < rounds or more_rounds(times, cfg, started):
        order = ["ddpkit", "torch"] if r % 2 == 0 else ["torch", "ddpkit"]
        if "ddpkit noop" in steps:
            order += [f"{engine} noop" for engine in order] + [e for e in ("torch batched noop", "python hook noop")
                                                               if e in steps]
        for engine in order + ["compute"]:
            barrier()
            for _ in range(cfg.block):
                times[engine].append(steps[engine]())
                if engine == "ddpkit":
                    exposed.append(waits.last)
        barrier()
        for _ in range(cfg.block):
            comm.append(comm_only(buffers))
        bar.update(cfg.block)
        r += 1
    bar.close()
    costs = engine_costs(steps, times) if "ddpkit noop" in steps else None
    overlaps = traced_steps(name, cfg, ours, theirs, x, y, run=(run["ddpkit"], run["torch"]))
    mine = comm_tensor(exposed, torch.float64)
    waits = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(waits, mine)
    exposed = torch.stack(waits).min(dim=0).values.tolist()
    compute, comm_ms = median_ms(times["compute"]), median_ms(comm)
    ddpkit_ms, torch_ms = median_ms(times["ddpkit"]), median_ms(times["torch"])

    def hidden(step_ms: float) -> float:
        return min(1.0, max(0.0, (compute + comm_ms - step_ms) / comm_ms))

    ratios = pair_ratios(times)
    quiet = pair_ratios(times, "ddpkit noop", "torch noop") if "ddpkit noop" in times else None
    return WorkloadResult(
        workload=name, params=sum(p.numel() for p in base.parameters()),
        ddpkit_ms=ddpkit_ms, torch_ms=torch_ms, steps=len(times["ddpkit"]),
        ddpkit_iqr_ms=quartiles(times["ddpkit"], 1000.0), torch_iqr_ms=quartiles(times["torch"], 1000.0),
        ratio=statistics.median(ratios), ratio_iqr=quartiles(ratios), ratio_ci=median_ci(ratios),
        overlap_ddpkit=overlaps[0],
        overlap_torch=overlaps[1],
        compute_ms=compute, comm_ms=comm_ms, hidden_ddpkit=hidden(ddpkit_ms), hidden_torch=hidden(torch_ms),
        exposed_ddpkit_ms=median_ms(exposed),
        hidden_ddpkit_direct=min(1.0, max(0.0, 1.0 - median_ms(exposed) / comm_ms)), buckets=len(ours.reducer.buckets),
        ddpkit_noop_ms=median_ms(times["ddpkit noop"]) if quiet else None,
        torch_noop_ms=median_ms(times["torch noop"]) if quiet else None,
        noop_ratio=statistics.median(quiet) if quiet else None, noop_ratio_iqr=quartiles(quiet) if quiet else None,
        param_tensors=sum(1 for _ in base.parameters()),
        engine_us=costs[0] if costs else None, engine_ops=costs[1] if costs else None,
        ddpkit_peak_mib=peaks.get("ddpkit"), torch_peak_mib=peaks.get("torch"),
    )


def engine_costs(steps: dict[str, Callable[[], float]], times: dict[str, list[float]]
                 ) -> tuple[dict[str, float], dict[str, int]]:
    """Each no-op-hooked engine's µs per step and aten operations per step beyond the plain model (one more,
    profiled, step of each; every rank runs them, in the same order)."""
    plain = top_level_ops(steps["compute"])
    engines = {e.removesuffix(" noop"): e for e in steps if e.endswith(" noop")}
    ops = {name: top_level_ops(steps[e]) - plain for name, e in engines.items()}
    return {name: engine_us(times[e], times["compute"]) for name, e in engines.items()}, ops


TRACED_STEPS = 10
"""Steps per engine traced after the timed ones (tracing perturbs the steps it records)."""


def traced_steps(name: str, cfg: BenchConfig, ours: nn.Module, theirs: nn.Module, x: torch.Tensor,
                  y: torch.Tensor, run: tuple[nn.Module, nn.Module] | None = None) -> tuple[float | None, float | None]:
    """Trace a few more steps of each engine: their overlap, and (``--trace``) their spans on file.

    ``run``: what each step calls, when not the wrappers themselves (the compiled models of ``--compile``).
    """
    rank = dist.get_rank()
    recorders = [trace.instrument(ours, "ddpkit", rank), trace.instrument(theirs, "torch", rank)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (ours, theirs)]
    for _ in range(min(cfg.steps, TRACED_STEPS)):
        for recorder, model, opt in zip(recorders, run or (ours, theirs), optimizers):
            barrier()
            recorder.step(model, opt, x, y)
    if cfg.trace is not None:
        path = cfg.trace.with_name(f"{cfg.trace.stem}-{name}{cfg.trace.suffix}") if len(cfg.workloads) > 1 \
            else cfg.trace
        trace.write(path, recorders)
    return trace.median_overlap(recorders[0]), trace.median_overlap(recorders[1])


def more_rounds(times: dict[str, list[float]], cfg: BenchConfig, started: float) -> bool:
    """``--target-spread``: whether to add a round (rank 0 decides, every rank follows)."""
    if not cfg.target_spread:
        return False
    go = 0
    if dist.get_rank() == 0:
        loose = relative_spread(pair_ratios(times)) > cfg.target_spread
        go = int(loose and time.monotonic() - started < cfg.time_budget)
    go = comm_tensor([go])
    dist.broadcast(go, src=0)
    return bool(go.item())


def format_results(results: list[WorkloadResult], world_size: int, compile_backend: str | None = None,
                   device: str = "cpu") -> str:
    """A plain-text table of the results, its columns as the README defines them (and the engine-cost table)."""
    compiled_note = f", models under torch.compile (backend {compile_backend})" if compile_backend else ""
    where = "gloo, 1 thread per rank" if device == "cpu" else "nccl, one GPU per rank"
    lines = [
        *note_lines(f"ddpkit bench: world size {world_size}, {where}{compiled_note}; median step times in ms"),
        f"{'workload':<11} {'params':>10} {'steps':>5} {'ddpkit ms':>9} {'torch ms':>9} {'ratio':>6} {'ratio IQR':>11} "
        f"{'95% CI':>11} {'ddpkit is':>9}",
    ]

    def share(x: float | None) -> str:
        return "-" if x is None else f"{x:.0%}"

    for r in results:
        lines.append(
            f"{r.workload:<11} {r.params:>10,} {r.steps:>5} {r.ddpkit_ms:>9.2f} {r.torch_ms:>9.2f} {r.ratio:>6.3f} "
            f"{r.ratio_iqr[0]:>5.3f}-{r.ratio_iqr[1]:<5.3f} {r.ratio_ci[0]:>5.3f}-{r.ratio_ci[1]:<5.3f} "
            f"{verdict(r.ratio_ci):>9}"
        )
    lines += note_lines(
        "ratio = median over back-to-back step pairs of ddpkit / torch, with its quartiles (lower is better; it can "
        "sit on the other side of 1 than the two medians when the pairs disagree, which the IQR shows); 95% CI = "
        "confidence interval of that median (order statistics; more --steps narrow it), and ddpkit is faster or "
        "slower when it lies on one side of 1, else level")
    lines += ["", "where the time goes",
              f"{'workload':<11} {'compute ms':>10} {'comm alone ms':>13} {'exposed ms':>10} {'hidden direct':>13} "
              f"{'overlap ddpkit/torch':>20}"]
    for r in results:
        lines.append(
            f"{r.workload:<11} {r.compute_ms:>10.2f} {r.comm_ms:>13.2f} {r.exposed_ddpkit_ms:>10.2f} "
            f"{r.hidden_ddpkit_direct:>13.0%} {share(r.overlap_ddpkit):>11} /{share(r.overlap_torch):>7}"
        )
    lines += note_lines(
        "compute = step without communication; comm alone = all-reduce of the gradients with nothing else running; "
        "exposed = ddpkit's median wait for communication at the end of backward; hidden direct = 1 - exposed / "
        "comm alone; overlap = share of all-reduce time that ran while gradients were still being computed, from "
        f"the spans of {TRACED_STEPS} traced steps per engine (see --trace)")
    costed = [r for r in results if r.noop_ratio is not None]
    if costed:
        lines += ["", format_engine_cost(costed)]
    return "\n".join(lines)


def format_engine_cost(results: list[WorkloadResult]) -> str:
    """The engines' own cost: both with the same no-op comm hook, and (on CUDA) each one's peak memory."""
    def mib(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f}"

    lines = [
        "engine cost: both engines with the same no-op comm hook (no communication on either side)",
        f"{'workload':<11} {'ddpkit ms':>9} {'torch ms':>9} {'ratio':>6} {'ratio IQR':>11} "
        f"{'ratio (defaults)':>16} {'peak MiB ddpkit':>15} {'torch':>7}",
    ]  # 94 columns
    for r in results:
        assert r.noop_ratio is not None and r.noop_ratio_iqr is not None
        lines.append(
            f"{r.workload:<11} {r.ddpkit_noop_ms:>9.2f} {r.torch_noop_ms:>9.2f} {r.noop_ratio:>6.3f} "
            f"{r.noop_ratio_iqr[0]:>5.3f}-{r.noop_ratio_iqr[1]:<5.3f} {r.ratio:>16.3f} "
            f"{mib(r.ddpkit_peak_mib):>15} {mib(r.torch_peak_mib):>7}"
        )
    lines += note_lines(
        "ratio = median over back-to-back pairs of ddpkit / torch, each engine with the no-op hook: the engines' own "
        "bookkeeping alone (fair at world 1, where ddpkit skips the all-reduce torch's DDP still runs); ratio "
        "(defaults) = the table above's; peak MiB = peak GPU memory of each engine's steps above what was "
        "allocated before it was built (largest over ranks; '-' on the CPU)"
    )
    counted = [r for r in results if r.engine_us and r.engine_ops]
    if counted:
        lines += ["", f"{'workload':<11} {'engine':<14} {'tensors':>7} {'buckets':>7} {'us/step':>8} {'us/param':>8} "
                      f"{'us/bucket':>9} {'ops/step':>8}"]
        for r in counted:
            assert r.engine_us is not None and r.engine_ops is not None
            for engine, us in r.engine_us.items():
                buckets = r.buckets if engine == "ddpkit" else None
                lines.append(
                    f"{r.workload:<11} {engine:<14} {r.param_tensors:>7} {buckets if buckets else '-':>7} "
                    f"{us:>8.0f} {us / r.param_tensors:>8.2f} {f'{us / buckets:.1f}' if buckets else '-':>9} "
                    f"{r.engine_ops[engine]:>8}"
                )
        lines += note_lines(
            "beyond the plain model, each engine with the no-op hook: us/step = median over rounds of the engine's "
            "step minus the plain model's step of the same round (us/param: per parameter tensor; us/bucket: per "
            "ddpkit bucket); ops/step = aten operations dispatched per step (top level, under torch's profiler) "
            "minus the plain model's; torch batched = torch's DDP with batched_grad_copy=True; python hook = no "
            "engine, the plain model with a no-op Python hook per parameter: the floor of any engine whose "
            "per-parameter work is Python (ddpkit's)"
        )
    return "\n".join(lines)

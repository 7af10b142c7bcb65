"""``ddpkit bench --zero``: what ZeRO saves per rank, and what it costs per step, next to torch's.

Five setups train each workload with AdamW (two state tensors per parameter):

==================  ===========================================================================
``ddp``             ddpkit's DDP and ``torch.optim.AdamW`` (stage 0: the baseline)
``torch ddp``       torch's DDP and ``torch.optim.AdamW``
``zero1``           ddpkit's DDP and ``ddpkit.ZeroRedundancyOptimizer``
``torch zero1``     torch's DDP and ``torch.distributed.optim.ZeroRedundancyOptimizer``
``zero2``           ``ddpkit.DDP(zero_stage=2)`` and ``ddpkit.ZeroRedundancyOptimizer``
``zero3``           ``ddpkit.DDP(zero_stage=3)`` and ``torch.optim.AdamW`` over its shards
``torch fsdp2``     torch's FSDP2 (``fully_shard`` on the same units, then the root) and AdamW
==================  ===========================================================================

Bytes per rank (the largest over ranks), counted from the tensors alive
between a backward and its step (a sharded tensor counts its local part): *parameters*; *gradients*, every ``.grad``
plus the gradient shards stage 2 keeps (the buckets that exist only while
they are reduced are in the peak, not here); *optimizer state*, the tensors
of the (local) optimizer's state. *Peak*: the peak private memory of a rank
above its baseline, in processes of its own per setup (as ``--memory``
measures it, see :mod:`ddpkit.bench.sections.memory`). *Step*: the median step time,
the setups stepping in turn in one group of processes (``--steps``
rounds after ``--warmup``), and its ratio to ``ddp``.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from ddpkit.bench.bench_config import BenchConfig
from ddpkit.bench.sections.memory import MEMORY_STEPS, fix_mmap_threshold, in_use, peaks

SETUPS = ("ddp", "torch ddp", "zero1", "torch zero1", "zero2", "zero3", "torch fsdp2")
ZERO_WORKLOADS = ("transformer", "mlp")
"""The workloads ``--zero`` runs (of ``--workloads``): the two with the most optimizer state."""
WORLDS = (2, 3)
"""The world sizes ``--zero`` measures when ``--world-sizes`` is not given."""


def _build(setup: str, model: Any, bucket_cap_mb: float | None) -> tuple[Any, Any]:
    """``setup``'s wrapped model and optimizer around ``model``."""
    import torch

    from ddpkit._reference import torch_ddp, torch_fsdp2, torch_zero
    from ddpkit.parallel.ddp.wrapper import DistributedDataParallel
    from ddpkit.parallel.zero.stage1 import ZeroRedundancyOptimizer
    from ddpkit.parallel.zero.units import find_units

    adamw = torch.optim.AdamW
    if setup == "torch fsdp2":
        wrapped = torch_fsdp2(model, [unit for _, unit in find_units(model)])
        return wrapped, adamw(model.parameters(), lr=1e-4)
    if setup == "zero3":
        wrapped = DistributedDataParallel(model, zero_stage=3)
        return wrapped, adamw(model.parameters(), lr=1e-4)
    if setup.startswith("torch"):
        wrapped = torch_ddp(model, bucket_cap_mb=bucket_cap_mb)
        opt = torch_zero(model.parameters(), adamw, lr=1e-4) if "zero" in setup else adamw(model.parameters(), lr=1e-4)
        return wrapped, opt
    wrapped = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, zero_stage=2 if setup == "zero2" else 0)
    opt = ZeroRedundancyOptimizer(model.parameters(), adamw, lr=1e-4) if "zero" in setup else \
        adamw(model.parameters(), lr=1e-4)
    return wrapped, opt


def _bytes(model: Any, wrapped: Any, opt: Any) -> dict[str, float]:
    """Parameters, gradients and optimizer state of this rank, in MB (see the module notes)."""
    import torch

    def size(tensors: Any) -> float:
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # FSDP2's DTensors: this rank's
        return sum(t.numel() * t.element_size() for t in local) / 1e6

    local = getattr(opt, "optim", opt)
    state = [v for s in local.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    shards = getattr(getattr(wrapped, "reducer", None), "grad_shards", [])
    return {"params": size(model.parameters()),
            "grads": size([p.grad for p in model.parameters() if p.grad is not None]) + size(shards),
            "state": size(state)}


def _step(wrapped: Any, opt: Any, x: Any, y: Any) -> Any:
    import torch

    opt.zero_grad()
    torch.nn.functional.cross_entropy(wrapped(x), y).backward()
    return opt


def _time_worker(rank: int, cfg: BenchConfig, name: str, out: str) -> None:
    """All the setups in one group of processes, stepping in turn; step times and bytes per setup."""
    import copy
    import time

    import torch
    import torch.distributed as dist

    from ddpkit.bench.workloads import workload
    from ddpkit.runtime.devices import comm_tensor
    from ddpkit.runtime.group import init, shutdown

    torch.set_num_threads(1)
    init()
    base, x, y = workload(name, cfg)
    built = {s: (model := copy.deepcopy(base), *_build(s, model, cfg.bucket_cap_mb)) for s in SETUPS}
    times: dict[str, list[float]] = {s: [] for s in SETUPS}
    sizes: dict[str, dict[str, float]] = {}
    for r in range(cfg.warmup + cfg.steps):
        for s in SETUPS if r % 2 == 0 else SETUPS[::-1]:
            model, wrapped, opt = built[s]
            dist.barrier()
            start = time.perf_counter()
            _step(wrapped, opt, x, y)
            if r == cfg.warmup and s not in sizes:
                sizes[s] = _bytes(model, wrapped, opt)  # between the backward and the step
            opt.step()
            if r >= cfg.warmup:
                times[s].append(time.perf_counter() - start)
    result = comm_tensor([[sizes[s][k] for k in ("params", "grads", "state")] + [statistics.median(times[s])]
                          for s in SETUPS], torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps({s: dict(zip(("params", "grads", "state", "step_s"), row))
                                         for s, row in zip(SETUPS, result.tolist())}))
    shutdown()


def _peak_worker(rank: int, cfg: BenchConfig, name: str, setup: str, out: str) -> None:
    """One setup in processes of its own: the peak private memory above the baseline (see
    ddpkit.bench.sections.memory)."""
    import torch
    import torch.distributed as dist

    from ddpkit.bench.workloads import workload
    from ddpkit.runtime.devices import comm_tensor
    from ddpkit.runtime.group import init, shutdown

    torch.set_num_threads(1)
    init()
    # Every setup's code imported (and the first optimizer built) before the baseline, as --memory does.
    probe = torch.nn.Linear(2, 2)
    _build("torch zero1", probe, None)
    fix_mmap_threshold()
    dist.barrier()
    before = in_use()
    model, x, y = workload(name, cfg)
    wrapped, opt = _build(setup, model, cfg.bucket_cap_mb)
    for _ in range(cfg.warmup + min(cfg.steps, MEMORY_STEPS)):
        _step(wrapped, opt, x, y).step()
    grown = comm_tensor([peaks()[1] - before[1]])
    dist.all_reduce(grown, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps({"peak": grown.item()}))
    shutdown()


def measure_zero(cfg: BenchConfig) -> dict[str, Any]:
    """``{f"{workload} world {W}": {setup: {"params", "grads", "state", "step_s", "peak"}}}`` in MB and seconds."""
    from ddpkit.bench.runners.ranks import spawn_ranks

    found: dict[str, Any] = {}
    for name in (w for w in cfg.workloads if w in ZERO_WORKLOADS):
        for world in cfg.world_sizes or WORLDS:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "zero.json")
                spawn_ranks(_time_worker, world, args=(cfg, name, out))
                row = json.loads(Path(out).read_text())
                for setup in SETUPS:
                    spawn_ranks(_peak_worker, world, args=(cfg, name, setup, out))
                    row[setup]["peak"] = json.loads(Path(out).read_text())["peak"]
            found[f"{name} world {world}"] = row
    return found


def format_zero(found: dict[str, Any]) -> str:
    lines = ["ZeRO: MB per rank (the largest over ranks) and step time; AdamW; ratio = step / ddp's step",
             f"{'workload':<18} {'setup':<12} {'params':>8} {'grads':>8} {'optim':>8} {'peak':>8} {'step ms':>8} "
             f"{'ratio':>6}"]
    for key, row in found.items():
        base = row["ddp"]["step_s"]
        for setup, m in row.items():
            lines.append(f"{key:<18} {setup:<12} {m['params']:>8.1f} {m['grads']:>8.1f} {m['state']:>8.1f} "
                         f"{m.get('peak', float('nan')):>8.1f} {1e3 * m['step_s']:>8.1f} {m['step_s'] / base:>6.3f}")
    return "\n".join(lines)


def memory_plot(found: dict[str, Any], path: Path) -> Path:
    """Model states (parameters, gradients, optimizer state) and peak MB per rank against the world size, one
    panel per workload and one line per setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({key.split(" world ")[0] for key in found})
    fig, axes = plt.subplots(2, len(workloads), figsize=(5.5 * len(workloads), 7.5), squeeze=False)
    for col, name in enumerate(workloads):
        worlds = sorted(int(k.split(" world ")[1]) for k in found if k.startswith(f"{name} world "))
        for setup in SETUPS:
            rows = [found[f"{name} world {w}"][setup] for w in worlds]
            states = [m["params"] + m["grads"] + m["state"] for m in rows]
            axes[0][col].plot(worlds, states, marker="o", label=setup)
            axes[1][col].plot(worlds, [m.get("peak", float("nan")) for m in rows], marker="o", label=setup)
        axes[0][col].set_title(f"{name}: parameters + gradients + optimizer state")
        axes[1][col].set_title(f"{name}: peak of the step")
        for row in (0, 1):
            axes[row][col].set_xlabel("world size")
            axes[row][col].set_ylabel("MB per rank (largest rank)")
            axes[row][col].set_xticks(worlds)
            axes[row][col].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_zero_report(cfg: BenchConfig, found: dict[str, Any], table: str) -> Path:
    """``--report DIR`` with ``--zero``: ``zero.json``, ``zero-memory.png`` and ``summary.md`` (command, table)."""
    from ddpkit.bench.report.summary import table_page
    from ddpkit.runtime.options import plain

    directory = Path(cfg.report)
    (directory / "zero.json").write_text(json.dumps({"settings": plain(cfg), "zero": found}, indent=2) + "\n")
    memory_plot(found, directory / "zero-memory.png")
    summary = directory / "summary.md"
    summary.write_text(table_page("ddpkit bench --zero", cfg, table,
                                  "![memory per rank against the world size](zero-memory.png)", ""))
    return summary

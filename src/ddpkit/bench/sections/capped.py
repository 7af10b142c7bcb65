"""``ddpkit bench --zero --zero-cap-mb MB``: a model 1.5 times a rank's memory, trained under a memory cap.

Each rank joins a memory cgroup (:class:`ddpkit.bench.runners.memory_cap.MemoryCap`) that
lets it touch ``MB`` of new memory (the interpreter, torch and the process
group are loaded first, outside it), and the kernel kills a rank that
passes it. The model is a stack of ``Linear(512, 512)`` layers whose weights
alone are 1.5 times the cap, trained with SGD for a few steps:

* ``ddp``, the control: the model built whole on every rank (stage 0);
* ``zero3``: ``DistributedDataParallel(zero_stage=3)`` of the model built on
  the meta device, materialised unit by unit, each rank keeping its rows.

Each setup and world size runs in processes of its own, and reports whether
it trained or was killed, and the most memory its ranks held inside the cap
(the cgroup's own peak, the largest rank). Stage 3 holds its rows of the
parameters and of their gradients, one or two units gathered and a unit's
gradient in flight: at world ``W``, about ``2 / W`` of the weights plus a few
units, so the model fits from the world size at which that is below the cap
(4 and more for 1.5 times).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from ddpkit.bench.bench_config import BenchConfig
from ddpkit.bench.runners.memory_cap import MemoryCap

__all__ = ["CAP_STEPS", "CAP_WORLDS", "format_capped", "measure_capped"]

CAP_STEPS = 3
"""SGD steps each setup trains under the cap."""
CAP_WORLDS = (2, 4)
"""The world sizes measured when ``--world-sizes`` is not given."""
_WIDTH = 512


def _depth(cap_mb: float) -> int:
    """Layers of ``Linear(512, 512)`` whose weights are 1.5 times ``cap_mb``."""
    return max(2, math.ceil(1.5 * cap_mb * 1e6 / ((_WIDTH * _WIDTH + _WIDTH) * 4)))


def _worker(rank: int, setup: str, cap_mb: float, tag: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddpkit.bench.sections.memory import fix_mmap_threshold
    from ddpkit.parallel.ddp.wrapper import DistributedDataParallel
    from ddpkit.runtime.devices import comm_tensor
    from ddpkit.runtime.group import init, shutdown

    torch.set_num_threads(1)
    init()
    # The first use of each engine and of the optimizer loads code and fills caches, outside the cap: what the
    # cap measures is the model's.
    for stage in (0, 3):
        model = DistributedDataParallel(nn.Sequential(nn.Linear(_WIDTH, 2), nn.Linear(2, 2)), zero_stage=stage)
        model(torch.zeros(1, _WIDTH)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    fix_mmap_threshold()
    dist.barrier()
    cap = MemoryCap(f"{tag}-{rank}", int(cap_mb * 1e6))
    with cap.entered():
        with torch.device("meta" if setup == "zero3" else "cpu"):
            model = nn.Sequential(*[nn.Linear(_WIDTH, _WIDTH) for _ in range(_depth(cap_mb))])
        wrapped = DistributedDataParallel(model, zero_stage=3 if setup == "zero3" else 0)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)
        for step in range(CAP_STEPS):
            x = torch.randn(8, _WIDTH, generator=torch.Generator().manual_seed(step * 100 + rank))
            opt.zero_grad(set_to_none=True)
            wrapped(x).square().mean().backward()
            opt.step()
    peak = comm_tensor([cap.peak() / 1e6])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps({"peak": peak.item()}))
    shutdown()


def measure_capped(cfg: BenchConfig) -> dict[str, Any]:
    """``{"cap_mb", "model_mb", "rows": [{"setup", "world", "trained", "peak"}]}`` (see the module notes)."""
    from ddpkit.bench.runners.ranks import spawn_ranks
    from ddpkit.runtime.spawn import WorkerError

    cap_mb = cfg.zero_cap_mb
    depth = _depth(cap_mb)
    rows = []
    for setup, world in [("ddp", min(cfg.world_sizes or CAP_WORLDS)),
                         *(("zero3", w) for w in cfg.world_sizes or CAP_WORLDS)]:
        tag = f"ddpkit-bench-{os.getpid()}-{setup}-{world}"
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "capped.json")
            try:
                spawn_ranks(_worker, world, args=(setup, cap_mb, tag, out))
                rows.append({"setup": setup, "world": world, "trained": True,
                             "peak": json.loads(Path(out).read_text())["peak"]})
            except WorkerError as e:
                killed = e.exitcode == -9
                rows.append({"setup": setup, "world": world, "trained": False, "peak": None,
                             "why": "killed by the kernel past the cap" if killed else str(e).splitlines()[0]})
            finally:
                for rank in range(world):  # a killed rank never left its group
                    MemoryCap.remove(f"{tag}-{rank}")
    return {"cap_mb": cap_mb, "model_mb": depth * (_WIDTH * _WIDTH + _WIDTH) * 4 / 1e6, "layers": depth,
            "rows": rows}


def format_capped(found: dict[str, Any]) -> str:
    lines = [f"Under a memory cap of {found['cap_mb']:g} MB per rank: {found['layers']} Linear({_WIDTH}, {_WIDTH}) "
             f"layers, {found['model_mb']:.1f} MB of weights ({found['model_mb'] / found['cap_mb']:.2f} x the cap), "
             f"{CAP_STEPS} SGD steps",
             f"{'setup':<8} {'world':>5}  {'outcome':<36} {'peak MB':>8}"]
    for r in found["rows"]:
        outcome = "trained" if r["trained"] else r["why"]
        peak = f"{r['peak']:>8.1f}" if r["peak"] is not None else f"{'-':>8}"
        lines.append(f"{r['setup']:<8} {r['world']:>5}  {outcome:<36} {peak}")
    return "\n".join(lines)

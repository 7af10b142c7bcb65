"""``ddpkit bench collectives``: each all-reduce algorithm's time and bandwidth by message size, like all_reduce_perf.

For every world size, new gloo ranks (one thread each) all-reduce float32
messages of each size with each algorithm, the algorithms interleaved round
by round; the time of a round is the slowest rank's, and the figure the
median over rounds. Reported per algorithm and size:

* ``algbw`` = bytes / time;
* ``busbw`` = algbw x 2(p-1)/p, the bandwidth a ring-optimal algorithm needs,
  so the algorithms compare on one scale (as nccl-tests defines it);
* ``model``: the time an alpha-beta model predicts, ``steps x alpha +
  bytes moved per rank x beta``, with each algorithm's own step count and
  volume, and alpha (latency per message) and beta (seconds per byte) fitted
  by least squares to all point-to-point measurements of that world size.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ddpkit.runtime.options import ConfigError, option, plain, writable_file

ALGORITHMS = ("native", "naive", "ring", "tree", "hierarchical")
KIB = 1024


@dataclass(kw_only=True)
class CollectivesBenchConfig:
    """What ``ddpkit bench collectives`` measures."""

    sizes: tuple[int, ...] = option(
        tuple(4 * KIB * 4**k for k in range(8)), "message sizes in bytes (default 4 KiB to 64 MiB, powers of 4)",
        metavar="BYTES",
    )
    world_sizes: tuple[int, ...] = option((2, 3, 4), "world sizes to measure", metavar="N")
    algorithms: tuple[str, ...] = option(ALGORITHMS, "algorithms to measure", metavar="NAME")
    iters: int = option(5, "timed rounds per size")
    warmup: int = option(1, "untimed rounds first")
    json_path: Path | None = option(None, "also write the results to this JSON file", flags=["--json"])
    plot: Path | None = option(None, "write a PNG of bus bandwidth against size, one line per algorithm")
    progress: bool = option(True, "print a line to stderr as each world size starts", negate="--no-progress",
                            negate_only=True)

    def __post_init__(self) -> None:
        self.sizes, self.world_sizes = tuple(self.sizes), tuple(self.world_sizes)
        self.algorithms = tuple(self.algorithms)
        if not self.sizes or min(self.sizes) < 4:
            raise ConfigError(f"--sizes {' '.join(map(str, self.sizes))}: each must be at least 4 bytes")
        if not self.world_sizes or min(self.world_sizes) < 2:
            raise ConfigError(f"--world-sizes {' '.join(map(str, self.world_sizes))}: each must be at least 2")
        unknown = [a for a in self.algorithms if a not in ALGORITHMS]
        if unknown or not self.algorithms:
            raise ConfigError(f"--algorithms {' '.join(self.algorithms)}: choose among {', '.join(ALGORITHMS)}")
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError(f"--iters {self.iters} must be at least 1 and --warmup {self.warmup} 0 or more")
        for name, flag in (("json_path", "--json"), ("plot", "--plot")):
            if getattr(self, name) is not None:
                setattr(self, name, writable_file(getattr(self, name), flag))


def _shape(algorithm: str, p: int, nbytes: int, local: int) -> tuple[float, float]:
    """(messages in sequence, bytes sent by the busiest rank) of one all-reduce."""
    log = math.ceil(math.log2(p)) if p > 1 else 0
    if algorithm == "ring":
        return 2 * (p - 1), 2 * (p - 1) / p * nbytes
    if algorithm == "tree":
        return 2 * log, 2 * log * nbytes
    if algorithm == "naive":
        return 2 * (p - 1), 2 * (p - 1) * nbytes
    nodes = math.ceil(p / local)
    llog = math.ceil(math.log2(local)) if local > 1 else 0
    return 2 * llog + 2 * (nodes - 1), 2 * llog * nbytes + 2 * (nodes - 1) / nodes * nbytes


def _worker(rank: int, cfg: CollectivesBenchConfig, out: str) -> None:
    import torch
    import torch.distributed as dist

    from ddpkit.comm.allreduce import all_reduce
    from ddpkit.runtime.devices import comm_device, comm_tensor
    from ddpkit.runtime.group import init, shutdown

    torch.set_num_threads(1)
    init()  # the backend spawn() gave these ranks (gloo)
    rows = []
    for nbytes in cfg.sizes:
        t = torch.ones(nbytes // 4, device=comm_device())
        times: dict[str, list[float]] = {a: [] for a in cfg.algorithms}
        for r in range(cfg.warmup + cfg.iters):
            order = list(cfg.algorithms[r % len(cfg.algorithms):] + cfg.algorithms[: r % len(cfg.algorithms)])
            for algorithm in order:
                dist.barrier()
                start = time.perf_counter()
                all_reduce(t, algorithm=algorithm, check=False)
                took = comm_tensor([time.perf_counter() - start], torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the round ends with its slowest rank
                if r >= cfg.warmup:
                    times[algorithm].append(took.item())
        for algorithm, ts in times.items():
            rows.append({"world_size": dist.get_world_size(), "bytes": nbytes, "algorithm": algorithm,
                         "time_s": statistics.median(ts), "rounds": len(ts)})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    shutdown()


def _fit(rows: list[dict], p: int, local: int) -> tuple[float, float]:
    """alpha (s per message) and beta (s per byte) by least squares over the point-to-point algorithms."""
    import numpy as np
    from scipy.optimize import nnls

    mine = [r for r in rows if r["world_size"] == p and r["algorithm"] != "native"]
    if len(mine) < 2:
        return float("nan"), float("nan")
    features = np.array([_shape(r["algorithm"], p, r["bytes"], local) for r in mine], dtype=float)
    times = np.array([r["time_s"] for r in mine])
    # Relative errors (each row divided by its time): small messages count as
    # much as large ones. Non-negative: a latency and a cost per byte.
    (alpha, beta), _ = nnls(features / times[:, None], np.ones_like(times))
    return float(alpha), float(beta)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(5 * len(worlds), 4), squeeze=False)
    for ax, p in zip(axes[0], worlds):
        for algorithm in sorted({r["algorithm"] for r in rows}):
            pts = sorted((r["bytes"], r["busbw_GBps"]) for r in rows
                         if r["world_size"] == p and r["algorithm"] == algorithm)
            ax.plot([b for b, _ in pts], [bw for _, bw in pts], marker="o", label=algorithm)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"all-reduce, {p} ranks (gloo)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: CollectivesBenchConfig) -> list[dict]:
    """Measure every world size in processes of its own, print the table, write JSON and the plot."""
    from ddpkit.bench.runners.ranks import spawn_ranks

    rows: list[dict] = []
    fits = {}
    for i, p in enumerate(cfg.world_sizes, 1):
        if cfg.progress:
            print(f"ddpkit bench collectives: world size {p} ({i}/{len(cfg.world_sizes)}), {len(cfg.sizes)} sizes x "
                  f"{len(cfg.algorithms)} algorithms", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            spawn_ranks(_worker, p, args=(cfg, out))
            mine = json.loads(Path(out).read_text())
        # spawn's workers are one node: hierarchical has all ranks in one node.
        fits[p] = _fit(mine, p, local=p)
        alpha, beta = fits[p]
        for r in mine:
            r["algbw_GBps"] = r["bytes"] / r["time_s"] / 1e9
            r["busbw_GBps"] = r["algbw_GBps"] * 2 * (p - 1) / p
            if r["algorithm"] != "native" and math.isfinite(alpha):
                steps, volume = _shape(r["algorithm"], p, r["bytes"], p)
                r["model_s"] = steps * alpha + volume * beta
        rows += mine
    print(format_rows(rows, fits), flush=True)
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps({"config": plain(cfg),
                                             "fits": {str(p): {"alpha_s": a, "beta_s_per_byte": b}
                                                      for p, (a, b) in fits.items()},
                                             "rows": rows}, indent=2) + "\n")
    if cfg.plot is not None:
        _plot(rows, cfg.plot)
    return rows


def format_rows(rows: list[dict], fits: dict[int, tuple[float, float]]) -> str:
    lines = []
    for p, (alpha, beta) in fits.items():
        lines.append(f"world size {p} (gloo, 1 thread per rank): alpha {alpha * 1e6:.1f} us per message, "
                     f"beta {beta * 1e9:.3f} ns per byte ({1 / beta / 1e9 if beta > 0 else float('nan'):.2f} GB/s)")
        lines.append(f"{'bytes':>10} {'algorithm':<13} {'time ms':>9} {'model ms':>9} {'algbw GB/s':>11} "
                     f"{'busbw GB/s':>11}")
        for r in (r for r in rows if r["world_size"] == p):
            model = f"{r['model_s'] * 1e3:9.3f}" if "model_s" in r else f"{'-':>9}"
            lines.append(f"{r['bytes']:>10} {r['algorithm']:<13} {r['time_s'] * 1e3:>9.3f} {model} "
                         f"{r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f}")
    return "\n".join(lines)

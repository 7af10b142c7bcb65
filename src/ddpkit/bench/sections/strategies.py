"""``ddpkit bench strategies``: the seed's consistency models side by side, each a whole training run.

For every world size in ``--world-sizes`` and every entry of
``--strategies`` (``NAME`` or ``NAME:S`` with a staleness bound ``S``), one
``ddpkit train`` run on the same model, data, seed and epochs, optionally
with a straggler (``--straggler RANK:FACTOR`` slows that worker's forward
and backward). The runs of a world size go in turn, the first of each repeat
rotating. Reported per run, from its ``metrics.jsonl`` and ``summary.json``:

* time per epoch: the median over epochs (and repeats) of the training time
  of an epoch (evaluation excluded), with its quartiles;
* time to the target accuracy: training time summed over the epochs until
  the first evaluation at or above ``--target-accuracy``;
* the final test accuracy;
* MB per step: the payload each rank hands to collectives or servers per
  optimizer step (gradients pushed, for the servers; the parameters pulled
  back are as many bytes again);
* waiting: each rank's seconds per step blocked on the others (DDP's wait at
  the end of backward and in its buffers' broadcast, local SGD's averages,
  the exchange with the servers, the stale all-reduces, and the wait at each
  epoch's end for the last rank to finish its shard), the mean over ranks
  and the most any rank waited;
* staleness: the mean and largest staleness of the gradients (servers:
  versions applied between the parameters a gradient was computed on and
  itself; SSP: steps the other workers' gradients arrived late), and the
  largest lead of a worker over the slowest one (servers).

With ``--plot``, test accuracy against training time, a line per strategy,
a panel per world size.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ddpkit.bench.report.stats import quartiles
from ddpkit.bench.report.table import note_lines
from ddpkit.runtime.options import ConfigError, option, plain, writable_file
from ddpkit.train.train_config import DATASETS, MODELS, STRATEGIES, TrainConfig

__all__ = ["ConsistencyBenchConfig", "RunResult", "format_runs", "run"]

DEFAULT_STRATEGIES = ("ddp", "local-sgd", "ps-sync", "ps-async", "ps-async:2", "ssp:2")


@dataclass(kw_only=True)
class ConsistencyBenchConfig:
    """What ``ddpkit bench strategies`` runs."""

    strategies: tuple[str, ...] = option(
        DEFAULT_STRATEGIES, "runs, each a --strategy of ddpkit train, with :S for a staleness bound "
        "(ps-async:2, ssp:4)", metavar="NAME[:S]",
    )
    world_sizes: tuple[int, ...] = option((2, 4), "worker counts to compare at", metavar="N")
    straggler: str | None = option(
        None, "slow one worker down in every run: RANK:FACTOR (its forward and backward take FACTOR times as "
        "long)", metavar="RANK:FACTOR",
    )
    model: str = option("convnet", "the model", choices=tuple(MODELS))
    dataset: str = option("digits", "the dataset", choices=DATASETS)
    data_dir: Path | None = option(None, "folder of the MNIST IDX files (--dataset mnist)")
    epochs: int = option(8, "epochs per run")
    seed: int = option(0, "seed of every run")
    num_servers: int = option(1, "parameter servers of the ps-* runs", metavar="K")
    local_sgd: int = option(4, "local-sgd: steps between parameter averages", metavar="H")
    target_accuracy: float = option(0.97, "the test accuracy whose time to reach is reported")
    repeats: int = option(1, "runs of each strategy (their epochs pooled for the time per epoch)")
    warmup_epochs: float | None = option(
        None, "every run's --warmup-epochs (default, per world size W: none at W <= 2, else min(W / 2, epochs / 2): "
        "with the linear-scaled rate from the first step DDP reaches 93 % at W = 4 where the asynchronous models "
        "reach 98 %, because the rate is too high for the synchronous ones, not because of the model)",
        metavar="EPOCHS",
    )
    progress: bool = option(True, "print a line as each run starts", negate="--no-progress", negate_only=True)
    backend: str | None = option(
        None, "the runs' process group backend (default: nccl with CUDA, one GPU per worker, else gloo); gloo on a "
        "GPU machine lets more workers than GPUs share them"
    )
    json_path: Path | None = option(None, "also write every run's results to this JSON file", flags=["--json"])
    plot: Path | None = option(None, "write a PNG of test accuracy against training time, per strategy")

    def __post_init__(self) -> None:
        self.strategies, self.world_sizes = tuple(self.strategies), tuple(self.world_sizes)
        if not self.strategies:
            raise ConfigError("--strategies: name at least one")
        for spec in self.strategies:
            name, staleness = parse_run(spec)
            if name not in STRATEGIES:
                raise ConfigError(f"--strategies {spec!r}: {name!r} is not a strategy of ddpkit train (choose among "
                                  f"{', '.join(STRATEGIES)}, with :S for a staleness bound)")
            if staleness is not None and name not in ("ps-async", "ssp"):
                raise ConfigError(f"--strategies {spec!r}: a staleness bound fits ps-async and ssp only")
        if not self.world_sizes or min(self.world_sizes) < 2:
            raise ConfigError(f"--world-sizes {' '.join(map(str, self.world_sizes))}: each must be at least 2")
        if not 0 < self.target_accuracy <= 1:
            raise ConfigError(f"--target-accuracy {self.target_accuracy} must be in (0, 1]")
        if self.repeats < 1 or self.epochs < 1:
            raise ConfigError(f"--repeats {self.repeats} and --epochs {self.epochs} must be at least 1")
        for name, flag in (("json_path", "--json"), ("plot", "--plot")):
            if getattr(self, name) is not None:
                setattr(self, name, writable_file(getattr(self, name), flag))
        for world in self.world_sizes:  # every train setting checked now, not after the first runs
            self.train_config("ddp", world, Path(".")).check_world(world)

    def warmup_at(self, world: int) -> float:
        """The warm-up every run at ``world`` workers takes (see ``--warmup-epochs``)."""
        if self.warmup_epochs is not None:
            return self.warmup_epochs
        return 0.0 if world <= 2 else min(world / 2, self.epochs / 2)

    def train_config(self, spec: str, world: int, out: Path) -> TrainConfig:
        name, staleness = parse_run(spec)
        config = TrainConfig(
            model=self.model, dataset=self.dataset, data_dir=self.data_dir, epochs=self.epochs, seed=self.seed,
            strategy=name, staleness=staleness, nproc_per_node=world, straggler=self.straggler,
            num_servers=self.num_servers if name in ("ps-sync", "ps-async") else 1,
            local_sgd=self.local_sgd if name == "local-sgd" else None,
            output_dir=out, progress=False, checkpoint_every=0, keep_checkpoints=1, backend=self.backend,
        )
        # The training command's rule says whose rate is scaled (DiLoCo's inner rate is not: nothing to ramp to).
        warmup = self.warmup_at(world) if config.lr_scale(world, replicas=1) > 1 else 0.0  # (no DataParallel)
        return replace(config, warmup_epochs=warmup)


def parse_run(spec: str) -> tuple[str, int | None]:
    """``NAME[:S]`` as ``(NAME, S or None)``."""
    name, _, bound = spec.partition(":")
    if not bound:
        return name, None
    if not bound.isdigit():
        raise ConfigError(f"--strategies {spec!r}: the staleness after ':' must be a whole number >= 0")
    return name, int(bound)


@dataclass(kw_only=True)
class RunResult:
    """One strategy at one world size."""

    strategy: str
    world_size: int
    epoch_s: float
    epoch_iqr: tuple[float, float]
    time_to_target_s: float | None
    final_accuracy: float
    mb_per_step: float | None
    wait_ms_per_step: float
    max_wait_ms_per_step: float
    staleness_mean: float | None
    staleness_max: int | None
    max_lead: int | None
    steps: int
    warmup_epochs: float = 0.0
    """The runs' ``--warmup-epochs``."""
    curves: list[list[tuple[float, float]]] = field(default_factory=list)
    """Per repeat: (training time so far, test accuracy) after each epoch."""


def _result(spec: str, world: int, runs: list[Path], target: float, warmup: float) -> RunResult:
    epochs, curves, finals, reach = [], [], [], []
    for out in runs:
        history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        elapsed, curve = 0.0, []
        for record in history:
            elapsed += record["epoch_time_s"]
            curve.append((round(elapsed, 3), record["test_accuracy"]))
        epochs += [r["epoch_time_s"] for r in history]
        curves.append(curve)
        finals.append(history[-1]["test_accuracy"])
        reach.append(next((t for t, acc in curve if acc >= target), None))
    summary = json.loads((runs[-1] / "summary.json").read_text())
    steps = summary["steps"]
    waits = [w / steps for w in summary.get("wait_s", [0.0])]
    per_rank = summary.get("per_rank") or []
    reached = [t for t in reach if t is not None]
    return RunResult(
        strategy=spec, world_size=world, epoch_s=statistics.median(epochs), epoch_iqr=quartiles(epochs),
        time_to_target_s=statistics.median(reached) if len(reached) == len(reach) else None,
        final_accuracy=statistics.median(finals), mb_per_step=summary.get("sent_mb_per_step"),
        wait_ms_per_step=1000 * statistics.mean(waits), max_wait_ms_per_step=1000 * max(waits),
        staleness_mean=statistics.mean(r["staleness_mean"] for r in per_rank) if per_rank else None,
        staleness_max=max(r["staleness_max"] for r in per_rank) if per_rank else None,
        max_lead=max(r["max_lead"] for r in per_rank) if per_rank and "max_lead" in per_rank[0] else None,
        steps=steps, warmup_epochs=warmup, curves=curves,
    )


def run(cfg: ConsistencyBenchConfig) -> list[RunResult]:
    """Train every run (see the module notes), print the table, write the JSON and the plot."""
    from ddpkit.train.loop import train

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in cfg.world_sizes:
            dirs: dict[str, list[Path]] = {spec: [] for spec in cfg.strategies}
            for r in range(cfg.repeats):
                shift = r % len(cfg.strategies)
                for spec in cfg.strategies[shift:] + cfg.strategies[:shift]:
                    out = Path(tmp) / f"w{world}-{spec.replace(':', '-s')}-{r}"
                    if cfg.progress:
                        print(f"ddpkit bench strategies: {spec} at world size {world}"
                              + (f", repeat {r + 1} of {cfg.repeats}" if cfg.repeats > 1 else ""), file=sys.stderr,
                              flush=True)
                    train(cfg.train_config(spec, world, out))
                    dirs[spec].append(out)
            results += [_result(spec, world, dirs[spec], cfg.target_accuracy,
                                cfg.train_config(spec, world, Path(".")).warmup_epochs or 0.0)
                        for spec in cfg.strategies]
    print(format_runs(results, cfg), flush=True)
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps({"settings": plain(cfg), "runs": [asdict(r) for r in results]},
                                            indent=2) + "\n")
    if cfg.plot is not None:
        plot(results, cfg)
    return results


def format_runs(rows: list[RunResult], cfg: ConsistencyBenchConfig) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    rates = "; ".join(
        f"world {w}: lr {base:g} x {w} = {base * w:g}"
        + (f", reached over {cfg.warmup_at(w):g} epochs of warm-up" if cfg.warmup_at(w) else ", no warm-up")
        for w in sorted({r.world_size for r in rows}) for base in (cfg.train_config("ddp", w, Path(".")).lr,))
    lines = [
        *note_lines(f"consistency models: {cfg.model} on {cfg.dataset}, {cfg.epochs} epochs, seed {cfg.seed}"
                    + (f", straggler {cfg.straggler}" if cfg.straggler else "")
                    + f"; target accuracy {cfg.target_accuracy:.0%}"),
        *note_lines("learning rates (the same for every strategy of a world size"
                    + (", but DiLoCo's inner one: --lr, unscaled, without warm-up"
                       if any(parse_run(spec)[0] == "diloco" for spec in cfg.strategies) else "")
                    + f"): {rates}"),
        f"{'world':>5} {'strategy':<12} {'s/epoch':>8} {'IQR':>13} {'to target':>9} {'accuracy':>8}",
    ]
    lines += [f"{r.world_size:>5} {r.strategy:<12} {r.epoch_s:>8.3f} {r.epoch_iqr[0]:>6.3f}-{r.epoch_iqr[1]:<6.3f} "
              f"{num(r.time_to_target_s, '.2f'):>9} {100 * r.final_accuracy:>7.2f}%" for r in rows]
    lines += ["", f"{'world':>5} {'strategy':<12} {'MB/step':>8} {'wait ms/step':>12} {'max':>7} {'staleness':>9} "
                  f"{'max':>4} {'lead':>4}"]
    lines += [f"{r.world_size:>5} {r.strategy:<12} {num(r.mb_per_step, '.3f'):>8} {r.wait_ms_per_step:>12.2f} "
              f"{r.max_wait_ms_per_step:>7.2f} {num(r.staleness_mean, '.2f'):>9} {num(r.staleness_max, 'd'):>4} "
              f"{num(r.max_lead, 'd'):>4}" for r in rows]
    lines += note_lines(
        "s/epoch: median training time of an epoch (IQR over epochs); to target: training seconds until the first "
        "evaluation at the target ('-': never); MB/step: payload a rank hands to collectives or servers per step; "
        "wait: ms per step blocked on the others (mean over ranks, and the most); staleness: of the gradients "
        "applied (mean, max); lead: steps a worker ran ahead of the slowest (servers)"
    )
    return "\n".join(lines)


def plot(rows: list[RunResult], cfg: ConsistencyBenchConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r.world_size for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.2), squeeze=False, sharey=True)
    for ax, world in zip(axes[0], worlds):
        for r in (r for r in rows if r.world_size == world):
            t, acc = zip(*r.curves[0])
            ax.plot(t, [100 * a for a in acc], marker="o", markersize=3, label=r.strategy)
        ax.axhline(100 * cfg.target_accuracy, color="grey", linewidth=0.8, linestyle="--")
        ax.set_title(f"{world} workers" + (f", straggler {cfg.straggler}" if cfg.straggler else ""))
        ax.set_xlabel("training time (s)")
        ax.set_ylim(max(0.0, 100 * cfg.target_accuracy - 17), 100)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy (%)")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(cfg.plot, dpi=110)
    plt.close(fig)
    print(f"plot: {cfg.plot}", flush=True)

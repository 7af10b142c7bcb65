"""``BenchConfig``: the settings of ``ddpkit bench`` (torch-free, so the CLI builds fast)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddpkit.parallel.common.bucket_caps import check_bucket_cap
from ddpkit.runtime.options import ConfigError, option, writable_file

WORKLOADS = ("convnet", "mlp", "resnet", "transformer", "linear200", "dp", "strategies")
"""``resnet``: a ResNet-8 with BatchNorm (buffers broadcast every step); ``transformer``: a 6-layer
encoder, d_model 256; ``linear200``: 200 ``Linear(16, 16)`` layers
(Python cost per parameter); ``dp``: DataParallel against DDP at ``world_size`` replicas (ConvNet,
``samples_per_rank`` each); ``strategies``: DDP, DistributedOptimizer, local SGD and PowerSGD on ddpkit's engine
(step time and bytes sent, on ``--strategy-workloads``)."""
STRATEGY_WORKLOADS = ("convnet", "mlp", "resnet", "transformer", "linear200")


@dataclass(kw_only=True)
class WorkloadSizes:
    """The sizes of the workloads' models and batches (:func:`ddpkit.bench.workloads.workload` reads them), shared
    by ``ddpkit bench`` and ``ddpkit bench backends``."""

    samples_per_rank: int = option(100, "ConvNet batch per rank")
    mlp_hidden: int = option(4640, "MLP hidden width (4640: about 25 M parameters)")
    mlp_batch: int = option(32, "MLP batch per rank")
    transformer_batch: int = option(8, "transformer sequences (32 tokens each) per rank")
    resnet_batch: int = option(32, "ResNet batch per rank (28x28 images)")


@dataclass(kw_only=True)
class BenchConfig(WorkloadSizes):
    """What ``ddpkit bench`` runs."""

    workloads: tuple[str, ...] = option(WORKLOADS, f"workloads, among {', '.join(WORKLOADS)}", metavar="NAME")
    steps: int = option(40, "timed steps per engine and workload")
    warmup: int = option(5, "untimed steps per engine first (bucket rebuild, allocator, caches)")
    block: int = option(1, "steps an engine runs before the other takes over")
    world_size: int = option(2, "ranks (processes, gloo, one thread each)")
    bucket_cap_mb: float | None = option(
        None, "bucket cap of both engines, in MiB (default: their default, 25 MiB with a first bucket of 1 MiB; "
        "a value given caps the first bucket too, as in torch)"
    )
    compile: bool = option(
        False, "run each engine's model under torch.compile (and the plain module the overlap compares with); "
        "the warm-up steps, at least 3, compile; the dp and strategies workloads are skipped"
    )
    compile_backend: str = option(
        "inductor", "torch.compile's backend with --compile (inductor needs a C++ compiler; aot_eager does not)",
        metavar="NAME",
    )
    strategy_workloads: tuple[str, ...] = option(
        ("convnet", "mlp"), "the models the strategies workload trains", metavar="NAME"
    )
    local_sgd_period: int = option(4, "strategies: local SGD averages the parameters every this many steps")
    powersgd_rank: int = option(2, "strategies: PowerSGD's matrix approximation rank")
    scaling: bool = option(
        False, "measure scaling instead: step time and throughput of --workloads' DDP workloads (dp and strategies "
        "are not swept) at each of --world-sizes (weak: the same batch per rank; strong: the same global batch), "
        "and step time and ratio of MLPs of --mlp-sizes parameters"
    )
    world_sizes: tuple[int, ...] = option(
        (), "world sizes of --scaling (default: 1 to the CPU count) and of --zero (default: 2 and 3)", metavar="N"
    )
    mlp_sizes: tuple[float, ...] = option(
        (1e6, 5e6, 25e6, 100e6), "parameter counts of --scaling's MLPs (the model-size sweep, at --world-size)",
        metavar="PARAMS",
    )
    plot: Path | None = option(
        None, "--scaling: write the plots here (default bench-scaling.png): throughput and efficiency against "
        "world size, and beside it NAME-sizes.png, step time and ratio against parameters"
    )
    target_spread: float = option(
        0.0, "keep adding rounds past --steps until the ratio's IQR, relative to its median, is at most this "
        "(e.g. 0.02), or --time-budget is spent (0: exactly --steps)", metavar="FRACTION",
    )
    time_budget: float = option(
        300.0, "with --target-spread: seconds one workload may run before the bench stops adding rounds",
        metavar="SECONDS",
    )
    progress: bool = option(
        True, "show progress on stderr: a bar on a terminal, one line per workload otherwise",
        negate="--no-progress", negate_only=True,
    )
    memory: bool = option(
        False, "also measure each engine's peak memory per rank, each engine and workload in processes of its own"
    )
    device: str = option(
        "cpu", "cpu (gloo, one thread per rank) or cuda (NCCL, one GPU per rank: --world-size at most the GPU "
        "count; dp runs DataParallel over --world-size GPUs in one process against DDP); also times both engines "
        "with a no-op comm hook and reports each engine's peak GPU memory",
        choices=["cpu", "cuda"],
    )
    engine_cost: bool = option(
        False, "also time both engines with the same no-op comm hook, so that neither communicates and the ratio is "
        "the engines' own cost (always on with --device cuda: at world 1 ddpkit skips the all-reduce that torch's "
        "DDP still runs, so the plain ratio flatters ddpkit there); and report what each engine adds to the plain "
        "model's step, in us per step, per parameter and per bucket, and in aten operations dispatched per step "
        "(torch's DDP also with batched_grad_copy where this torch has it)"
    )
    zero: bool = option(
        False, "instead of the engine table: ZeRO's table, per-rank MB of parameters, gradients and optimizer "
        "state, peak memory and step time of DDP and ZeRO stages 1 and 2, ddpkit's and torch's, AdamW, at "
        "--world-sizes (2 and 3), on the transformer and the MLP of --workloads"
    )
    zero_cap_mb: float = option(
        0.0, "with --zero, instead of its table: each rank under a memory cap of this many MB (a memory cgroup: "
        "root, or a delegated cgroup), a stack of Linear layers 1.5 times the cap trained by DDP (the control) and "
        "by ZeRO stage 3 at --world-sizes (2 and 4); whether each trained or the kernel killed it, and its peak",
        metavar="MB",
    )
    trace: Path | None = option(
        None, "write a Chrome trace (Perfetto, chrome://tracing) of extra traced steps of both engines: forward, "
        "backward, each bucket's all-reduce, the wait, the optimizer, one track per rank", metavar="FILE",
    )
    json_path: Path | None = option(
        None, "also write the results, settings, versions and machine load to this JSON file", flags=["--json"]
    )
    report: Path | None = option(
        None, "write a report to this directory: the JSON, the traces, the plots and summary.md (tables and "
        "pictures to read)", metavar="DIR",
    )

    def _refuse_unread(self) -> None:
        """Flags that the measurement asked for never reads (before ``--report`` fills in its defaults)."""
        if self.scaling and not any(w in STRATEGY_WORKLOADS for w in self.workloads):
            raise ConfigError(f"--scaling sweeps the DDP workloads ({', '.join(STRATEGY_WORKLOADS)}), and --workloads "
                              f"{' '.join(self.workloads)} has none: add one")
        unread = {"--trace": self.trace is not None} if self.scaling else {}
        if self.zero:
            unread = {"--trace": self.trace is not None, "--engine-cost": self.engine_cost, "--memory": self.memory,
                      "--block": self.block != 1, "--target-spread": self.target_spread != 0.0,
                      "--time-budget": self.time_budget != 300.0}
        for flag, given in unread.items():
            if given:
                raise ConfigError(f"{flag} does not apply to --zero, which measures its own table (steps, warm-up and "
                                  f"the bucket cap are what it reads): drop {flag}" if self.zero else
                                  f"{flag} does not apply to --scaling, whose sweeps record no trace: drop {flag}")
        if self.plot is not None and not self.scaling:
            raise ConfigError("--plot draws --scaling's sweeps: add --scaling, or drop --plot")

    @property
    def measures_engine_cost(self) -> bool:
        """Whether the engines are also timed with the no-op comm hook (``--engine-cost``, or ``--device cuda``)."""
        return self.engine_cost or self.device == "cuda"

    def __post_init__(self) -> None:
        self.workloads = tuple(self.workloads)
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        if unknown or not self.workloads:
            raise ConfigError(f"--workloads {' '.join(self.workloads)}: choose among {', '.join(WORKLOADS)}")
        self.strategy_workloads = tuple(self.strategy_workloads)
        unknown = [w for w in self.strategy_workloads if w not in STRATEGY_WORKLOADS]
        if unknown or not self.strategy_workloads:
            raise ConfigError(f"--strategy-workloads {' '.join(self.strategy_workloads)}: choose among "
                              f"{', '.join(STRATEGY_WORKLOADS)}")
        for name in ("steps", "warmup", "block", "world_size", "samples_per_rank", "mlp_hidden", "mlp_batch",
                     "transformer_batch", "resnet_batch", "local_sgd_period", "powersgd_rank"):
            value = getattr(self, name)
            if value < (0 if name == "warmup" else 1):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} {value} must be {'0 or more' if name == 'warmup' else 'at least 1'}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device {self.device!r}: use cpu or cuda")
        if self.device == "cuda" and (self.scaling or self.memory or self.zero):
            what = "--scaling" if self.scaling else "--memory" if self.memory else "--zero"
            raise ConfigError(f"{what} measures CPU processes (gloo, resident memory); drop it with --device cuda")
        if self.zero and (self.scaling or self.compile):
            raise ConfigError(f"--zero measures its own table; drop {'--scaling' if self.scaling else '--compile'}")
        if self.zero_cap_mb:
            from ddpkit.bench.runners.memory_cap import unavailable

            if not self.zero or not self.zero_cap_mb > 0:
                raise ConfigError(f"--zero-cap-mb {self.zero_cap_mb:g} needs --zero and a positive number of MB")
            if (why := unavailable()) is not None:
                raise ConfigError(f"--zero-cap-mb: no memory cap can be made here ({why})")
        if self.zero and not any(w in ("transformer", "mlp") for w in self.workloads):
            raise ConfigError(f"--zero runs the transformer and the MLP, and --workloads {' '.join(self.workloads)} "
                              "has neither: add one")
        if self.compile and (self.scaling or self.memory):
            raise ConfigError(f"--compile times the DDP workloads' steps; drop "
                              f"{'--scaling' if self.scaling else '--memory'}"
                              ", which it does not apply to")
        if self.compile_backend != "inductor" and not self.compile:
            raise ConfigError(f"--compile-backend {self.compile_backend}: add --compile, or leave the backend out")
        try:
            check_bucket_cap(self.bucket_cap_mb, "--bucket-cap-mb")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.target_spread < 0:
            raise ConfigError(f"--target-spread {self.target_spread} must be 0 (off) or a positive fraction")
        if not self.time_budget > 0:
            raise ConfigError(f"--time-budget {self.time_budget} must be a positive number of seconds")
        self.world_sizes = tuple(self.world_sizes)
        self.mlp_sizes = tuple(self.mlp_sizes)
        if any(w < 1 for w in self.world_sizes):
            raise ConfigError(f"--world-sizes {' '.join(map(str, self.world_sizes))}: each must be at least 1")
        if self.world_sizes and not (self.scaling or self.zero):
            raise ConfigError(f"--world-sizes {' '.join(map(str, self.world_sizes))} applies to --scaling and --zero: "
                              "add one, or set the engine table's ranks with --world-size")
        if self.zero and min(self.world_sizes, default=2) < 2:
            raise ConfigError(f"--zero --world-sizes {' '.join(map(str, self.world_sizes))}: each must be at least 2 "
                              "(ZeRO shards over the ranks; at world 1 there is nothing to shard)")
        if any(not p >= 1e3 for p in self.mlp_sizes):
            raise ConfigError(f"--mlp-sizes {' '.join(f'{p:g}' for p in self.mlp_sizes)}: each must be at least "
                              "1000 parameters")
        self._refuse_unread()
        if self.json_path is not None:
            self.json_path = writable_file(self.json_path, "--json")
        if self.report is not None:
            self.report = Path(self.report)
            if self.report.exists() and not self.report.is_dir():
                raise ConfigError(f"--report {str(self.report)!r} is a file: give a directory")
            try:
                self.report.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"--report {str(self.report)!r} cannot be created ({e.strerror}): choose another "
                                  "directory") from None
            writable_file(self.report / "summary.md", "--report")
            self.json_path = self.json_path or self.report / "bench.json"
            self.trace = self.trace or self.report / "trace.json"
            self.plot = self.plot or self.report / "scaling.png"
        if self.trace is not None:
            self.trace = writable_file(self.trace, "--trace")
        if self.plot is not None:
            self.plot = writable_file(self.plot, "--plot")

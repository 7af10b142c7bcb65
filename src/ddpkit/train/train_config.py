"""``TrainConfig``: the settings of ``ddpkit train``, in a module of its own.

Kept free of torch so that building the ``ddpkit`` argument parser (which
reads these fields) costs nothing: ``ddpkit launch`` starts its workers
without importing torch in the launcher process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpkit.integrations import tensorboard
from ddpkit.runtime.options import ConfigError, option, plain, writable_file

TEXT_MODELS = ("gpt", "gpt-10m", "gpt-25m")
"""Names of :data:`ddpkit.models.registry.LANGUAGE_MODELS`: the GPT at 0.8 M, 10.7 M and 25.3 M parameters."""
MODELS = ("convnet", "mlp", "resnet", *TEXT_MODELS)
"""Names of :data:`ddpkit.models.MODELS` (a test keeps the two in step)."""
DATASETS = ("digits", "mnist", "synthetic", "shakespeare")
"""Names of :data:`ddpkit.data.DATASETS` (a test keeps the two in step)."""
ENGINES = ("ddpkit", "torch", "single", "dp")
"""Engines that start one process: ``single`` and ``dp`` (DataParallel over the devices)."""
OPTIMIZERS = ("sgd", "adamw")
STRATEGIES = ("ddp", "optimizer", "local-sgd", "diloco", "ps-sync", "ps-async", "ssp")
"""How ``--engine ddpkit`` synchronises the replicas."""
SERVER_STRATEGIES = ("ps-sync", "ps-async")
"""Strategies whose parameters live on parameter servers (``--num-servers``)."""
SSP_STALENESS = 2
"""``--strategy ssp``'s staleness bound when ``--staleness`` is not given."""
AMP_MODES = ("off", "bf16", "fp16")
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd", "auto")
"""``--comm-hook``: DDP's gradient reduction (:mod:`ddpkit.hooks`), on ddpkit's engine or torch's."""
DILOCO_CODECS = ("fp32", "bf16", "int8", "int4")
"""``--outer-codec``: :data:`ddpkit.parallel.diloco.CODECS` (a test keeps the two in step)."""
DILOCO_SYNC_EVERY = 100
"""``--strategy diloco``'s H when ``--sync-every`` is not given."""
CHECKPOINT_EVERY = 50
"""``--checkpoint-every``'s default: a checkpoint every 50 optimizer steps within an epoch, and at its end."""
KEEP_CHECKPOINTS = 3
"""``--keep-checkpoints``'s default."""


INERT = {"momentum": lambda c: c.get("optimizer", "sgd") != "sgd",
         "powersgd_rank": lambda c: c.get("comm_hook", "none") != "powersgd",
         "powersgd_start": lambda c: c.get("comm_hook", "none") != "powersgd",
         "local_sgd_warmup": lambda c: c.get("strategy", "ddp") != "local-sgd",
         "sync_bn": lambda c: c.get("engine", "ddpkit") == "dp"}
"""Settings a run saved before 2026-12-01 may hold where they changed nothing (refused there since), by whether
the saved settings made them so."""


def without_inert(saved: dict[str, Any]) -> dict[str, Any]:
    """A run's saved settings with those it held to no effect (:data:`INERT`) left out, so that resuming it takes
    their defaults (and compares them as such) instead of refusing a flag the user never gave."""
    return {k: v for k, v in saved.items() if not (k in INERT and INERT[k](saved))}


@dataclass(kw_only=True)
class TrainConfig:
    """Everything ``ddpkit train`` needs; the CLI builds exactly this."""

    model: str = option("convnet", "the model (gpt, gpt-10m, gpt-25m: the GPT at 0.8 M, 10.7 M, 25.3 M parameters, "
                        "on --dataset shakespeare)", choices=tuple(MODELS))
    dataset: str = option("digits", "the dataset", choices=DATASETS)
    data_dir: Path | None = option(None, "folder of the MNIST IDX files (--dataset mnist), or of tiny "
                                   "Shakespeare's input.txt (--dataset shakespeare)")
    download: bool = option(False, "download missing MNIST files into --data-dir (needs network)")
    synthetic_samples: int = option(2048, "training samples of --dataset synthetic")
    train_samples: int | None = option(None, "train on the first N samples of the training split only (default all)",
                                       metavar="N")
    test_samples: int | None = option(None, "evaluate on the first N samples of the test split only (default all)",
                                      metavar="N")
    epochs: int = option(8, "epochs to train (in total, when resuming)")
    batch_size: int = option(32, "batch size per process")
    lr: float = option(0.02, "learning rate for one process; multiplied by the world size (with --strategy diloco "
                       "the inner optimizer's, not multiplied: each worker steps on its own batch)")
    warmup_epochs: float | None = option(
        None, "reach the scaled learning rate gradually: from --lr (one process's) linearly to --lr x world size over "
        "this many epochs, step by step (Goyal et al.'s gradual warm-up for large global batches); 0: the scaled "
        "rate from the first step. Default: none when the rate is scaled 2 times or less, else half an epoch per "
        "time it is scaled (W / 2 epochs at world W: from 3 processes the scaled rate diverges at the first steps). "
        "A rate not scaled (one process without DataParallel's replicas) has nothing to ramp to and takes none; "
        "--strategy diloco, whose inner rate is not scaled, refuses the flag",
        metavar="EPOCHS",
    )
    optimizer: str = option("sgd", "sgd (with momentum) or adamw", choices=OPTIMIZERS)
    momentum: float = option(0.9, "SGD momentum")
    weight_decay: float = option(0.0, "weight decay")
    seed: int = option(0, "seed of the model's initialisation and of the data order")
    amp: str = option("off", "autocast: bf16 (CPU or CUDA), fp16 (CUDA, loss scaling)", choices=AMP_MODES)
    grad_accum: int = option(1, "micro-batches per optimizer step (no_sync on all but the last; --on-failure "
                             "continue: each worker's share of a step in that many micro-batches)")
    sync_bn: bool = option(False, "convert the model's BatchNorm layers to ddpkit.SyncBatchNorm (global-batch "
                           "statistics)")
    engine: str = option(
        "ddpkit", "ddpkit's DDP, torch's DDP (comparison), single (one process), dp (ddpkit.DataParallel in one "
        "process: one replica per GPU, else --nproc-per-node CPU replicas in threads)", choices=ENGINES,
    )
    strategy: str = option(
        "ddp", "how --engine ddpkit keeps the replicas together: ddp (DistributedDataParallel: gradients averaged "
        "every step), optimizer (ddpkit.DistributedOptimizer, Horovod's way: the same averages, the optimizer "
        "wrapped instead of the model), local-sgd (ddpkit.LocalSGD: each process steps alone, parameters "
        "averaged every --local-sgd steps), diloco (ddpkit.DiLoCo: each process steps alone, an outer Nesterov step "
        "on the averaged change every --sync-every steps), ps-sync (parameter servers: every step waits for all "
        "workers' gradients), ps-async (parameter servers apply each gradient as it arrives; --staleness bounds the "
        "lead), ssp (stale-synchronous, no server: all-reduces in flight, at most --staleness steps old)",
        choices=STRATEGIES,
    )
    staleness: int | None = option(
        None, "--strategy ps-async: no worker more than S steps ahead of the slowest (default: no bound); "
        f"--strategy ssp: the same bound, decentralised (default {SSP_STALENESS}); 0 is synchronous", metavar="S",
    )
    num_servers: int = option(
        1, "--strategy ps-sync/ps-async: parameter server processes, the parameters sharded over them by tensor",
        metavar="K",
    )
    ps_replication: int = option(
        1, "--strategy ps-sync/ps-async with --on-failure continue: each key range of the parameters lives on R of "
        "the servers (chain replication), so the run survives R - 1 servers' deaths", metavar="R",
    )
    straggler: str | None = option(
        None, "slow one worker down: RANK:FACTOR makes each of its steps FACTOR times as long (a sleep after its "
        "forward and backward), to see how each strategy copes", metavar="RANK:FACTOR",
    )
    comm_hook: str = option(
        "none", "how --strategy ddp reduces each gradient bucket (ddpkit.hooks, on --engine ddpkit or torch): none "
        "(all-reduce in the gradients' dtype), fp16 or bf16 (averaged in half precision: half the bytes), powersgd "
        "(low-rank compression at --powersgd-rank from step --powersgd-start; on --engine ddpkit a resumed run goes "
        "on with its compression state, bit-identical), auto (one of these chosen from the measured link and the "
        "step times as training runs, printed once with the flags that pin it, kept by --engine ddpkit's checkpoints; "
        "auto:LIST chooses among the exact all-reduce and LIST, e.g. auto:bf16,powersgd:4,powersgd:8; see "
        "docs/comm-auto.md)", metavar="{" + ",".join(COMM_HOOKS) + ",auto:LIST}",
    )
    powersgd_rank: int = option(1, "--comm-hook powersgd: rank of the approximation (torch's default 1)", metavar="R")
    powersgd_start: int = option(
        10, "--comm-hook powersgd: optimizer steps averaged exactly before compression starts (at least 2)",
        metavar="STEPS",
    )
    compile: bool = option(
        False, "run the model's forward under torch.compile (inductor: needs a C++ compiler; dynamic=False, a "
        "kernel per batch shape, so that a restarted or replacement process computes the bits the others do); every "
        "process compiles it in its first steps, a restarted one again",
    )
    deterministic: bool = option(
        False, "deterministic algorithms (torch.use_deterministic_algorithms, cuDNN's deterministic kernels, "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8): two runs on a GPU give the same bits (slower; on the CPU they do anyway)",
    )
    zero: int = option(
        0, "ZeRO stage with --strategy ddp: 0 (every rank keeps everything), 1 (each rank keeps the optimizer "
        "state of its share of the parameters: ddpkit.ZeroRedundancyOptimizer), 2 (also only its share of the "
        "averaged gradients: DistributedDataParallel(zero_stage=2)), 3 (also only its share of the parameters, "
        "gathered layer by layer: DistributedDataParallel(zero_stage=3))", choices=[0, 1, 2, 3],
    )
    local_sgd: int | None = option(
        None, "average the parameters every H optimizer steps (implies --strategy local-sgd; default 4 with it)",
        metavar="H",
    )
    local_sgd_warmup: int = option(0, "--strategy local-sgd: synchronous DDP steps before the local steps start")
    sync_every: int | None = option(
        None, "inner optimizer steps between DiLoCo's outer steps (implies --strategy diloco; default "
        f"{DILOCO_SYNC_EVERY} with it)", metavar="H",
    )
    outer_lr: float = option(0.7, "--strategy diloco: the outer optimizer's learning rate (SGD with Nesterov)")
    outer_momentum: float = option(0.9, "--strategy diloco: the outer optimizer's momentum (0: plain SGD)")
    fragments: int = option(
        1, "--strategy diloco: synchronise the model in P fragments on a staggered schedule (streaming DiLoCo: "
        "each exchange sends 1/P of the model)", metavar="P",
    )
    fragment_delay: int = option(
        0, "--strategy diloco: inner steps each fragment's exchange overlaps before it is applied (tau, less than "
        "--sync-every)", metavar="TAU",
    )
    fragment_mixing: float = option(
        0.0, "--strategy diloco: share of its own parameters a fragment keeps when it takes the new global ones "
        "(alpha; 0 takes them whole)", metavar="ALPHA",
    )
    outer_codec: str = option(
        "fp32", "--strategy diloco: how the outer gradients travel: fp32, bf16, int8 or int4 (block-wise, a scale "
        "per 128 numbers)", choices=DILOCO_CODECS,
    )
    nproc_per_node: int | None = option(
        None, "workers to start (default: one per GPU, else 2); ignored under a launcher"
    )
    backend: str | None = option(None, "process group backend (default: nccl with CUDA, else gloo)")
    output_dir: Path | None = option(None, "run directory (default: a new runs/<dataset>-<model>[-N])")
    checkpoint_every: int = option(
        CHECKPOINT_EVERY, "also checkpoint every N optimizer steps within an epoch (0: at epoch ends only)"
    )
    keep_checkpoints: int = option(
        KEEP_CHECKPOINTS, "checkpoints kept in <output-dir>/checkpoints; older ones are deleted"
    )
    max_restarts: int = option(
        0, "restart the workers this started up to N times after a failure, resuming from the newest "
        "checkpoint (under a launcher, use the launcher's --max-restarts)"
    )
    on_failure: str = option(
        "restart", "what a worker's death does: restart (every worker restarts from the newest checkpoint, "
        "--max-restarts times) or continue (the survivors go on in the same processes, each step's global batch "
        "spread over them; --max-restarts replacements join live, and when no worker holding the state is left, as "
        "many restarts of all from the newest checkpoint; see ddpkit.FaultTolerance)",
        choices=["restart", "continue"],
    )
    deterministic_shards: int | None = option(
        None, "--on-failure continue: cut every step's global batch into V shards reduced in a fixed order, so a "
        "run with any deaths ends bitwise equal to the run without (default: V = the world size, reduced by an "
        "all-reduce: equal within float rounding; with --grad-accum N, N times the world size)", metavar="V",
    )
    resume: bool = option(False, "continue the run in --output-dir from its newest checkpoint")
    progress: bool = option(True, "show a progress bar on rank 0", negate="--no-progress", negate_only=False)
    trace: Path | None = option(
        None, "write a Chrome trace (Perfetto, chrome://tracing) of the first --trace-steps optimizer steps: data, "
        "forward, backward, each bucket's all-reduce, the wait, the optimizer, one track per rank", metavar="FILE",
    )
    trace_steps: int = option(50, "optimizer steps --trace records")
    tensorboard: Path | None = option(
        None, "also write TensorBoard event files to DIR: each epoch's train/test loss, test accuracy, lr and "
        "throughput, at its optimizer step (needs the tensorboard package: pip install 'ddpkit[tensorboard]')",
        metavar="DIR",
    )

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                flag, value = "--" + name.replace("_", "-"), getattr(self, name)
                raise ConfigError(f"{flag} {rule}" if value is True else f"{flag} {value!r} {rule}")

        need(self.model in MODELS, "model", f"is not a model: choose one of {', '.join(MODELS)}")
        need(self.dataset in DATASETS, "dataset", f"is not a dataset: choose one of {', '.join(DATASETS)}")
        need(self.engine in ENGINES, "engine", f"is not an engine: choose one of {', '.join(ENGINES)}")
        need(self.strategy in STRATEGIES, "strategy", f"is not a strategy: choose one of {', '.join(STRATEGIES)}")
        need(self.local_sgd is None or self.local_sgd >= 1, "local_sgd", "must be at least 1 (steps between averages)")
        need(self.local_sgd_warmup >= 0, "local_sgd_warmup", "must be 0 or more")
        if self.local_sgd is not None:
            need(self.strategy in ("ddp", "local-sgd"), "local_sgd",
                 f"does not fit --strategy {self.strategy}: drop one")
            self.strategy = "local-sgd"
        elif self.strategy == "local-sgd":
            self.local_sgd = 4
        need(self.local_sgd_warmup == 0 or self.strategy == "local-sgd", "local_sgd_warmup",
             f"sets local SGD's synchronous start: it needs --strategy local-sgd (or --local-sgd H), not --strategy "
             f"{self.strategy}")
        if self.sync_every is not None:
            need(self.strategy in ("ddp", "diloco"), "sync_every", f"does not fit --strategy {self.strategy}: drop one")
            need(self.sync_every >= 1, "sync_every", "must be at least 1 (inner steps between outer steps)")
            self.strategy = "diloco"
        elif self.strategy == "diloco":
            self.sync_every = DILOCO_SYNC_EVERY
        need(self.outer_codec in DILOCO_CODECS, "outer_codec", f"is not a codec: choose one of "
             f"{', '.join(DILOCO_CODECS)}")
        diloco_set = [n for n, v in (("fragments", self.fragments != 1), ("fragment_delay", self.fragment_delay != 0),
                                     ("fragment_mixing", self.fragment_mixing != 0.0),
                                     ("outer_codec", self.outer_codec != "fp32"), ("outer_lr", self.outer_lr != 0.7),
                                     ("outer_momentum", self.outer_momentum != 0.9)) if v]
        for name in diloco_set:
            need(self.strategy == "diloco", name, f"sets DiLoCo's outer loop: it needs --strategy diloco (or "
                 f"--sync-every), not --strategy {self.strategy}")
        if self.strategy == "diloco":
            assert self.sync_every is not None
            need(1 <= self.fragments <= self.sync_every, "fragments", f"must be from 1 to --sync-every "
                 f"({self.sync_every}): every fragment synchronises once in H steps")
            need(0 <= self.fragment_delay < self.sync_every, "fragment_delay", f"must be from 0 to --sync-every - 1 "
                 f"({self.sync_every - 1}): an exchange ends before the fragment's next one begins")
            need(0.0 <= self.fragment_mixing <= 1.0, "fragment_mixing", "must be in [0, 1]")
            need(math.isfinite(self.outer_lr) and self.outer_lr > 0, "outer_lr", "must be a positive number")
            need(0.0 <= self.outer_momentum < 1.0, "outer_momentum", "must be in [0, 1)")
        need(self.strategy == "ddp" or self.engine == "ddpkit", "strategy",
             f"needs --engine ddpkit (it runs on ddpkit's engine), not --engine {self.engine}")
        if self.staleness is not None:
            need(self.strategy in ("ps-async", "ssp"), "staleness",
                 f"bounds --strategy ps-async or ssp, not --strategy {self.strategy}")
            need(self.staleness >= 0, "staleness", "must be 0 (synchronous) or more")
        elif self.strategy == "ssp":
            self.staleness = SSP_STALENESS
        need(self.num_servers >= 1, "num_servers", "must be at least 1")
        need(1 <= self.ps_replication <= self.num_servers, "ps_replication",
             f"must be between 1 and --num-servers {self.num_servers}")
        need(self.ps_replication == 1 or (self.strategy in SERVER_STRATEGIES and self.on_failure == "continue"),
             "ps_replication", "needs --strategy ps-sync|ps-async and --on-failure continue (only that mode's "
             "launcher tells the workers of a server's death)")
        need(self.num_servers == 1 or self.strategy in SERVER_STRATEGIES, "num_servers",
             f"needs --strategy ps-sync or ps-async, not --strategy {self.strategy}")
        need(self.strategy not in (*SERVER_STRATEGIES, "ssp") or self.amp != "fp16", "amp",
             f"does not fit --strategy {self.strategy}: the grad scaler needs the optimizer in this process; use "
             "--amp bf16")
        if self.straggler is not None:
            self.straggler = str(self.straggler)
            try:
                rank, factor = self.slow  # type: ignore[misc]
                ok = rank >= 0 and 1 <= factor < math.inf
            except ValueError:
                ok = False
            need(ok, "straggler", "is not RANK:FACTOR with a rank >= 0 and a factor >= 1 (e.g. 1:3)")
        need(self.zero in (0, 1, 2, 3), "zero", "is not a ZeRO stage: choose 0, 1, 2 or 3")
        need(not self.zero or (self.engine == "ddpkit" and self.strategy == "ddp"), "zero",
             f"needs --engine ddpkit --strategy ddp (ddpkit's DDP), not --engine {self.engine} "
             f"--strategy {self.strategy}")
        need(self.zero != 2 or self.amp != "fp16", "zero",
             f"does not fit --amp fp16: the grad scaler checks the gradients .grad holds, and stage {self.zero} "
             "keeps its shards elsewhere; use --amp bf16, or --zero 1 or 3 (whose sharded gradients the scaler "
             "checks on every rank)")
        if self.comm_hook.startswith("auto:"):
            from ddpkit.comm.schemes import parse_comm

            try:
                listed = parse_comm(self.comm_hook)
            except ValueError as e:
                raise ConfigError(f"--comm-hook {self.comm_hook!r}: {str(e).split(': ', 1)[-1]}") from None
            need(self.engine != "torch" or not any(s.name == "powersgd" for s in listed), "comm_hook",
                 "lists PowerSGD, whose collectives torch's DDP can issue in other orders on other ranks when "
                 "several buckets are in flight: leave powersgd out with --engine torch, or use --engine ddpkit")
        else:
            need(self.comm_hook in COMM_HOOKS, "comm_hook",
                 f"is not a comm hook: choose one of {', '.join(COMM_HOOKS)}, or auto:LIST (e.g. auto:bf16,powersgd:4)")
        if self.comm_hook != "none":
            need(self.strategy == "ddp" and self.engine in ("ddpkit", "torch"), "comm_hook",
                 f"reduces DDP's buckets: it needs --strategy ddp with --engine ddpkit or torch, not --engine "
                 f"{self.engine} --strategy {self.strategy}")
            need(self.zero < 2, "comm_hook", f"does not fit --zero {self.zero}, whose gradients are "
                 "reduce-scattered into shards: drop one of them")
        need(not self.comm_hook.startswith("auto") or not self.deterministic, "comm_hook",
             "auto chooses by the step times it measures, so two runs may choose apart and --deterministic's same "
             "bits every run cannot hold: pin the choice (the flags its line printed, e.g. --comm-hook powersgd "
             "--powersgd-rank 4) or drop --deterministic")
        need(self.powersgd_rank >= 1, "powersgd_rank", "must be at least 1")
        need(self.powersgd_start >= 2, "powersgd_start", "must be at least 2 (PowerSGD's error feedback and warm "
             "start need exact steps first, as torch's PowerSGDState)")
        for name, default in (("powersgd_rank", 1), ("powersgd_start", 10)):
            need(getattr(self, name) == default or self.comm_hook == "powersgd", name, "sets PowerSGD's hook: it needs "
                 f"--comm-hook powersgd, not --comm-hook {self.comm_hook}" + (" (auto tries ranks 16 and 32 after "
                 "its own exact start; to try others, list them: --comm-hook auto:powersgd:4,powersgd:8)"
                 if self.comm_hook.startswith("auto") else ""))
        need(self.optimizer in OPTIMIZERS, "optimizer", f"is not an optimizer: choose {' or '.join(OPTIMIZERS)}")
        need(self.amp in AMP_MODES, "amp", f"is not an autocast mode: choose one of {', '.join(AMP_MODES)}")
        need(self.epochs >= 1, "epochs", "must be at least 1")
        need(self.batch_size >= 1, "batch_size", "must be at least 1 (it is per process)")
        need(self.grad_accum >= 1, "grad_accum", "must be at least 1")
        need(self.lr > 0 and math.isfinite(self.lr), "lr", "must be a positive number")
        need(self.warmup_epochs is None or (self.warmup_epochs >= 0 and math.isfinite(self.warmup_epochs)),
             "warmup_epochs",
             "must be 0 (no warm-up) or a positive number of epochs")
        need(not self.warmup_epochs or self.strategy != "diloco", "warmup_epochs",
             "does not fit --strategy diloco: its inner rate is --lr itself, not scaled by the world size, so there "
             "is no scaled rate to ramp up to; drop --warmup-epochs")
        need(0 <= self.momentum < 1, "momentum", "must be in [0, 1)")
        need(self.momentum == 0.9 or self.optimizer == "sgd", "momentum", f"is SGD's: --optimizer {self.optimizer} "
             "has none of its own (AdamW's betas stay torch's defaults); drop --momentum or use --optimizer sgd")
        need(not (self.sync_bn and self.engine == "dp"), "sync_bn", "does not fit --engine dp: DataParallel's "
             "replicas share one process, and ddpkit.SyncBatchNorm synchronises across processes; use --engine "
             "ddpkit (each replica a process) or drop --sync-bn")
        need(self.weight_decay >= 0, "weight_decay", "must be non-negative")
        need(self.checkpoint_every >= 0, "checkpoint_every", "must be 0 (epoch ends only) or more")
        need(self.keep_checkpoints >= 1, "keep_checkpoints", "must be at least 1 (the newest is always kept)")
        need(self.max_restarts >= 0, "max_restarts", "must be 0 or more")
        need(self.backend in (None, "gloo", "nccl", "mpi"), "backend", "is not a backend: choose gloo, nccl or mpi")
        need(self.synthetic_samples >= 1, "synthetic_samples", "must be at least 1")
        need(self.nproc_per_node is None or self.nproc_per_node >= 1, "nproc_per_node", "must be at least 1")
        need(
            self.engine != "single" or self.nproc_per_node in (None, 1),
            "nproc_per_node", "does not fit --engine single, which trains in one process: drop one of them",
        )
        need(self.train_samples is None or self.train_samples >= 1, "train_samples", "must be at least 1")
        need(self.test_samples is None or self.test_samples >= 1, "test_samples", "must be at least 1")
        text = self.dataset == "shakespeare"
        need((self.model in TEXT_MODELS) == text, "model", f"does not read --dataset {self.dataset}: --model "
             "gpt, gpt-10m and gpt-25m read --dataset shakespeare (symbols), the others images")
        if text and self.data_dir is None:
            raise ConfigError("--dataset shakespeare needs --data-dir: point it at the folder of tiny Shakespeare's "
                              "input.txt (e.g. --data-dir ../shared/data/tinyshakespeare)")
        if self.dataset == "mnist" and self.data_dir is None:
            raise ConfigError(
                "--dataset mnist needs --data-dir: point it at the folder of the MNIST IDX files "
                "(e.g. --data-dir ../shared/data/mnist)"
            )
        if self.data_dir is not None:
            self.data_dir = Path(self.data_dir)
        if self.output_dir is not None:
            self.output_dir = Path(self.output_dir)
        self._check_on_failure(need)
        need(self.trace_steps >= 1, "trace_steps", "must be at least 1")
        need(self.trace is None or self.strategy not in (*SERVER_STRATEGIES, "ssp"), "trace",
             f"records DDP's buckets; --strategy {self.strategy} has none: drop --trace")
        if self.trace is not None:
            self.trace = writable_file(self.trace, "--trace")
        if self.tensorboard is not None:
            self.tensorboard = Path(self.tensorboard)
            tensorboard.check(self.tensorboard)

    def _check_on_failure(self, need: Any) -> None:
        need(self.on_failure in ("restart", "continue"), "on_failure", "is not restart or continue")
        if self.deterministic_shards is not None:
            need(self.on_failure == "continue", "deterministic_shards", "needs --on-failure continue")
            need(self.deterministic_shards >= 1, "deterministic_shards", "must be at least 1")
        if self.on_failure != "continue":
            return
        why = "does not fit --on-failure continue"
        need(self.engine == "ddpkit" and self.strategy in ("ddp", "ssp", "diloco", *SERVER_STRATEGIES), "on_failure",
             f"needs --engine ddpkit --strategy ddp (the survivors reduce the gradients themselves), ps-sync|"
             f"ps-async (the servers step), ssp or diloco, not --engine {self.engine} --strategy {self.strategy}")
        if self.strategy in SERVER_STRATEGIES:
            need(self.deterministic_shards is None, "deterministic_shards", f"{why} with --strategy "
                 f"{self.strategy}: the servers apply each worker's gradient, there are no shards to order")
            need(self.max_restarts == 0, "max_restarts", f"{why} with --strategy {self.strategy}: a replacement "
                 "cannot take a seat in the parameter servers' channel; the workers left go on")
        if self.strategy in (*SERVER_STRATEGIES, "ssp", "diloco"):
            need(not self.resume, "resume", f"{why} with --strategy {self.strategy}: the state lives in the "
                 "surviving processes only (no checkpoint is written); use --strategy ddp for a run that can resume")
            for name, default in (("checkpoint_every", CHECKPOINT_EVERY), ("keep_checkpoints", KEEP_CHECKPOINTS)):
                need(getattr(self, name) == default, name, f"{why} with --strategy {self.strategy}: its workers write "
                     "no checkpoints (the state lives in the surviving processes only); drop it, or use --strategy "
                     "ddp for a run that checkpoints")
        if self.strategy == "ssp":
            need(self.deterministic_shards is None, "deterministic_shards", f"{why} with --strategy ssp: each worker "
                 "applies its own gradient at once, there are no shards to order")
            need(self.max_restarts == 0, "max_restarts", f"{why} with --strategy ssp: nothing would hand a "
                 "replacement the training state; the workers left go on")
        if self.strategy == "diloco":
            need(self.deterministic_shards is None, "deterministic_shards", f"{why} with --strategy diloco: each "
                 "worker steps alone between outer steps, there are no shards to order")
            need(self.max_restarts == 0, "max_restarts", f"{why} with --strategy diloco: a replacement would need "
                 "another worker's data and inner state; the workers left go on")
            need(self.fragments == 1 and self.fragment_delay == 0, "fragments", f"{why}: streaming DiLoCo "
                 "(--fragments > 1 or --fragment-delay > 0) keeps exchanges in flight across a death; use "
                 "--fragments 1 --fragment-delay 0")
        need(self.zero == 0, "zero", f"{why}: a ZeRO shard exists once, on the rank that dies with it (no copy "
             "is kept on another rank); train without --zero, or use --on-failure restart")
        need(self.comm_hook in ("none", "fp16", "bf16"), "comm_hook", f"{why}: PowerSGD and auto keep a state per "
             "group, and the members' group changes with each death; use --comm-hook fp16 or bf16, or none")
        kept = ("moves its statistics as under DDP: shard 0's update, handed to every worker with the step"
                if self.strategy == "ddp" else "keeps each worker's own statistics")
        need(not self.sync_bn, "sync_bn", f"{why}: SyncBatchNorm all-gathers each forward's batch statistics over "
             f"the process group, which the mode replaces at each death (a death in a forward would cut that "
             f"collective); drop --sync-bn (BatchNorm then {kept})")
        need(self.grad_accum == 1 or self.strategy == "ddp", "grad_accum", f"{why} with --strategy {self.strategy}: "
             "each of a worker's batches is a step of its own (sent to the servers, or a local step), which the mode's "
             "loops for this strategy do not accumulate; drop --grad-accum, or use --strategy ddp")
        need(self.amp != "fp16", "amp", f"{why}: fp16 needs a loss scale (torch's GradScaler), which the mode's "
             "training loops do not keep; use --amp bf16 (no loss scale needed) or off")
        need(self.trace is None, "trace", f"{why}: there are no DDP buckets to trace")
        need(self.backend in (None, "gloo"), "backend", f"{why}: the survivors rebuild gloo groups")
        need(self.straggler is None, "straggler", f"{why}: it slows a rank, and the mode's ranks change "
             "with each death; drop --straggler")

    def lr_scale(self, world: int, *, replicas: int) -> int:
        """How many times ``--lr`` the optimizer steps with (after any warm-up): the linear scaling rule, by the
        replicas whose batches one step averages (``world`` processes, times ``replicas`` in each: DataParallel's
        devices). DiLoCo's inner optimizer steps on one worker's batch alone (its outer optimizer combines the
        workers, as in the paper, whose inner rate does not change with their number): only the process's own
        replicas count there."""
        return replicas * (1 if self.strategy == "diloco" else world)

    def warmup_for(self, scale: int) -> float:
        """Epochs of warm-up for a learning rate scaled ``scale`` times: ``--warmup-epochs``, else none up to 2
        times, ``scale / 2`` beyond (measured: at 3 and 4 processes the linearly scaled rate from the first step
        can leave MNIST's ConvNet at chance); none for a rate not scaled (one process, DiLoCo's inner rate: the
        ramp goes from ``--lr`` to the scaled rate). It depends on the scale alone, not on ``--epochs``, so a run
        resumed with more epochs takes the same rates."""
        if scale <= 1:
            return 0.0
        if self.warmup_epochs is not None:
            return self.warmup_epochs
        return 0.0 if scale <= 2 else scale / 2

    def check_world(self, world: int, *, start: int | None = None) -> None:
        """The settings that depend on the number of workers, once it is known (``ddpkit train`` before it starts
        them, or from its launcher's environment; ``ddpkit bench strategies`` for each of its world sizes).
        ``start``: the world a resumed ``--on-failure continue`` run started with (its global batch and shards).

        Raises:
            ConfigError: ``--straggler`` names a rank the job does not have; more workers than shards.
        """
        first = world if start is None else start
        if self.deterministic_shards is not None:
            v, batch = self.deterministic_shards, self.batch_size * first * self.grad_accum
            if v < world or batch % v:
                accum = f" x {self.grad_accum}" if self.grad_accum > 1 else ""
                raise ConfigError(f"--deterministic-shards {v} at {world} process(es): V must be at least the world "
                                  f"size and divide the global batch ({self.batch_size} x {first}{accum} = {batch}); "
                                  f"e.g. --deterministic-shards {first * self.grad_accum}")
            if v < first * self.grad_accum:
                raise ConfigError(f"--deterministic-shards {v} with --grad-accum {self.grad_accum}: each shard is a "
                                  f"micro-batch of the deterministic mode, here {batch // v} samples, more than "
                                  f"--batch-size {self.batch_size}; give --deterministic-shards "
                                  f"{first * self.grad_accum} or a multiple of it that divides {batch}")
        elif first < world:
            raise ConfigError(f"--resume with {world} workers: the run started with {first}, and each step of it is "
                              f"cut into {first} shards, one worker's work each: resume with --nproc-per-node {first} "
                              "or fewer (a run started with --deterministic-shards V resumes with up to V)")
        if self.slow is not None and self.slow[0] >= world:
            raise ConfigError(f"--straggler {self.straggler}: rank {self.slow[0]} does not exist at world size "
                              f"{world}: choose a rank in 0..{world - 1}")

    @property
    def slow(self) -> tuple[int, float] | None:
        """``--straggler`` as ``(rank, factor)``."""
        if self.straggler is None:
            return None
        rank, _, factor = self.straggler.partition(":")
        return int(rank), float(factor)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (paths as strings), as saved in ``config.json`` and checkpoints."""
        return plain(self)

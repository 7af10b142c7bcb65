"""The ``ddpkit`` command line: argument parsing only.

Every subcommand's flags are generated from the fields of its config
dataclass (made with :func:`ddpkit.runtime.options.option`), so defaults and
validation live in one place. The parsed flags build the dataclass, which
the library runs. A :class:`~ddpkit.runtime.options.ConfigError` (a bad
setting, found before any work starts) is shown as
``ddpkit <cmd>: error: ...`` with exit code 2, a
:class:`~ddpkit.runtime.options.RunError` (a run stopped by its
surroundings, a full disk, with the message saying what to do) the same way
with exit code 1; every other exception keeps its traceback, so a bug is
never mistaken for either.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ddpkit.runtime.options import ConfigError, RunError

_KINDS: dict[str, Callable[[str], Any]] = {"str": str, "int": int, "float": float, "Path": Path}


def _converter(kind: str) -> Callable[[str], Any]:
    """How a field of type ``kind`` parses one command-line word.

    ``int | None`` parses as int; ``int | str`` (e.g. a count or 'auto') stays
    a string for the dataclass to interpret; ``tuple[int, ...]`` per element.
    """
    alternatives = [a for a in kind.removeprefix("tuple[").removeprefix("list[").split(" | ") if a != "None"]
    return _KINDS.get(alternatives[0].split(",")[0], str) if len(alternatives) == 1 else str


def _add_config_flags(parser: argparse.ArgumentParser, config: type) -> None:
    """One flag (or positional) per field of ``config`` that has command-line help.

    An unset flag is left out of the namespace, so the field keeps its
    dataclass default.
    """
    for f in dataclasses.fields(config):
        meta = f.metadata
        if "help" not in meta or meta.get("cli", True) is False:
            continue
        help_text = meta["help"].replace("%", "%%")  # argparse formats help with %: a plain "93 %" is text
        default = f.default if f.default is not dataclasses.MISSING else None
        if meta.get("positional"):
            parser.add_argument(f.name, nargs=meta.get("nargs"), metavar=meta.get("metavar", f.name),
                                help=help_text, **({} if f.default is dataclasses.MISSING else {"default": default}))
            continue
        flags = meta.get("flags") or ["--" + f.name.replace("_", "-")] + (["--" + f.name] if "_" in f.name else [])
        kind = str(f.type)
        if kind == "bool":
            if not meta.get("negate_only"):
                parser.add_argument(*flags, dest=f.name, action="store_true", default=argparse.SUPPRESS,
                                    help=help_text)
            if "negate" in meta:
                parser.add_argument(meta["negate"], dest=f.name, action="store_false", default=argparse.SUPPRESS,
                                    help=f"turn off: {help_text}")
            continue
        if default is not None and "default" not in help_text:
            shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
            help_text += f" (default: {shown})".replace("%", "%%")
        many = kind.startswith(("tuple[", "list["))
        parser.add_argument(*flags, dest=f.name, type=_converter(kind), choices=meta.get("choices"),
                            nargs=meta.get("nargs", "+" if many else None), metavar=meta.get("metavar"),
                            default=argparse.SUPPRESS, help=help_text)


_PET_NAMES = {"grace_period_s": "SHUTDOWN_TIMEOUT", "program": None, "args": None, "local_rank_arg": None,
              "prefix_output": None, "python": None}
"""torchrun's ``PET_<FLAG>`` variable for each launch field, where the name differs or there is none."""


def _torchrun_env_defaults(config: type, values: dict[str, Any]) -> None:
    """Fill unset launch flags from torchrun's ``PET_*`` variables (``PET_NNODES=2``), as torchrun does.

    Raises:
        ConfigError: a variable holds a value its flag would refuse.
    """
    import os

    for f in dataclasses.fields(config):
        name = _PET_NAMES.get(f.name, f.name.upper())
        var = f"PET_{name}" if name else None
        if var is None or f.name in values or var not in os.environ:
            continue
        raw = os.environ[var]
        kind = str(f.type)
        try:
            # torchrun: PET_STANDALONE=1
            values[f.name] = bool(int(raw)) if kind == "bool" else _converter(kind)(raw)
        except ValueError:
            raise ConfigError(f"{var}={raw!r} (torchrun's variable for --{f.name.replace('_', '-')}) is not "
                              f"{'0 or 1' if kind == 'bool' else 'a valid value'}: fix or unset it") from None


def _build(config: type, args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> Any:
    names = {f.name for f in dataclasses.fields(config)}
    values = {**(defaults or {}), **{k: v for k, v in vars(args).items() if k in names}}
    if args.command == "launch":
        _torchrun_env_defaults(config, values)
    for f in dataclasses.fields(config):
        if f.name in values and str(f.type).startswith("tuple[") and values[f.name] is not None:
            values[f.name] = tuple(values[f.name])
    return config(**values)


def _launch(args: argparse.Namespace) -> int:
    from ddpkit.launcher import LaunchConfig, run

    return run(_build(LaunchConfig, args))


def _saved_settings(args: argparse.Namespace, config: type) -> dict[str, Any]:
    """The settings a ``ddpkit train`` starts from before its flags: ``--config FILE``'s, else, with ``--resume
    --output-dir DIR``, the run's own ``DIR/config.json`` (so that a resumption needs no flag retyped); the
    flags given override them.

    Raises:
        ConfigError: a file that cannot be read as a JSON object of settings.
    """
    import json

    path = getattr(args, "config_file", None)
    if path is None and getattr(args, "resume", False) and getattr(args, "output_dir", None) is not None:
        path = Path(args.output_dir) / "config.json"
        if not path.is_file():
            return {}  # a run that never started: the flags (and defaults) decide, and the resume says so
    if path is None:
        return {}
    try:
        saved = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--config {path}: cannot read its settings ({e}): give a JSON object such as a run's "
                          "config.json") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"--config {path}: not a JSON object of settings (a run's config.json is one)")
    names = {f.name for f in dataclasses.fields(config)} - {"resume"}
    unknown = sorted(set(saved) - names - {"resume", "data_fingerprint"})
    if unknown and getattr(args, "config_file", None) is not None:
        raise ConfigError(f"--config {path}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a "
                          "setting of ddpkit train (see ddpkit train --help)")
    from ddpkit.train.train_config import TrainConfig, without_inert

    if config is TrainConfig:
        saved = without_inert(saved)  # (a run saved with a setting that changed nothing, since refused)
    kinds = {f.name: str(f.type) for f in dataclasses.fields(config)}
    return {k: tuple(v) if isinstance(v, list) and kinds[k].startswith("tuple[") else v
            for k, v in saved.items() if k in names}


def _train(args: argparse.Namespace) -> int:
    from ddpkit.runtime import variables
    from ddpkit.train.preload import start_early
    from ddpkit.train.train_config import TrainConfig

    config = _build(TrainConfig, args, _saved_settings(args, TrainConfig))
    variables.refuse_bad_environment(os.environ)  # (again in train(): a bad variable refused before any import)
    start_early(config)  # the workers' imports start now, beside this process's own
    from ddpkit.train.loop import train

    train(config)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from ddpkit.bench.runners.ranks import start_early

    start_early()  # the ranks' imports start now, beside this process's own
    from ddpkit.bench.command import BenchConfig, run

    run(_build(BenchConfig, args))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from ddpkit.doctor.checkup import run
    from ddpkit.doctor.doctor_config import DoctorConfig

    return run(_build(DoctorConfig, args))


def _suite_takes_all(args: argparse.Namespace, suite: type) -> None:
    """Refuse ``ddpkit bench``'s own flags given before a suite that has no use for them (``bench --steps 5
    collectives``), instead of running without them.

    Raises:
        ConfigError: naming each such flag, and the suite's own spelling where it has one (``--world-sizes``).
    """
    from ddpkit.bench.bench_config import BenchConfig

    theirs = {f.name: f for f in dataclasses.fields(BenchConfig)}
    ours = {f.name for f in dataclasses.fields(suite)}
    stray = [name for name in vars(args) if name in theirs and name not in ours]
    if not stray:
        return
    words = []
    for name in stray:
        flag = (theirs[name].metadata.get("flags") or ["--" + name.replace("_", "-")])[0]
        own = f" (this suite's is --{name.replace('_', '-')}s)" if f"{name}s" in ours else ""
        words.append(flag + own)
    raise ConfigError(f"{', '.join(words)} belong{'s' if len(words) == 1 else ''} to plain `ddpkit bench`, not to "
                      f"`ddpkit bench {args.suite}`: leave {'it' if len(words) == 1 else 'them'} out (see "
                      f"`ddpkit bench {args.suite} --help` for the flags it takes)")


def _bench_collectives(args: argparse.Namespace) -> int:
    from ddpkit.bench.sections.allreduce_perf import CollectivesBenchConfig, run

    _suite_takes_all(args, CollectivesBenchConfig)
    from ddpkit.bench.runners.ranks import start_early

    start_early()
    run(_build(CollectivesBenchConfig, args))
    return 0


def _bench_strategies(args: argparse.Namespace) -> int:
    from ddpkit.bench.sections.strategies import ConsistencyBenchConfig, run

    _suite_takes_all(args, ConsistencyBenchConfig)
    run(_build(ConsistencyBenchConfig, args))
    return 0


def _bench_backends(args: argparse.Namespace) -> int:
    from ddpkit.bench.sections.mpi_vs_gloo import BackendsBenchConfig, run

    _suite_takes_all(args, BackendsBenchConfig)
    run(_build(BackendsBenchConfig, args))
    return 0


def _bench_failures(args: argparse.Namespace) -> int:
    from ddpkit.bench.sections.failure_cost import FailuresBenchConfig, run

    _suite_takes_all(args, FailuresBenchConfig)
    run(_build(FailuresBenchConfig, args))
    return 0


def _bench_links(args: argparse.Namespace) -> int:
    from ddpkit.bench.sections.links.section import LinksBenchConfig, TestbedError, run

    _suite_takes_all(args, LinksBenchConfig)
    try:
        run(_build(LinksBenchConfig, args))
    except TestbedError as e:
        raise ConfigError(f"ddpkit bench links: {e}") from None
    return 0


def _add_bench_suites(bench: argparse.ArgumentParser) -> None:
    """``ddpkit bench collectives``, ``strategies`` and ``backends``: suites under ``bench`` (plain ``ddpkit bench``
    stays DDP's)."""
    from ddpkit.bench.sections.allreduce_perf import CollectivesBenchConfig
    from ddpkit.bench.sections.failure_cost import FailuresBenchConfig
    from ddpkit.bench.sections.links.section import LinksBenchConfig
    from ddpkit.bench.sections.mpi_vs_gloo import BackendsBenchConfig
    from ddpkit.bench.sections.strategies import ConsistencyBenchConfig

    suites = bench.add_subparsers(dest="suite", metavar="SUITE")
    p = suites.add_parser(
        "collectives", help="time each all-reduce algorithm by message size and world size",
        description="Median all-reduce time, algorithm and bus bandwidth of ddpkit.collectives' algorithms by "
                    "message size, with an alpha-beta model fitted to them; JSON and a PNG plot.",
        allow_abbrev=False,
    )
    _add_config_flags(p, CollectivesBenchConfig)
    p.set_defaults(handler=_bench_collectives, parser=p)
    p = suites.add_parser(
        "strategies", help="train with each consistency model (DDP, local SGD, parameter servers, SSP) and compare",
        description="The seed's consistency models side by side: one ddpkit train run per strategy and world size "
                    "(optionally with a straggler); time per epoch and to a target accuracy, final accuracy, bytes "
                    "per step, time waiting, staleness; JSON and a PNG of accuracy against time.",
        allow_abbrev=False,
    )
    _add_config_flags(p, ConsistencyBenchConfig)
    p.set_defaults(handler=_bench_strategies, parser=p)
    p = suites.add_parser(
        "backends", help="the mpi backend against gloo: all-reduce bandwidth and DDP steps, in the same ranks",
        description="One mpirun job per world size whose ranks hold an mpi and a gloo group: all-reduce bus "
                    "bandwidth by size, and the DDP step of each workload on ddpkit over mpi, ddpkit over gloo and "
                    "torch over gloo, interleaved; medians, quartiles, a 95 % confidence interval; JSON.",
        allow_abbrev=False,
    )
    _add_config_flags(p, BackendsBenchConfig)
    p.set_defaults(handler=_bench_backends, parser=p)
    p = suites.add_parser(
        "failures", help="what a worker's death costs: --on-failure restart against continue, side by side",
        description="ddpkit train runs of each job and world size in both modes, each once without a fault and once "
                    "with a random worker SIGKILLed mid-run: time to detect, to the next step and to a replacement's "
                    "join, steps lost, wall and CPU seconds lost, samples once, bitwise; and the mode's step time "
                    "against DDP's without a fault.",
        allow_abbrev=False,
    )
    _add_config_flags(p, FailuresBenchConfig)
    p.set_defaults(handler=_bench_failures, parser=p)
    p = suites.add_parser(
        "links", help="train across nodes joined by links of each rate: DDP, local SGD, DiLoCo, streaming DiLoCo",
        description="Network namespaces on one bridge, each cable shaped with tc (rate only): the GPT on tiny "
                    "Shakespeare across them at each rate, one run per way of keeping the replicas together; "
                    "seconds a step, symbols a second, bytes sent, validation loss, and the speed-up over DDP at "
                    "the same rate. Needs root and iproute2.",
        allow_abbrev=False,
    )
    _add_config_flags(p, LinksBenchConfig)
    p.set_defaults(handler=_bench_links, parser=p)


def _subcommands() -> list[tuple[str, str, str, Callable[[], type], Callable[[argparse.Namespace], int]]]:
    # Config classes are imported when the parser is built: all three modules
    # are torch-free at import, so `ddpkit launch` still starts without torch.
    def launch_config() -> type:
        from ddpkit.launcher.launch_config import LaunchConfig
        return LaunchConfig

    def train_config() -> type:
        from ddpkit.train.train_config import TrainConfig
        return TrainConfig

    def bench_config() -> type:
        from ddpkit.bench.bench_config import BenchConfig
        return BenchConfig

    def doctor_config() -> type:
        from ddpkit.doctor.doctor_config import DoctorConfig
        return DoctorConfig

    return [
        ("launch", "start a training script on N processes (torchrun-compatible)",
         "Start one node's workers of a data-parallel job; torchrun's flags and env contract.",
         launch_config, _launch),
        ("train", "train a model data-parallel (default: the MNIST ConvNet on digits, 2 processes)",
         "Train a model data-parallel on N processes, with evaluation, checkpoints and resume.",
         train_config, _train),
        ("bench", "time ddpkit's DDP against torch's, side by side",
         "Median step times of ddpkit's and torch's DDP on the same steps (gloo, one thread per rank, "
         "alternating engines), their ratio, and how much all-reduce hides behind backward.",
         bench_config, _bench),
        ("doctor", "check this machine: environment, backends, and a self-test of ddpkit on each",
         "Report Python, torch, CUDA/NCCL, GPUs, backends, the network interface and the relevant environment; "
         "then start ranks and test every collective, a DDP step against torch's, SyncBatchNorm and all-reduce "
         "bandwidth on each backend and device. Exit 1 on any failure, naming the backend and the fix.",
         doctor_config, _doctor),
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpkit", description="Data-parallel training for PyTorch.", allow_abbrev=False
    )
    from ddpkit import __version__

    parser.add_argument("--version", action="version", version=f"ddpkit {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, short, description, config, handler in _subcommands():
        # No prefixes of flags, where torchrun takes them: argparse would read the script's own flags as
        # prefixes too, and refuse `ddpkit launch train.py --run exp1` as ambiguous (--run-path, --run_path).
        p = subparsers.add_parser(name, help=short, description=description, allow_abbrev=False)
        _add_config_flags(p, config())
        p.set_defaults(handler=handler, parser=p)
        if name == "train":
            p.add_argument("--config", dest="config_file", type=Path, default=None, metavar="FILE",
                           help="start from the settings in FILE (JSON, as a run's config.json); flags given "
                                "override them. With --resume --output-dir DIR, DIR/config.json is the default")
        if name == "bench":
            _add_bench_suites(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ddpkit`` console script and ``python -m ddpkit``."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # The subcommand's usage, not the top-level one: that is where the flag was looked for.
        (getattr(args, "parser", None) or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.handler(args)
    except ConfigError as e:
        print(f"ddpkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"ddpkit {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        # ddpkit.spawn's Interrupted says which signal; a plain Ctrl-C is SIGINT.
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"ddpkit {args.command}: received {signal.Signals(signum).name}: stopped all workers",
              file=sys.stderr)
        return 128 + signum


def run() -> NoReturn:
    """The console script: :func:`main`, then an exit without the interpreter's teardown (seconds with torch
    loaded, after the work is done)."""
    from ddpkit.runtime.process import exit_now

    exit_now(main())


if __name__ == "__main__":
    run()

"""The ``ddpkit`` command line: argument parsing only.

Each subcommand parses its flags into the library's config dataclass and
calls the library; configuration errors (``ValueError`` from a config's
validation) are shown as ``ddpkit <cmd>: error: ...`` with exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def _launch(args: argparse.Namespace) -> int:
    from ddpkit.launcher import LaunchConfig, run

    cfg = LaunchConfig(
        program=args.program, args=args.program_args, module=args.module,
        nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port, standalone=args.standalone,
        max_restarts=args.max_restarts, local_rank_arg=args.local_rank_arg,
        prefix_output=not args.no_prefix, log_dir=args.log_dir,
    )
    return run(cfg)


def _add_launch(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "launch", help="start a training script on N processes (torchrun-compatible)",
        description="Start one node's workers of a data-parallel job; torchrun's flags and env contract.",
        allow_abbrev=False,
    )
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default="1",
                   help="workers on this node: an integer, or 'auto' (one per GPU, else 1). Default 1")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes. Default 1")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                   help="this node's index in 0..nnodes-1. Default 0")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default="127.0.0.1",
                   help="node 0's address. Default 127.0.0.1")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   help="rendezvous port on node 0. Default 29500")
    p.add_argument("--standalone", action="store_true",
                   help="single node: pick a free port, rendezvous on loopback")
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
                   help="restart the whole group up to this many times after a failure. Default 0")
    p.add_argument("--local-rank-arg", "--local_rank_arg", dest="local_rank_arg", action="store_true",
                   help="also pass --local_rank=N to the script (torch.distributed.launch style)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix worker output with [rankN]:")
    p.add_argument("--log-dir", "--log_dir", dest="log_dir", type=Path, default=None,
                   help="also save each rank's output under this directory")
    p.add_argument("-m", "--module", action="store_true", help="run PROGRAM as a module, like python -m")
    p.add_argument("program", help="the training script (or module name with -m)")
    p.add_argument("program_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(handler=_launch)


def _train(args: argparse.Namespace) -> int:
    from ddpkit.train.config import TrainConfig
    from ddpkit.train.loop import train

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    train(TrainConfig(**{k: v for k, v in vars(args).items() if k in fields}))
    return 0


def _add_train(subparsers: argparse._SubParsersAction) -> None:
    from ddpkit.train.config import TrainConfig

    p = subparsers.add_parser(
        "train", help="train a model data-parallel (default: the MNIST ConvNet on digits, 2 processes)",
        description="Train a model data-parallel on N processes, with evaluation, checkpoints and resume.",
        allow_abbrev=False,
    )
    # One flag per TrainConfig field, from the dataclass itself: defaults and
    # validation live there only (an unset flag keeps the field's default).
    kinds = {"str": str, "int": int, "float": float, "Path": Path}
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        spellings = [flag] + (["--" + f.name] if "_" in f.name else [])
        helptext = f.metadata.get("help", "")
        if "default" not in helptext:
            helptext += f" (default: {f.default})"
        if f.type == "bool":
            p.add_argument(*spellings, dest=f.name, action="store_true", default=argparse.SUPPRESS, help=helptext)
            if "negate" in f.metadata:
                p.add_argument(f.metadata["negate"], dest=f.name, action="store_false",
                               default=argparse.SUPPRESS, help=f"turn off {flag}")
            continue
        kind = kinds[str(f.type).split(" | ")[0]]
        p.add_argument(*spellings, dest=f.name, type=kind, choices=f.metadata.get("choices"),
                       default=argparse.SUPPRESS, help=helptext)
    p.set_defaults(handler=_train)


def _bench(args: argparse.Namespace) -> int:
    from ddpkit.bench.engines import BenchConfig, run

    cfg = BenchConfig(
        workloads=tuple(args.workloads), steps=args.steps, warmup=args.warmup, block=args.block,
        world_size=args.world_size, samples_per_rank=args.samples_per_rank, mlp_hidden=args.mlp_hidden,
        mlp_batch=args.mlp_batch, bucket_cap_mb=args.bucket_cap_mb, json_path=args.json,
    )
    run(cfg)
    return 0


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="time ddpkit's DDP against torch's, side by side",
        description="Median step times of ddpkit's and torch's DDP on the same steps (gloo, one thread "
                    "per rank, alternating engines), their ratio, and how much all-reduce hides behind backward.",
        allow_abbrev=False,
    )
    p.add_argument("--workloads", nargs="+", default=["convnet", "mlp"], metavar="NAME",
                   help="among convnet, mlp. Default: both")
    p.add_argument("--steps", type=int, default=40, help="timed steps per engine and workload. Default 40")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per engine first. Default 5")
    p.add_argument("--block", type=int, default=1, help="steps before switching engine. Default 1")
    p.add_argument("--world-size", type=int, default=2, help="ranks. Default 2")
    p.add_argument("--samples-per-rank", type=int, default=100, help="ConvNet batch per rank. Default 100")
    p.add_argument("--mlp-hidden", type=int, default=4640, help="MLP width (4640: ~25 M params). Default 4640")
    p.add_argument("--mlp-batch", type=int, default=32, help="MLP batch per rank. Default 32")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="bucket cap of both engines. Default 25")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    p.set_defaults(handler=_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpkit", description="Data-parallel training for PyTorch.", allow_abbrev=False
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    adders: list[Callable[[argparse._SubParsersAction], None]] = [_add_launch, _add_train, _add_bench]
    for add in adders:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ddpkit`` console script and ``python -m ddpkit``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as e:
        print(f"ddpkit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The command line itself: every command's and suite's --help prints (argparse formats help texts with %)."""

from __future__ import annotations

import argparse

from ddpkit.cli import build_parser


def _parsers(parser: argparse.ArgumentParser, path: str = "ddpkit") -> dict[str, argparse.ArgumentParser]:
    found = {path: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_parsers(sub, f"{path} {name}"))
    return found


def test_every_help_prints() -> None:
    parsers = _parsers(build_parser())
    assert {"ddpkit launch", "ddpkit train", "ddpkit bench", "ddpkit bench strategies", "ddpkit bench collectives",
            "ddpkit doctor"} <= set(parsers)
    texts = {path: p.format_help() for path, p in parsers.items()}  # raised TypeError on a help text's bare %
    assert "DDP reaches 93 % at W = 4" in " ".join(texts["ddpkit bench strategies"].split())


def test_a_bench_flag_given_before_a_suite_that_has_no_use_for_it_is_refused(capsys) -> None:
    from ddpkit.cli import main

    assert main(["bench", "--world-size", "4", "strategies"]) == 2
    err = capsys.readouterr().err
    assert "--world-size (this suite's is --world-sizes) belongs to plain `ddpkit bench`" in err
    assert "`ddpkit bench strategies`" in err
    assert main(["bench", "--steps", "5", "--memory", "collectives"]) == 2
    assert "--steps, --memory belong to plain `ddpkit bench`, not to `ddpkit bench collectives`" in (
        capsys.readouterr().err)
    # A flag both take still carries over from before the suite.
    args = build_parser().parse_args(["bench", "--no-progress", "--json", "x.json", "strategies"])
    assert args.progress is False and str(args.json_path) == "x.json"


def test_the_scripts_own_flags_reach_it_whatever_launcher_flag_they_begin() -> None:
    # With prefixes taken, as torchrun's parser takes them, --run (of --run-path and --run_path) was refused.
    argv = ["train.py", "--run", "exp1", "--no", "--max", "3", "--log", "x"]
    args = build_parser().parse_args(["launch", "--nproc-per-node", "2", *argv])
    assert args.program == "train.py" and args.args == argv[1:] and args.nproc_per_node == "2"

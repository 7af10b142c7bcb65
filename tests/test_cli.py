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

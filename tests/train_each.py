"""Runs of ``ddpkit train`` one after another in one process, each as the command runs it (``ddpkit.cli.main``):
the interpreter's start, the imports and the workers' forkserver paid once for all of them, where each command
would pay them again (tests/train/test_flag_matrix.py).

``python tests/train_each.py RUNS.json``: RUNS.json maps a name to the command's arguments after ``train``. Before each
run this prints ``@@@ NAME`` on stdout and on stderr, after it ``@@@ NAME exit CODE`` (the command's exit code);
what the run's workers print (forked from the one forkserver, whose stdout and stderr are this process's) falls
between the two lines. The environment is restored after each run.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from ddpkit.cli import main
from ddpkit.runtime.process import exit_now


def run_each(runs: dict[str, list[str]]) -> None:
    saved = dict(os.environ)
    for name, argv in runs.items():
        for stream in (sys.stdout, sys.stderr):
            print(f"@@@ {name}", file=stream, flush=True)
        try:
            code = main(["train", *argv])
        except SystemExit as e:  # a usage error: argparse's exit
            code = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 - the command's own traceback, then its exit code
            traceback.print_exc()
            code = 1
        os.environ.clear()
        os.environ.update(saved)
        for stream in (sys.stdout, sys.stderr):
            print(f"@@@ {name} exit {code}", file=stream, flush=True)


def parse(output: str) -> dict[str, tuple[int, str]]:
    """What each run printed between its two lines, with its exit code: ``{name: (code, text)}``."""
    found: dict[str, tuple[int, str]] = {}
    name, lines = None, []
    for line in output.splitlines():
        if line.startswith("@@@ ") and " exit " in line and name is not None:
            found[name] = (int(line.rsplit(" ", 1)[1]), "\n".join(lines))
            name, lines = None, []
        elif line.startswith("@@@ "):
            name, lines = line[4:], []
        elif name is not None:
            lines.append(line)
    return found


if __name__ == "__main__":
    run_each(json.loads(Path(sys.argv[1]).read_text()))
    exit_now(0)

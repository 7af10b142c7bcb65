"""Time how soon a replacement holds the training state after a worker of ``ddpkit train --on-failure continue`` dies.

Each trial trains the ConvNet on synthetic data with two workers and ``--max-restarts 1``, SIGKILLs rank 1's worker
two seconds into training, and times the launcher's lines from the kill: the death seen, the replacement started,
and the replacement holding the state (started, imported what it needs, admitted at a step boundary, the state
received from the survivor). With ``--python`` another checkout's interpreter runs the command, so two versions can
be timed one after the other.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/ft_replacement.py --trials 3
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def victim() -> int:
    """Rank 1's worker: named ``ddpkit-rank1`` (a fork of the preloaded server), or, started as a fresh interpreter
    by an older ddpkit, the fault-tolerant loop with ``RANK=1`` in its environment."""
    for entry in Path("/proc").iterdir():
        try:
            comm = (entry / "comm").read_text().strip()
            command = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if comm == "ddpkit-rank1" or (b"fault_tolerant_loop" in command and b"RANK=1" in environ):
            return int(entry.name)
    raise RuntimeError("no worker of rank 1 found")


def trial(python: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.Popen(
            [python, "-m", "ddpkit", "train", "--on-failure", "continue", "--max-restarts", "1", "--dataset",
             "synthetic", "--synthetic-samples", "16384", "--batch-size", "16", "--epochs", "2", "--no-progress",
             "--output-dir", f"{out}/run"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        killed = held = None
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.monotonic()
            if killed is None and line.startswith("ddpkit train: "):
                time.sleep(2.0)  # training under way
                os.kill(victim(), signal.SIGKILL)
                killed = time.monotonic()
            elif killed is not None:
                print(f"  {now - killed:6.2f} s  {line.rstrip()[:110]}")
                if held is None and "holds the training state" in line:
                    held = now - killed
        if proc.wait() != 0 or held is None:
            raise RuntimeError(f"the run ended with {proc.returncode} and no replacement held the state")
        return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs ddpkit train")
    args = parser.parse_args()
    held = [trial(args.python) for _ in range(args.trials)]
    print(f"a replacement holds the state {statistics.median(held):.2f} s after the kill (median of {len(held)}; "
          f"{min(held):.2f}-{max(held):.2f} s)")


if __name__ == "__main__":
    main()

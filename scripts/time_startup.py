"""Wall time of whole commands, ddpkit against torch's tools, interleaved: the start-up figures of the docs.

Two jobs at 2 processes, one thread each:

* ``hello``: init, one all-reduce, exit (``examples/hello_allreduce.py``)
  under ``ddpkit launch`` and under ``torchrun``;
* ``train``: the main job, ``ddpkit train`` (ConvNet on digits, 8 epochs),
  against ``torchrun scripts/torch_train.py``, the same job on torch's DDP,
  sampler and launcher.

The two commands of a job alternate (A B A B ...), each run in a fresh
output directory; the medians, their range and the ratio of the medians are
printed. Run: ``.venv/bin/python scripts/time_startup.py [--runs N] [--jobs hello train]``
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
JOBS = {
    "hello": {
        "ddpkit launch": [PY, "-m", "ddpkit", "launch", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "examples" / "hello_allreduce.py")],
        "torchrun": [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     str(ROOT / "examples" / "hello_allreduce.py")],
    },
    "train": {
        "ddpkit train": [PY, "-m", "ddpkit", "train", "--no-progress", "--output-dir", "{out}"],
        "torchrun": [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     str(ROOT / "scripts" / "torch_train.py"), "{out}"],
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each command (default 5)")
    parser.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=sorted(JOBS))
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for job in args.jobs:
        times: dict[str, list[float]] = {name: [] for name in JOBS[job]}
        with tempfile.TemporaryDirectory() as tmp:
            for run in range(args.runs + 1):  # the first round warms the caches and is not counted
                for name, cmd in JOBS[job].items():
                    out = Path(tmp) / f"{name.replace(' ', '-')}-{run}"
                    # Output to a file, as a terminal takes it: the command ends when its process does.
                    log_path = Path(tmp) / f"{name.replace(' ', '-')}-{run}.log"
                    with open(log_path, "wb") as log:
                        start = time.perf_counter()
                        done = subprocess.run([c.replace("{out}", str(out)) for c in cmd], env=env, cwd=tmp,
                                              stdout=log, stderr=log)
                    if done.returncode:
                        sys.exit(f"{name} failed (exit {done.returncode}):\n{log_path.read_text()[-3000:]}")
                    if run:
                        times[name].append(time.perf_counter() - start)
        (a, ta), (b, tb) = times.items()
        for name, values in times.items():
            print(f"{job}: {name:14s} median {statistics.median(values):6.2f} s  (min {min(values):.2f}, "
                  f"max {max(values):.2f}, {len(values)} runs)")
        print(f"{job}: ratio {a} / {b} = {statistics.median(ta) / statistics.median(tb):.2f}")


if __name__ == "__main__":
    main()

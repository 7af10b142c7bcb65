"""Wall time of a 2-rank hello world (init, one all-reduce, exit): ddpkit launch vs torchrun.

The two launchers alternate, 5 runs each, and the medians are printed, so
machine noise hits both alike. Run: .venv/bin/python scripts/time_hello.py [runs]
"""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELLO = str(ROOT / "examples" / "hello_allreduce.py")
COMMANDS = {
    "ddpkit launch": [sys.executable, "-m", "ddpkit", "launch", "--standalone", "--nproc-per-node", "2", HELLO],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", HELLO],
}


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(runs):
        for name, cmd in COMMANDS.items():
            start = time.perf_counter()
            subprocess.run(cmd, env=env, check=True, capture_output=True)
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        print(f"{name:14s} median {statistics.median(values):.2f} s  runs {' '.join(f'{v:.2f}' for v in values)}")
    ratio = statistics.median(times["ddpkit launch"]) / statistics.median(times["torchrun"])
    print(f"ratio ddpkit/torchrun {ratio:.2f}")


if __name__ == "__main__":
    main()

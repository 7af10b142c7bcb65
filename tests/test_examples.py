"""The examples run as users run them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mnist_distributed_example(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "mnist_distributed.py"), "--nprocs", "2", "--epochs", "2"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    # Rank 0 prints, once; all 359 test images are counted exactly once.
    found = re.findall(r"Test accuracy: ([\d.]+)% on 359 images", proc.stdout)
    assert len(found) == 1 and float(found[0]) > 90, proc.stdout

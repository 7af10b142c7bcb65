"""``scripts/gpu_check.sh`` and its tally fail unless the GPU tests really ran: a GPU run that ran nothing (CUDA
unusable, every test skipped) is a failure, never a pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GROUPS = ("tests.gpu.test_gpu", "tests.gpu.test_gpu_commands", "tests.gpu.test_gpu_strategies")


def _junit(path: Path, cases: dict[str, list[str]]) -> Path:
    """A JUnit file with, per group, testcases of these outcomes (passed, skipped, failed)."""
    body = []
    for group, outcomes in cases.items():
        for k, outcome in enumerate(outcomes):
            inner = {"passed": "", "skipped": '<skipped message="needs CUDA"/>',
                     "failed": '<failure message="x">x</failure>'}[outcome]
            body.append(f'<testcase classname="{group}" name="t{k}" time="0.1">{inner}</testcase>')
    path.write_text(f'<testsuites><testsuite name="pytest">{"".join(body)}</testsuite></testsuites>')
    return path


@pytest.mark.parametrize("cases, ok", [
    ({g: ["passed", "skipped"] for g in GROUPS}, True),
    ({g: ["skipped", "skipped"] for g in GROUPS}, False),  # CUDA unusable: everything skipped
    ({**{g: ["passed"] for g in GROUPS[:2]}, GROUPS[2]: ["skipped"]}, False),  # one group ran nothing
    ({GROUPS[0]: ["passed"], GROUPS[1]: ["passed"]}, False),  # one group absent
    ({**{g: ["passed"] for g in GROUPS}, GROUPS[1]: ["passed", "failed"]}, False),
], ids=["ran", "all skipped", "a group skipped", "a group absent", "a failure"])
def test_the_tally_passes_only_a_run_in_which_every_group_ran(tmp_path: Path, cases, ok) -> None:
    junit = _junit(tmp_path / "j.xml", cases)
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_tally.py"), str(junit)],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode == 0) == ok, done.stdout
    assert all(g in done.stdout for g in GROUPS)


def test_the_gpu_check_fails_where_cuda_is_unusable(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no usable CUDA device" in (tmp_path / "out" / "summary.txt").read_text()

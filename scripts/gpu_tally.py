"""The GPU suite's tally per group (test file) from its JUnit file: how many tests passed, failed and skipped.

``python scripts/gpu_tally.py gpu-tests.xml`` prints one line per group and
exits 1 unless every group ran (passed) at least one test and none failed:
a GPU run in which CUDA was unusable skips every test, and a run that ran
nothing must not pass (``scripts/gpu_check.sh`` calls it).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict

GROUPS = ("tests.gpu.test_gpu", "tests.gpu.test_gpu_commands", "tests.gpu.test_gpu_strategies")
"""The files of the GPU suite: each must run something."""


def tally(path: str) -> dict[str, Counter]:
    """``{group: Counter(passed=, failed=, skipped=)}`` from a JUnit file (every group of :data:`GROUPS`)."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for group in GROUPS:
        counts[group]  # noqa: B018 - a group that ran nothing is listed with zeros
    for case in ET.parse(path).getroot().iter("testcase"):
        group = case.get("classname", "")
        outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None else
                   "skipped" if case.find("skipped") is not None else "passed")
        counts[group][outcome] += 1
    return dict(counts)


def main(argv: list[str]) -> int:
    counts = tally(argv[0])
    ok = True
    for group, c in sorted(counts.items()):
        print(f"{group}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
        ok = ok and c["passed"] > 0 and c["failed"] == 0
    if not ok:
        print("the GPU suite did not run (a group passed no test, or one failed): not a GPU run that passed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The suite's time budget (tests/budget.py) on a suite of its own: a test over budget fails the run unless it
says why it is slow, and the run prints its wall time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import time
import pytest

def test_quick():
    pass

def test_slow_unmarked():
    time.sleep(0.3)

@pytest.mark.slow("waits on purpose")
def test_slow_marked():
    time.sleep(0.3)
"""


def _run(pytester: pytest.Pytester, source: str) -> pytest.RunResult:
    pytester.makeconftest('pytest_plugins = ["budget"]\n')
    pytester.makepyfile(test_suite=source)
    here = str(Path(__file__).parent)  # where budget.py is, for the subprocess
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider")


def test_a_test_over_budget_without_a_reason_fails_the_run(pytester: pytest.Pytester, monkeypatch) -> None:
    monkeypatch.setenv("DDPKIT_TEST_BUDGET_S", "0.2")
    result = _run(pytester, SUITE)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*suite wall time * s (* min), 3 tests*",
                                 "*OVER BUDGET: test_suite.py::test_slow_unmarked took * s, more than 0.2 s*"])
    assert "OVER BUDGET: test_suite.py::test_slow_marked" not in result.stdout.str()
    result.assert_outcomes(passed=3)  # every test passed: the budget alone failed the run


def test_within_budget_the_run_passes_and_prints_its_time(pytester: pytest.Pytester, monkeypatch) -> None:
    monkeypatch.setenv("DDPKIT_TEST_BUDGET_S", "5")
    result = _run(pytester, SUITE)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*suite wall time * s*"])


def test_the_slow_marker_needs_its_reason(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "import pytest\n\n@pytest.mark.slow\ndef test_x():\n    pass\n")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "@pytest.mark.slow needs the reason" in result.stderr.str()

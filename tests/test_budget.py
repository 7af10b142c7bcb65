"""The suite's time budget (tests/budget.py) on a suite of its own: a test over budget fails, in its own report,
unless the slow marker says why it is slow (a keyword of the same name does not), with or without pytest-xdist;
and the run prints its wall time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import subprocess, sys, time
import pytest

def test_quick():
    pass

def test_slow_unmarked():
    time.sleep(0.5)

@pytest.mark.slow("waits on purpose")
def test_slow_marked():
    time.sleep(0.5)

@pytest.mark.parametrize("case", ["slow"])
def test_slow_by_name_only(case):
    time.sleep(0.5)

def test_busy_in_a_subprocess():
    # 0.1 s of wall time at most, and the CPU of a process it started: counted too
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.25\\n"
                    "while time.process_time() < end: pass"], check=True)
"""


def _run(pytester: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    pytester.makeconftest('pytest_plugins = ["budget"]\n')
    pytester.makepyfile(test_suite=source)
    here = str(Path(__file__).parent)  # where budget.py is, for the subprocess
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)


@pytest.mark.parametrize("xdist", [False, True], ids=["one process", "pytest-xdist"])
def test_a_test_over_budget_without_a_reason_fails_itself(pytester: pytest.Pytester, monkeypatch, xdist) -> None:
    monkeypatch.setenv("DDPKIT_TEST_BUDGET_S", "0.2")
    junit = pytester.path / "junit.xml"
    result = _run(pytester, SUITE, "--junitxml", str(junit), *(["-n", "2"] if xdist else []))
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    wall = "more than 0.4 s (0.2 s x 2 workers)" if xdist else "more than 0.2 s"
    result.stdout.fnmatch_lines(["*suite wall time * s (* min), 5 tests*",
                                 f"*OVER BUDGET: test_suite.py::test_slow_unmarked took * s, {wall}*"])
    out = result.stdout.str()
    assert "OVER BUDGET: test_suite.py::test_slow_marked" not in out
    assert "OVER BUDGET: test_suite.py::test_slow_by_name_only[slow]" in out  # a keyword is not the marker
    assert "OVER BUDGET: test_suite.py::test_busy_in_a_subprocess took 0." in out
    assert "CPU-seconds (itself and its processes), more than 0.2" in out
    result.assert_outcomes(passed=2, failed=3)
    xml = junit.read_text()
    assert xml.count("<failure") == 3 and "OVER BUDGET" in xml  # the JUnit file says so too
    result.stdout.fnmatch_lines(["*CPU-seconds by folder*", "* CPU-s * s     5 tests  test_suite.py*"])


def test_the_slow_marker_needs_its_reason_under_xdist_too(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "import pytest\n\n@pytest.mark.slow\ndef test_x():\n    pass\n", "-n", "2")
    assert result.ret != pytest.ExitCode.OK
    assert "@pytest.mark.slow needs the reason" in result.stdout.str() + result.stderr.str()


def test_within_budget_the_run_passes_and_prints_its_time(pytester: pytest.Pytester, monkeypatch) -> None:
    monkeypatch.setenv("DDPKIT_TEST_BUDGET_S", "5")
    result = _run(pytester, SUITE)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*suite wall time * s*"])


def test_the_slow_marker_needs_its_reason(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "import pytest\n\n@pytest.mark.slow\ndef test_x():\n    pass\n")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "@pytest.mark.slow needs the reason" in result.stderr.str()

"""Tests marked alone (tests/alone.py) run with no other test beside them under pytest-xdist, on a suite of its own:
each test writes when it starts and ends, and the spans of the one marked alone overlap no other."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import json, os, time
import pytest

def _span(name, seconds):
    start = time.time()
    time.sleep(seconds)
    with open(os.environ["SPANS"], "a") as f:
        f.write(json.dumps([name, start, time.time()]) + "\\n")

@pytest.mark.parametrize("n", range(6))
def test_beside(n):
    _span(f"beside{n}", 0.3)

@pytest.mark.alone("on purpose")
def test_alone():
    _span("alone", 0.6)
"""


@pytest.fixture(autouse=True)
def _plugin_path(monkeypatch) -> None:  # where alone.py is, for the subprocess
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(Path(__file__).parent),
                                                                 os.environ.get("PYTHONPATH")) if p))


def test_a_test_marked_alone_overlaps_no_other_under_xdist(pytester: pytest.Pytester, monkeypatch) -> None:
    spans = pytester.path / "spans.jsonl"
    monkeypatch.setenv("SPANS", str(spans))
    pytester.makeconftest('pytest_plugins = ["alone"]\n')
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(passed=7)
    found = {name: (start, end) for name, start, end in map(json.loads, spans.read_text().splitlines())}
    start, end = found.pop("alone")
    assert all(e <= start or s >= end for s, e in found.values()), (start, end, found)
    # and the others did run two at a time: the lock they share is shared
    assert any(s < e2 and s2 < e for (s, e) in found.values() for (s2, e2) in found.values() if (s, e) != (s2, e2))


SECOND = """
import pytest
from test_suite import _span

@pytest.mark.parametrize("n", range(4))
def test_more_beside(n):
    _span(f"more{n}", 0.2)

@pytest.mark.alone("on purpose")
@pytest.mark.parametrize("n", range(2))
def test_also_alone(n):
    _span(f"alone{n}", 0.3)
"""


def test_the_tests_marked_alone_run_on_one_worker_one_after_another(pytester: pytest.Pytester, monkeypatch) -> None:
    # Under --dist loadgroup they form one group, and the worker keeps the machine from one to the next: no other
    # test runs between the first of them and the last.
    spans = pytester.path / "spans.jsonl"
    monkeypatch.setenv("SPANS", str(spans))
    pytester.makeconftest('pytest_plugins = ["alone"]\n')
    pytester.makepyfile(test_suite=SUITE.replace('f.write(json.dumps([name, start, time.time()])',
                                                 'f.write(json.dumps([name, start, time.time(), '
                                                 'os.environ["PYTEST_XDIST_WORKER"]])'),
                        test_second=SECOND)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup")
    result.assert_outcomes(passed=13)
    found = {name: (start, end, worker) for name, start, end, worker in map(json.loads, spans.read_text().splitlines())}
    alone = {name: found.pop(name) for name in ("alone", "alone0", "alone1")}
    assert len({worker for _, _, worker in alone.values()}) == 1, (
        f"{alone}: pytest {pytest.__version__} and pytest-xdist ignore the groups (pytest-xdist#1386, pytest 9.2): "
        "bash scripts/setup.sh installs the pytest pyproject.toml asks for")
    first, last = min(s for s, _, _ in alone.values()), max(e for _, e, _ in alone.values())
    assert all(e <= first or s >= last for s, e, _ in found.values()), (first, last, found)


@pytest.mark.parametrize("workers", ["0", "2"])
def test_the_alone_marker_needs_its_reason(pytester: pytest.Pytester, workers: str) -> None:
    pytester.makeconftest('pytest_plugins = ["alone"]\n')
    pytester.makepyfile(test_suite="import pytest\n\n@pytest.mark.alone\ndef test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", workers)
    result.assert_outcomes(errors=1)  # at its set-up
    result.stdout.fnmatch_lines(["*@pytest.mark.alone needs the reason*"])

"""The suite's time budget, kept by the suite itself (a pytest plugin, loaded by ``tests/conftest.py``).

* At the end of every run it prints its own wall time and its slowest tests.
* A test that takes longer than the budget (``BUDGET_S``, 30 s, setup and
  teardown included; ``DDPKIT_TEST_BUDGET_S`` overrides it) fails the run
  unless it carries ``@pytest.mark.slow("why it needs that long")``: the
  suite grows by a minute whenever a feature adds a slow test unnoticed, and
  this makes each one a decision with a reason.

Under pytest-xdist the controller sees every test's report, so the budget
holds across workers.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest

BUDGET_S = 30.0
"""A test (setup, call and teardown together) may take this long without saying why."""
SLOWEST_SHOWN = 8


def budget_s() -> float:
    return float(os.environ.get("DDPKIT_TEST_BUDGET_S", BUDGET_S))


class Budget:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seconds: dict[str, float] = defaultdict(float)
        self.excused: set[str] = set()

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            marker = item.get_closest_marker("slow")
            if marker is not None and not (marker.args and isinstance(marker.args[0], str) and marker.args[0]):
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.slow needs the reason as its argument")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        if "slow" in report.keywords:
            self.excused.add(report.nodeid)

    def over(self) -> list[tuple[str, float]]:
        limit = budget_s()
        return sorted(((n, s) for n, s in self.seconds.items() if s > limit and n not in self.excused),
                      key=lambda x: -x[1])

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.over() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:  # type: ignore[no-untyped-def]
        wall = time.monotonic() - self.started
        slowest = sorted(self.seconds.items(), key=lambda x: -x[1])[:SLOWEST_SHOWN]
        terminalreporter.write_sep("-", f"suite wall time {wall:.1f} s ({wall / 60:.1f} min), "
                                        f"{len(self.seconds)} tests")
        for nodeid, seconds in slowest:
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}{'  (slow)' if nodeid in self.excused else ''}")
        for nodeid, seconds in self.over():
            terminalreporter.write_line(
                f"OVER BUDGET: {nodeid} took {seconds:.1f} s, more than {budget_s():g} s, and carries no "
                "@pytest.mark.slow(\"why\"): make it cheaper, or mark it with the reason", red=True)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow(reason): a test allowed more than the 30 s budget, and why")
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) keeps the budget
        config.pluginmanager.register(Budget(), "ddpkit-budget")

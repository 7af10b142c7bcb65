"""The suite's time budget, kept by the suite itself (a pytest plugin, loaded by ``tests/conftest.py``).

* A test that takes longer than the budget (``BUDGET_S``, 30 s, setup and
  call together; ``DDPKIT_TEST_BUDGET_S`` overrides it) fails, in its own
  report (the terminal, ``--junitxml``, the exit status), unless it carries
  ``@pytest.mark.slow("why it needs that long")``: the suite grows by a
  minute whenever a feature adds a slow test unnoticed, and this makes each
  one a decision with a reason. Only that marker excuses a test (not a
  keyword of the same name: a parameter's id, an attribute), and the marker
  without its reason is a usage error.
* At the end of every run it prints its own wall time and its slowest tests.

The check runs where the test runs, so under pytest-xdist each worker fails
its own tests and checks the marker's reason; the controller prints the
summary from every worker's reports.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterator

import pytest

BUDGET_S = 30.0
"""A test (setup and call together) may take this long without saying why."""
SLOWEST_SHOWN = 8
_SPENT = pytest.StashKey[float]()


def budget_s() -> float:
    return float(os.environ.get("DDPKIT_TEST_BUDGET_S", BUDGET_S))


def _unexplained(item: pytest.Item) -> bool:
    """The slow marker without its reason."""
    marker = item.get_closest_marker("slow")
    return marker is not None and not (marker.args and isinstance(marker.args[0], str) and marker.args[0])


def _reason(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("slow")
    return marker.args[0] if marker is not None and marker.args and isinstance(marker.args[0], str) else None


class Budget:
    """Fails a test over budget without a reason (in every process that runs tests).

    ``worker``: a pytest-xdist worker, where a usage error at collection would crash the controller: there the
    marker without its reason fails the test at its setup instead.
    """

    def __init__(self, worker: bool) -> None:
        self.worker = worker
        self.limit = budget_s()  # read once, at the start: a test that changes the variable changes no budget

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            if not self.worker and _unexplained(item):
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.slow needs the reason as its argument")

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if _unexplained(item):
            pytest.fail(f"{item.nodeid}: @pytest.mark.slow needs the reason as its argument", pytrace=False)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
        report = yield
        if report.when in ("setup", "call"):
            item.stash[_SPENT] = item.stash.get(_SPENT, 0.0) + report.duration
        spent = item.stash.get(_SPENT, 0.0)
        if report.when == "call" and report.passed and spent > self.limit and _reason(item) is None:
            report.outcome = "failed"
            report.longrepr = (f"OVER BUDGET: {item.nodeid} took {spent:.1f} s, more than {self.limit:g} s, and "
                               "carries no @pytest.mark.slow(\"why\"): make it cheaper, or mark it with the reason")
        return report


class Summary:
    """The run's wall time and slowest tests (in the controller, or in a run without xdist)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seconds: dict[str, float] = defaultdict(float)
        self.over: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        if report.failed and isinstance(report.longrepr, str) and report.longrepr.startswith("OVER BUDGET"):
            self.over.append(report.longrepr)

    def pytest_terminal_summary(self, terminalreporter) -> None:  # type: ignore[no-untyped-def]
        wall = time.monotonic() - self.started
        slowest = sorted(self.seconds.items(), key=lambda x: -x[1])[:SLOWEST_SHOWN]
        terminalreporter.write_sep("-", f"suite wall time {wall:.1f} s ({wall / 60:.1f} min), "
                                        f"{len(self.seconds)} tests")
        for nodeid, seconds in slowest:
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
        for line in self.over:
            terminalreporter.write_line(line, red=True)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow(reason): a test allowed more than the 30 s budget, and why")
    config.pluginmanager.register(Budget(worker=hasattr(config, "workerinput")), "ddpkit-budget")
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) prints the summary
        config.pluginmanager.register(Summary(), "ddpkit-budget-summary")

"""The suite's time budget, kept by the suite itself (a pytest plugin, loaded by ``tests/conftest.py``).

* A test that costs more than the budget (``BUDGET_S``, 30; setup and call
  together; ``DDPKIT_TEST_BUDGET_S`` overrides it) fails, in its own report
  (the terminal, ``--junitxml``, the exit status), unless it carries
  ``@pytest.mark.slow("why it needs that long")``: the suite grows by a
  minute whenever a feature adds a slow test unnoticed, and this makes each
  one a decision with a reason. Only that marker excuses a test (not a
  keyword of the same name: a parameter's id, an attribute), and the marker
  without its reason is a usage error. The cost is counted twice, and either
  may exceed it: CPU-seconds, of the test process and of every process it
  started (what the test costs, whatever else the machine runs), and wall
  seconds, the budget times the number of pytest-xdist workers sharing the
  machine (what catches a test that mostly waits). Work a test does for the
  whole session (a reference run shared by several tests,
  ``tests/shared_runs.py``) is not the test's: :func:`charge_to_session`.
* Under pytest-xdist the tests marked slow are handed out first: the longest
  tests start early and the short ones fill the end, instead of one worker
  running a long test alone at the end.
* At the end of every run it prints its own wall time, its slowest tests, and
  the CPU-seconds each folder of ``tests/`` spent (the test process and every
  process it started, see :func:`cpu_seconds`) against that folder's budget
  (``FOLDER_CPU_S``): a folder over its budget is named in red, so that the
  next capability sees what its tests cost. CPU-seconds, unlike wall time,
  hardly depend on what else the machine runs (pytest-xdist's other worker);
  the report does not fail the run (timing is never a pass/fail test), the
  per-test budget does. ``DDPKIT_TEST_TIMES=FILE`` writes every test's wall
  and CPU seconds there as JSON.

The check runs where the test runs, so under pytest-xdist each worker fails
its own tests and checks the marker's reason; the controller prints the
summary from every worker's reports (each test's CPU-seconds ride in its
report's ``user_properties``).
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

BUDGET_S = 30.0
"""A test (setup and call together) may take this long without saying why."""
SLOWEST_SHOWN = 8
_SPENT = pytest.StashKey[float]()
_CPU_AT = pytest.StashKey[float]()
_CPU = pytest.StashKey[float]()
FOLDER_CPU_S: dict[str, float] = {
    "tests/train": 2200, "tests/launcher": 650, "tests/parallel": 600, "tests": 575, "tests/gpu": 400,
    "tests/bench": 250, "tests/runtime": 200, "tests/comm": 185, "tests/integrations": 65, "tests/doctor": 55,
    "tests/data": 15, "tests/models": 5,
}
"""The CPU-seconds each folder of ``tests/`` may spend in a whole run (the folders' sum is the suite's): a clean
clone's run of 2026-12-02 (4,142 CPU-s in all, counted in control groups: :class:`CpuGroup`) plus a quarter, room
for one more capability; a folder not listed has no budget."""
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _live_descendants_cpu(root: int) -> float:
    """User and system CPU-seconds so far of the live processes descended from ``root``, and of the children they
    reaped (from ``/proc``)."""
    parent_of: dict[int, int] = {}
    ticks: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0.0
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        pid = int(name)
        parent_of[pid] = int(fields[1])
        # utime, stime, and cutime, cstime: the children it reaped (a pool's ranks, reaped by their forkserver)
        ticks[pid] = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    children: dict[int, list[int]] = defaultdict(list)
    for pid, parent in parent_of.items():
        children[parent].append(pid)
    total, todo = 0, list(children[root])
    while todo:
        pid = todo.pop()
        total += ticks[pid]
        todo.extend(children[pid])
    return total * _TICK_S


class CpuGroup:
    """A control group of this process's own, whose CPU account holds every process it starts, at any depth.

    Counting a process tree by its parents' records misses every process whose parent exits first: re-parented
    to init, it and all it reaped leave the tree uncounted (a launcher's forkserver outlives the launcher, and the
    workers it reaped go with it: a test of two ``ddpkit train`` runs of five processes read 5 CPU-seconds where
    the machine was busy for 59). A process stays in its control group whoever its parent is. The group is made
    under this process's own (so a nested pytest's counts in the outer one's, the account being hierarchical),
    with cgroup v1's ``cpuacct`` controller or cgroup v2's ``cpu.stat``, where the machine has one that only
    counts (a ``cpuacct`` mounted with ``cpu``, or a v2 parent that hands its children the ``cpu`` controller,
    would make the group one share of the CPU against the other processes: timing the suite changed) and lets
    this process make groups (root); elsewhere :func:`cpu_seconds` counts by parents as before. Groups a run left
    (a process of a test still in it at the end) are removed by the next run once empty.
    """

    def __init__(self, folder: Path, usage: Path, scale: float) -> None:
        self.folder, self.usage, self.scale = folder, usage, scale

    @classmethod
    def make(cls) -> CpuGroup | None:
        """This process moved into a new group of its own, or None where none can be made."""
        try:
            mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
            groups = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
        except OSError:
            return None
        for _, where, kind, options, *_ in mounts:
            if kind == "cgroup" and "cpuacct" in options.split(",") and "cpu" not in options.split(","):
                mine = next((g[2] for g in groups if g[1].split(",") == ["cpuacct"]), None)
                usage, scale = "cpuacct.usage", 1e-9  # nanoseconds
            elif kind == "cgroup2":
                mine = next((g[2] for g in groups if g[0] == "0" and not g[1]), None)
                usage, scale = "cpu.stat", 1e-6  # usage_usec
            else:
                continue
            if mine is None:
                continue
            parent = Path(where) / mine.lstrip("/")
            try:
                if kind == "cgroup2" and "cpu" in (parent / "cgroup.subtree_control").read_text().split():
                    continue
            except OSError:
                continue
            for old in parent.glob("ddpkit-tests-*"):
                try:
                    old.rmdir()  # an earlier run's, empty now (one still holding a process stays)
                except OSError:
                    pass
            folder = parent / f"ddpkit-tests-{os.getpid()}-{time.time_ns()}"
            group = cls(folder, folder / usage, scale)
            try:
                group.folder.mkdir()
            except OSError:
                continue
            try:
                (group.folder / "cgroup.procs").write_text(str(os.getpid()))
                group.seconds()
            except (OSError, ValueError, StopIteration):
                group.leave()
                continue
            return group
        return None

    def seconds(self) -> float:
        """CPU-seconds of every process that was in the group, since it was made."""
        text = self.usage.read_text()
        if self.usage.name == "cpu.stat":
            text = next(line.split()[1] for line in text.splitlines() if line.startswith("usage_usec "))
        return int(text) * self.scale

    def leave(self) -> None:
        """This process back in the group it came from; the group removed once no process is left in it."""
        try:
            (self.folder.parent / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            pass
        for _ in range(10):
            try:
                self.folder.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)  # a process of the last test still exiting; one left running keeps it (see above)


_GROUP: list[CpuGroup | None] = []
"""This process's :class:`CpuGroup`, once it ran a test (or None, where it cannot have one)."""


def cpu_seconds() -> float:
    """CPU-seconds of this process and of every process it started, so far (see :class:`CpuGroup`).

    The difference of two readings is what happened between them. Without a control group it counts by parents:
    this process, its reaped descendants and its live ones; then a process alive at both readings counts the time
    it spent in between, one reaped in between its whole life (the first reading held what it had then), and
    one that outlives its parent (an orphan a kill left behind, a forkserver) stops counting when it is
    re-parented, with every process it reaped.
    """
    if not _GROUP:
        _GROUP.append(CpuGroup.make())
    if _GROUP[0] is not None:
        return _GROUP[0].seconds()
    me, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return (me.ru_utime + me.ru_stime + reaped.ru_utime + reaped.ru_stime
            + _live_descendants_cpu(os.getpid()))


_SESSION = [0.0, 0.0]
"""CPU and wall seconds spent so far, in this process, on work that is the session's, not a test's."""
_SESSION_AT = pytest.StashKey[tuple[float, float]]()


def charge_to_session(cpu_s: float, wall_s: float) -> None:
    """Say that ``cpu_s`` CPU-seconds and ``wall_s`` seconds of the running test were the session's work (a
    reference run computed once for every test that compares with it): the test's budget does not count them."""
    _SESSION[0] += cpu_s
    _SESSION[1] += wall_s


def folder_of(nodeid: str) -> str:
    """The folder of ``tests/`` a test belongs to (``tests`` for the files at its top)."""
    parts = nodeid.split("::", 1)[0].split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


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
        self.sharing = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))) if worker else 1
        """How many pytest-xdist workers share the machine (1 without xdist): the wall-clock limit's factor."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            if not self.worker and _unexplained(item):
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.slow needs the reason as its argument")
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the slow ones first

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> None:
        item.stash[_CPU_AT] = cpu_seconds()
        item.stash[_SESSION_AT] = (_SESSION[0], _SESSION[1])

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if _unexplained(item):
            pytest.fail(f"{item.nodeid}: @pytest.mark.slow needs the reason as its argument", pytrace=False)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
        report = yield
        if report.when in ("setup", "call"):
            item.stash[_SPENT] = item.stash.get(_SPENT, 0.0) + report.duration
        if report.when == "teardown":  # the whole test, its fixtures' set-up and tear-down included
            report.user_properties.append(("cpu_s", cpu_seconds() - item.stash.get(_CPU_AT, cpu_seconds())))
        if report.when != "call" or not report.passed or _reason(item) is not None:
            return report
        spent, cpu = item.stash.get(_SPENT, 0.0), cpu_seconds() - item.stash.get(_CPU_AT, cpu_seconds())
        session = item.stash.get(_SESSION_AT, (0.0, 0.0))
        cpu, spent = cpu - (_SESSION[0] - session[0]), spent - (_SESSION[1] - session[1])
        wall_limit = self.limit * self.sharing
        over = []
        if cpu > self.limit:
            over.append(f"{cpu:.1f} CPU-seconds (itself and its processes), more than {self.limit:g}")
        if spent > wall_limit:
            over.append(f"{spent:.1f} s, more than {wall_limit:g} s"
                        + (f" ({self.limit:g} s x {self.sharing} workers)" if self.sharing > 1 else ""))
        if over:
            report.outcome = "failed"
            report.longrepr = (f"OVER BUDGET: {item.nodeid} took {' and '.join(over)}, and carries no "
                               "@pytest.mark.slow(\"why\"): make it cheaper, or mark it with the reason")
        return report


class Summary:
    """The run's wall time and slowest tests (in the controller, or in a run without xdist)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.over: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        for key, value in report.user_properties:
            if key == "cpu_s":
                self.cpu[report.nodeid] += value
        if report.failed and isinstance(report.longrepr, str) and report.longrepr.startswith("OVER BUDGET"):
            self.over.append(report.longrepr)

    def pytest_terminal_summary(self, terminalreporter) -> None:  # type: ignore[no-untyped-def]
        wall = time.monotonic() - self.started
        slowest = sorted(self.seconds.items(), key=lambda x: -x[1])[:SLOWEST_SHOWN]
        terminalreporter.write_sep("-", f"suite wall time {wall:.1f} s ({wall / 60:.1f} min), "
                                        f"{len(self.seconds)} tests")
        for nodeid, seconds in slowest:
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
        self._folders(terminalreporter)
        if path := os.environ.get("DDPKIT_TEST_TIMES"):  # every test's wall and CPU seconds, for a closer look
            with open(path, "w") as f:
                json.dump({n: {"wall_s": round(s, 2), "cpu_s": round(self.cpu.get(n, 0.0), 2)}
                           for n, s in sorted(self.seconds.items())}, f, indent=1)
        for line in self.over:
            terminalreporter.write_line(line, red=True)


    def _folders(self, terminalreporter) -> None:  # type: ignore[no-untyped-def]
        wall: dict[str, float] = defaultdict(float)
        cpu: dict[str, float] = defaultdict(float)
        count: dict[str, int] = defaultdict(int)
        for nodeid, seconds in self.seconds.items():
            folder = folder_of(nodeid)
            wall[folder] += seconds
            cpu[folder] += self.cpu.get(nodeid, 0.0)
            count[folder] += 1
        if not any(cpu.values()):
            return
        terminalreporter.write_sep("-", f"CPU-seconds by folder: {sum(cpu.values()):.0f} in all "
                                        "(the tests and the processes they started)")
        for folder in sorted(cpu, key=lambda f: -cpu[f]):
            budget = FOLDER_CPU_S.get(folder)
            over = budget is not None and cpu[folder] > budget
            terminalreporter.write_line(
                f"{cpu[folder]:8.0f} CPU-s {wall[folder]:7.0f} s  {count[folder]:4d} tests  {folder}"
                + (f"  (budget {budget:g}{': OVER' if over else ''})" if budget is not None else ""), red=over)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _GROUP and _GROUP[0] is not None:
        _GROUP.pop().leave()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow(reason): a test allowed more than the 30 s budget, and why")
    config.pluginmanager.register(Budget(worker=hasattr(config, "workerinput")), "ddpkit-budget")
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) prints the summary
        config.pluginmanager.register(Summary(), "ddpkit-budget-summary")

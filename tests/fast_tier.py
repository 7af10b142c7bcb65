"""The fast tier's reach, measured in the whole suite's own pass (a pytest plugin, loaded by ``tests/conftest.py``).

The fast tier (``pytest -m "not slow"``, what a developer runs before each
commit) must touch every module of the package and run every command. When
the whole suite runs (``pytest`` with no selection: what CI runs), each
process that runs tests measures, with coverage.py, the tests *not* marked
slow and nothing else: the test process itself between such a test's start
and end, and every Python process started meanwhile (the launcher's workers,
``ddpkit train``'s processes, a rank pool first used by such a test, through
coverage.py's ``COVERAGE_PROCESS_CONFIG``, which is present in the
environment only during those tests). At the end the controller combines
the data and fails the run, naming them, when a module of the package had
no function run (a module of constants and re-exports: was never imported),
or a command's handler in ``ddpkit.cli`` never ran.

So the check costs the suite a few per cent of the fast tests' time, not a
second run of the fast tier. A rank pool started by a fast test and used
later by a slow one is measured throughout (it cannot tell the two apart):
the pools run unit tests, whose modules fast tests run as well.

The check runs only with ``DDPKIT_FAST_TIER_CHECK=1`` (the plugin's own test sets it). It is off in
CI's run for now: the slow tests run first, so the rank pools are usually started by a slow test and never
measured, and the whole run of 2026-11-28 named 24 modules, most of them run by fast tests in those pools
(the DDP and ZeRO internals), a few truly reached by slow tests alone (``train/fault_tolerant_async.py``,
``train/fault_tolerant_loop.py``, ``launcher/mpi_group.py``, ``launcher/mpi_rank.py``, ``bench/sections/dp_vs_ddp.py``).
"""

from __future__ import annotations

import ast
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "ddpkit"
COMMANDS = {"ddpkit launch": "_launch", "ddpkit train": "_train", "ddpkit bench": "_bench",
            "ddpkit bench collectives": "_bench_collectives", "ddpkit bench strategies": "_bench_strategies",
            "ddpkit bench backends": "_bench_backends", "ddpkit bench failures": "_bench_failures",
            "ddpkit doctor": "_doctor"}
"""Each command and its handler in ``ddpkit/cli.py``."""
DATA_ENV = "DDPKIT_FAST_TIER_DATA"
"""The folder every process of the run writes its coverage data into (set by the controller)."""
SWITCH_ENV = "DDPKIT_FAST_TIER_CHECK"
RC = """[run]
source_pkgs = ddpkit
parallel = true
patch = subprocess, _exit, fork
sigterm = true
data_file = {data}
disable_warnings = no-data-collected, module-not-measured, no-sysmon, already-imported
"""
_SUBPROCESS_ENV = "COVERAGE_PROCESS_CONFIG"
"""What coverage.py's ``patch = subprocess`` puts in the environment: a Python process started with it measures
itself (through the ``.pth`` file coverage.py installs)."""


@functools.lru_cache(maxsize=None)
def function_lines(path: Path) -> dict[str, set[int]]:
    """The lines of each function's body in a module (nested functions counted in their own right); not to be
    changed by the caller (cached)."""
    found: dict[str, set[int]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = {n.lineno for stmt in node.body for n in ast.walk(stmt) if hasattr(n, "lineno")}
            found.setdefault(node.name, set()).update(lines)
    return found


def untouched(executed: dict[str, set[int]]) -> list[str]:
    """The package's modules of which no function ran (or, without functions, that were never imported), from
    ``executed``: file path -> lines run."""
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        ran = executed.get(str(path), set())
        bodies = set().union(*function_lines(path).values()) if function_lines(path) else set()
        if not (ran & bodies if bodies else ran):
            missing.append(str(path.relative_to(PACKAGE.parent)))
    return missing


def commands_not_run(executed: dict[str, set[int]]) -> list[str]:
    handlers = function_lines(PACKAGE / "cli.py")
    ran = executed.get(str(PACKAGE / "cli.py"), set())
    return [command for command, handler in COMMANDS.items() if not ran & handlers[handler]]


def whole_suite(config: pytest.Config) -> bool:
    """Whether this run checks the fast tier: only with ``DDPKIT_FAST_TIER_CHECK=1`` for now (see the module
    notes: a rank pool first started by a slow test, as the slow-first order makes usual, is not measured, so
    a whole run names modules that fast tests do run in those pools)."""
    del config
    return os.environ.get(SWITCH_ENV, "") == "1"


def _slow(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None


class Measure:
    """In a process that runs tests: coverage.py on during the fast tests, off during the slow ones."""

    def __init__(self, data: Path) -> None:
        import coverage

        rc = data / "coveragerc"
        self.cov = coverage.Coverage(config_file=str(rc), data_suffix=True)
        self.subprocesses: str | None = None
        self.on = False

    def _start(self) -> None:
        if not self.on:
            self.cov.start()
            self.on = True
            self.subprocesses = self.subprocesses or os.environ.get(_SUBPROCESS_ENV)
        if self.subprocesses:
            os.environ[_SUBPROCESS_ENV] = self.subprocesses

    def _stop(self) -> None:
        if self.on:
            self.cov.stop()
            self.on = False
        os.environ.pop(_SUBPROCESS_ENV, None)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        if _slow(item):
            self._stop()
        else:
            self._start()
        try:
            return (yield)
        finally:
            self._stop()

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self) -> None:
        self._stop()
        self.cov.save()


class Check:
    """In the controller (or a run without xdist): make the data folder, then combine and judge at the end."""

    def __init__(self) -> None:
        self.data = Path(tempfile.mkdtemp(prefix="ddpkit-fast-tier-"))
        (self.data / "coveragerc").write_text(RC.format(data=self.data / ".coverage"))
        # xdist's workers start after this, with it in their environment; the pid keeps other pytest runs that
        # inherit it (a test's own pytest) out of the folder.
        os.environ[DATA_ENV] = f"{os.getpid()}:{self.data}"
        self.missing: tuple[list[str], list[str]] | None = None

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        import coverage

        if session.shouldfail or session.shouldstop:
            return  # an interrupted run has not run the whole fast tier
        cov = coverage.Coverage(config_file=str(self.data / "coveragerc"))
        cov.combine(data_paths=[str(self.data)], keep=False)
        data = cov.get_data()
        executed = {str(Path(f).resolve()): set(data.lines(f) or ()) for f in data.measured_files()}
        self.missing = (untouched(executed), commands_not_run(executed))
        if any(self.missing):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        shutil.rmtree(self.data, ignore_errors=True)

    def pytest_terminal_summary(self, terminalreporter) -> None:  # type: ignore[no-untyped-def]
        if self.missing is None:
            return
        modules, commands = self.missing
        if not modules and not commands:
            terminalreporter.write_sep("-", "the fast tier ran every module of the package and every command")
            return
        terminalreporter.write_sep("-", "FAST TIER INCOMPLETE", red=True)
        if modules:
            terminalreporter.write_line(f"modules the fast tier does not run (give each a fast test): "
                                        f"{', '.join(modules)}", red=True)
        if commands:
            terminalreporter.write_line(f"commands the fast tier does not run (give each a fast test): "
                                        f"{', '.join(commands)}", red=True)


def pytest_configure(config: pytest.Config) -> None:
    try:
        import coverage  # noqa: F401
    except ImportError:
        return  # the test extras are not installed; the suite says so elsewhere
    worker = hasattr(config, "workerinput")
    if not worker and whole_suite(config):
        config.pluginmanager.register(Check(), "ddpkit-fast-tier-check")
    owner, _, data = os.environ.get(DATA_ENV, "").partition(":")
    if not data:
        return
    if worker and int(owner) == os.getppid():  # a worker of the controller that made the folder
        config.pluginmanager.register(Measure(Path(data)), "ddpkit-fast-tier-measure")
    elif not worker and int(owner) == os.getpid() and not getattr(config.option, "numprocesses", None):
        config.pluginmanager.register(Measure(Path(data)), "ddpkit-fast-tier-measure")  # no workers: it runs tests

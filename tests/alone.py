"""Tests that run with the machine to themselves, under pytest-xdist (a pytest plugin, loaded by ``tests/conftest.py``).

``@pytest.mark.alone("why")`` on a test (or a module's ``pytestmark``) says that no other test may run beside it:
its own processes keep every core busy (a job of three or four ranks on a two-core machine: a second test beside
it gains nothing and slows both), or what it checks depends on time (a fault sent while a step runs, a peer not
heard for some seconds, a kernel memory cap). Every other test holds a shared lock while it runs; a test marked
alone takes it exclusively, so it starts once the tests running on the other workers end, and they wait for it
(a waiting exclusive request goes before new shared ones: a turnstile). The wait is outside the test's time: the
lock is taken before :mod:`budget` starts counting.

Under pytest-xdist's ``--dist loadgroup`` the tests marked alone form one group (``xdist_group("alone")``, unless
a test names a group of its own), so one worker runs them one after another, and it keeps the machine from one to
the next: each test marked alone used to wait for the test the other worker had in hand. Measured on whole runs
(the run's wall time less the alone tests' own and half the others'): 51 s of such waits on 9d84793, 22 s with the
group (c218b01). What remains of the idle core is the alone tests' own time (about 760 s a run, 1.2 cores busy).

The locks are files beside pytest-xdist's workers' temporary folders; without xdist there is nothing to wait for
and the plugin does nothing.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def _reason(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("alone")
    if marker is None:
        return None
    return marker.args[0] if marker.args and isinstance(marker.args[0], str) and marker.args[0] else ""


class Reason:
    """Without xdist: no lock, but the marker still needs its reason."""

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if _reason(item) == "":
            pytest.fail(f"{item.nodeid}: @pytest.mark.alone needs the reason as its argument", pytrace=False)


class Alone(Reason):
    """The locks of one pytest-xdist worker (see the module notes)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.turnstile = os.open(folder / "turnstile.lock", os.O_RDWR | os.O_CREAT, 0o644)
        self.machine = os.open(folder / "machine.lock", os.O_RDWR | os.O_CREAT, 0o644)
        self.held = False
        """The machine is this worker's still: the test before was alone, and so is this one."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:  # before pytest-xdist's own hook reads the groups
            if _reason(item) is not None and item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group("alone"))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        alone = _reason(item) is not None
        if not self.held:
            fcntl.flock(self.turnstile, fcntl.LOCK_EX)  # behind an exclusive request that came first
            try:
                fcntl.flock(self.machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            finally:
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        try:
            return (yield)
        finally:
            self.held = alone and nextitem is not None and _reason(nextitem) is not None
            if not self.held:
                fcntl.flock(self.machine, fcntl.LOCK_UN)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone(reason): no other test runs beside this one under pytest-xdist, and why")
    worker = getattr(config, "workerinput", None)
    if worker is not None:  # the locks live where every worker of this run finds them
        folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"ddpkit-alone-{worker['testrunuid']}"
        config.pluginmanager.register(Alone(folder), "ddpkit-alone")
    elif not hasattr(config.option, "numprocesses") or not config.option.numprocesses:
        config.pluginmanager.register(Reason(), "ddpkit-alone-reason")

"""The fast tier's reach (``tests/fast_tier.py``): the checks themselves, and the plugin on a suite of its own,
in one process and under pytest-xdist, with a slow test whose code must not count and a subprocess whose must."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fast_tier import PACKAGE, commands_not_run, function_lines, untouched

pytest_plugins = ["pytester"]
pytest.importorskip("coverage", reason="coverage.py measures the fast tier: pip install 'ddpkit[test]'")


def test_the_checks_see_what_did_not_run() -> None:
    # On made-up data: nothing ran, then everything but one function of one module and one command.
    assert len(untouched({})) == len(list(PACKAGE.rglob("*.py")))
    everything = {str(p): set(range(1, 10_000)) for p in PACKAGE.rglob("*.py")}
    assert untouched(everything) == [] and commands_not_run(everything) == []
    stage3 = str(PACKAGE / "parallel" / "zero" / "stage3.py")
    everything[stage3] = set(range(1, 10_000)) - set().union(*function_lines(Path(stage3)).values())
    assert untouched(everything) == ["ddpkit/parallel/zero/stage3.py"]
    cli = str(PACKAGE / "cli.py")
    everything[cli] = everything[cli] - function_lines(PACKAGE / "cli.py")["_doctor"]
    assert commands_not_run(everything) == ["ddpkit doctor"]


SUITE = '''
import subprocess, sys
import pytest

def test_fast_in_process():
    import ddpkit.runtime.process  # imported only: no function of it runs here
    from ddpkit.runtime.variables import backend
    backend({})

def test_fast_in_a_subprocess():
    subprocess.run([sys.executable, "-c", "from ddpkit.data.shards import VirtualShards; VirtualShards(8, 4, 2)"],
                   check=True)

@pytest.mark.slow("its code must not count")
def test_slow():
    from ddpkit.parallel.zero.partition import partition
    partition([{"params": []}], 2)
    subprocess.run([sys.executable, "-c", "from ddpkit.runtime.process import key_range_chain; "
                    "key_range_chain(0, 2, 1)"], check=True)
'''


@pytest.mark.parametrize("xdist", [pytest.param(False, marks=pytest.mark.slow("the plugin without xdist: what CI runs is the xdist "
                                                                     "case")), pytest.param(True, marks=pytest.mark.slow(
    "two pytest runs of their own; the whole suite runs the plugin for real"))], ids=["one process", "pytest-xdist"])
def test_the_run_fails_naming_the_modules_only_slow_tests_or_none_ran(pytester: pytest.Pytester, monkeypatch,
                                                                      xdist: bool) -> None:
    pytester.makeconftest('pytest_plugins = ["budget", "fast_tier"]\n')
    pytester.makepyfile(test_suite=SUITE)
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("DDPKIT_FAST_TIER_CHECK", "1")
    monkeypatch.delenv("DDPKIT_FAST_TIER_DATA", raising=False)
    monkeypatch.delenv("COVERAGE_PROCESS_CONFIG", raising=False)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *(["-n", "2"] if xdist else []))
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out
    result.assert_outcomes(passed=3)
    missing = next(line for line in out.splitlines() if line.startswith("modules the fast tier does not run"))
    assert "ddpkit/runtime/variables.py" not in missing  # run in the test process
    assert "ddpkit/data/shards.py" not in missing  # run in a process a fast test started
    assert "ddpkit/runtime/process.py" in missing  # imported by a fast test, run by a slow one only
    assert "ddpkit/parallel/zero/partition.py" in missing  # run by a slow test only
    assert "commands the fast tier does not run (give each a fast test): ddpkit launch, ddpkit train" in out

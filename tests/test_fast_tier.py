"""The fast tier (``pytest -m "not slow"``, what a developer runs before each commit) touches every module of the
package and runs every command, measured, not claimed.

The tier runs once under coverage.py, its subprocesses and forked ranks too
(the launcher's workers, the rank pools, ``ddpkit train``'s processes). A
module passes when some line inside one of its functions ran (a module of
constants and re-exports: when it was imported); a command when its handler
in ``ddpkit.cli`` ran. The whole suite stays what CI runs; this test is part
of it, and of the full suite only.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("coverage", reason="coverage.py measures the fast tier: pip install 'ddpkit[test]'")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "ddpkit"
COMMANDS = {"ddpkit launch": "_launch", "ddpkit train": "_train", "ddpkit bench": "_bench",
            "ddpkit bench collectives": "_bench_collectives", "ddpkit bench strategies": "_bench_strategies",
            "ddpkit bench backends": "_bench_backends", "ddpkit bench failures": "_bench_failures",
            "ddpkit doctor": "_doctor"}
"""Each command and its handler in ``ddpkit/cli.py``."""
RC = """[run]
source_pkgs = ddpkit
parallel = true
concurrency = thread, multiprocessing
patch = subprocess, _exit
sigterm = true
data_file = {data}
disable_warnings = no-data-collected, module-not-measured, no-sysmon
"""


def function_lines(path: Path) -> dict[str, set[int]]:
    """The lines of each function's body in a module (nested functions counted in their own right)."""
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


@pytest.mark.slow("runs the whole fast tier (about 4 minutes) under coverage.py, subprocesses included")
def test_the_fast_tier_touches_every_module_and_runs_every_command(tmp_path: Path) -> None:
    import coverage

    rc = tmp_path / "coveragerc"
    rc.write_text(RC.format(data=tmp_path / ".coverage"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    done = subprocess.run([sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-q",
                           "-m", "not slow", "-p", "no:cacheprovider", str(ROOT / "tests")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cov = coverage.Coverage(config_file=str(rc))
    cov.combine(data_paths=[str(tmp_path)])
    data = cov.get_data()
    executed = {str(Path(f).resolve()): set(data.lines(f) or ()) for f in data.measured_files()}
    assert untouched(executed) == [], "modules the fast tier does not run: give each a fast test"
    assert commands_not_run(executed) == [], "commands the fast tier does not run: give each a fast test"

"""The documentation cannot drift from the code: every command and script in it runs, and the site builds.

Every fenced block of the README and ``docs/`` in a language that is a
command or a script (bash, sh, shell, console, python, yaml) is preceded by
one of these marks, else this test fails:

``<!-- test: run -->``
    a shell block runs line by line (``bash -e``), a Python block as a script;
``<!-- test: launch N -->``
    a Python block runs under ``ddpkit launch --nproc-per-node N``;
``<!-- test: not run (why) -->``
    the block is shown only (a cluster, another machine, the suite itself).

Blocks run in a scratch checkout: the project's ``.venv``, ``examples``,
``scripts``, ``src`` and ``tests`` linked in, ``../shared`` beside it, so the
paths the docs use work, and whatever a command writes (``runs/``) is thrown
away. Output blocks are written as ``text``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from procs import base_env

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
SCRIPT_LANGUAGES = {"bash", "sh", "shell", "console", "python", "py", "yaml"}
MARK = re.compile(r"^<!-- test: (run|launch (\d+)|not run \((.+)\)) -->$")
TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    code: str
    mark: str | None
    """``run``, ``launch N``, ``not run (...)``, or None (unmarked)."""

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with the test mark before each."""
    found = []
    lines = path.read_text().split("\n")
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(`{3,})(\w*)", lines[i])
        if not opening:
            i += 1
            continue
        fence, language = opening.group(2), opening.group(3).lower()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == fence)
        before = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        mark = MARK.match(before)
        found.append(Block(path, i + 1, language, "\n".join(lines[i + 1 : end]), mark.group(1) if mark else None))
        i = end + 1
    return found


def documents() -> list[Path]:
    pages = sorted(p for p in (ROOT / "docs").rglob("*.md") if "bench" not in p.relative_to(ROOT / "docs").parts)
    return [ROOT / "README.md", *pages]


ALL = [b for page in documents() for b in blocks(page)]
RUN = [b for b in ALL if b.mark is not None and not b.mark.startswith("not run")]


def test_every_command_and_script_is_run_or_marked() -> None:
    unmarked = [b.name for b in ALL if b.language in SCRIPT_LANGUAGES and b.mark is None]
    assert not unmarked, (f"blocks with neither <!-- test: run -->, <!-- test: launch N --> nor "
                          f"<!-- test: not run (why) --> before them: {unmarked}")
    unlabelled = [b.name for b in ALL if not b.language]
    assert not unlabelled, f"fences without a language (write ```text for output): {unlabelled}"
    assert len(RUN) >= 10, [b.name for b in RUN]  # the checker found the marks at all


def test_the_checker_reads_marks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- test: launch 2 -->\n```python\nprint(1)\n```\n\ntext\n\n```bash\nls\n```\n")
    found = blocks(page)
    assert [(b.language, b.mark, b.code) for b in found] == [("python", "launch 2", "print(1)"), ("bash", None, "ls")]


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A scratch checkout: the project's folders linked in, ``../shared`` beside it."""
    work = tmp_path / "checkout"
    work.mkdir()
    for name in (".venv", "examples", "scripts", "src", "tests"):
        (work / name).symlink_to(ROOT / name)
    if SHARED.is_dir():
        (tmp_path / "shared").symlink_to(SHARED)
    return work


@pytest.mark.slow("a documentation block: a command or a launched script in fresh processes")
@pytest.mark.parametrize("block", RUN, ids=[b.name for b in RUN])
def test_the_block_runs(block: Block, checkout: Path) -> None:
    if "../shared" in block.code and not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (the MNIST data the block reads)")
    env = {**base_env(), "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    if block.language in ("bash", "sh", "shell"):
        argv = ["bash", "-euo", "pipefail", "-c", block.code]
    else:
        script = checkout / "block.py"
        script.write_text(block.code + "\n")
        count = block.mark.split()[1] if block.mark.startswith("launch") else None
        argv = ([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", count, str(script)] if count
                else [sys.executable, str(script)])
    done = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{block.name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extras are not installed (bash scripts/setup.sh installs them)")
    pytest.importorskip("mkdocstrings", reason="the docs extras are not installed (bash scripts/setup.sh installs them)")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-5000:]
    assert (tmp_path / "site" / "api" / "parallel" / "index.html").read_text().count("register_observer") >= 1

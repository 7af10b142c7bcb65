"""The documentation cannot drift from the code: every command and script in it runs, and the site builds.

Every fenced block of the README and ``docs/`` in a language that is a
command or a script (bash, sh, shell, console, python, yaml) is preceded by
one of these marks, else this test fails:

``<!-- test: run -->``
    a shell block runs line by line (``bash -e``), a Python block as a script;
``<!-- test: launch N -->``
    a Python block runs under ``ddpkit launch --nproc-per-node N``;
``<!-- test: not run (why) -->``
    the block is shown only (a cluster, another machine, the suite itself);
``<!-- test: same as PAGE -->``
    the block's commands run in a block of PAGE (a path from the repository's root; checked: each of its command
    lines, its output directory and comment aside, is a line of a run block
    there), so the same job is not trained twice.

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
MARK = re.compile(r"^<!-- test: (run|launch (\d+)|not run \((.+)\)|same as (\S+\.md)) -->$")
TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    code: str
    mark: str | None
    """``run``, ``launch N``, ``not run (...)``, ``same as PAGE``, or None (unmarked)."""

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
RUN = [b for b in ALL if b.mark is not None and not b.mark.startswith(("not run", "same as"))]
SAME = [b for b in ALL if b.mark is not None and b.mark.startswith("same as")]


def command_lines(code: str) -> list[str]:
    """A shell block's commands, each as one line (continuations joined), without its comment and without the
    value of ``--output-dir`` (where a page writes its run is not the job)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    lines = [" ".join(re.sub(r"\s+#.*$", "", line).split()) for line in joined.split("\n")]
    return [re.sub(r"--output-dir \S+", "--output-dir", line) for line in lines if line and not line.startswith("#")]


def test_every_command_and_script_is_run_or_marked() -> None:
    unmarked = [b.name for b in ALL if b.language in SCRIPT_LANGUAGES and b.mark is None]
    assert not unmarked, (f"blocks with neither <!-- test: run -->, <!-- test: launch N --> nor "
                          f"<!-- test: not run (why) --> before them: {unmarked}")
    unlabelled = [b.name for b in ALL if not b.language]
    assert not unlabelled, f"fences without a language (write ```text for output): {unlabelled}"
    assert len(RUN) >= 10, [b.name for b in RUN]  # the checker found the marks at all


@pytest.mark.parametrize("block", SAME, ids=[b.name for b in SAME])
def test_a_block_marked_same_as_a_page_is_run_there(block: Block) -> None:
    page = ROOT / block.mark.split(" ", 2)[2]  # PAGE from the repository's root
    assert page in documents(), f"{block.name}: {page} is not a page whose blocks this test runs"
    missing = not_run_there(block, page)
    assert not missing, f"{block.name}: not run by a block of {page.relative_to(ROOT)}: {missing}"


def not_run_there(block: Block, page: Path) -> list[str]:
    """The commands of ``block`` that no run block of ``page`` runs (a block without a command: all of nothing,
    refused)."""
    ours = command_lines(block.code)
    if not ours:
        return ["(the block has no command)"]
    there = {line for b in blocks(page) if b.mark == "run" for line in command_lines(b.code)}
    return [line for line in ours if line not in there]


def test_the_same_as_check_sees_a_command_the_page_does_not_run(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- test: run -->\n```bash\nddpkit train --epochs 2 --output-dir runs/a   # two epochs\n```\n\n"
                    "<!-- test: not run (shown) -->\n```bash\nddpkit train --epochs 5\n```\n")
    assert command_lines("ddpkit train --epochs 2 \\\n    --output-dir runs/readme\n") == \
        ["ddpkit train --epochs 2 --output-dir"]

    def same(code: str) -> Block:
        return Block(tmp_path / "other.md", 1, "bash", code, "same as page.md")

    assert not_run_there(same("ddpkit train --epochs 2 --output-dir runs/b"), page) == []
    assert not_run_there(same("ddpkit train --epochs 3 --output-dir runs/a"), page) == ["ddpkit train --epochs 3 "
                                                                                       "--output-dir"]
    assert not_run_there(same("ddpkit train --epochs 5"), page) == ["ddpkit train --epochs 5"]  # shown, not run
    assert not_run_there(same("# only a comment\n"), page) == ["(the block has no command)"]


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


# ---------------------------------------------------------------- every command parses, run or not

SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
USER_SCRIPTS = {"train.py"}
"""The reader's own script, which the pages name as such (``Saved as train.py``)."""
PLACEHOLDERS = {"NODE": "0", "$probe": "death-in-backward"}
"""Words the pages ask the reader to replace, and a value each."""
WRAPPERS = ("env", "time", "nohup", "exec")
"""Commands that run the words after them: the program they start is what is checked."""
VENV_PROGRAMS = ("ddpkit", "python", "python3", "torchrun")
"""Programs the project's venv provides: the pages call them by their path in it, as the README does."""
PROGRAM = re.compile(r"^(?:\.venv/bin/)?(ddpkit|python3?|torchrun|mpirun|srun|bash)$")


def shell_commands(block: Block) -> list[list[str]]:
    """Every simple command of a shell block (continuation lines joined, comments and ``VAR=value`` prefixes
    dropped, ``&&``/``||``/``;``/``|`` split), placeholders filled in."""
    import shlex

    found = []
    for line in re.sub(r"\\\n\s*", " ", block.code).split("\n"):
        if not line.strip() or line.strip().startswith("#"):
            continue
        command: list[str] = []
        for token in [*shlex.split(line, comments=True), ";"]:
            if token in ("&&", "||", ";", "|"):
                # `VAR=value`, and the wrappers that run the next word (`env`, `time`, `nohup`, `exec`)
                while command and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", command[0]) or command[0] in WRAPPERS):
                    command = command[1:]
                if command:
                    found.append([PLACEHOLDERS.get(t, t) for t in command])
                command = []
            else:
                command.append(token)
    return found


def problems(argv: list[str]) -> list[str]:
    """What is wrong with one documented command: a flag the real parser refuses, a file or module that is not
    there (a ``ddpkit`` command, a ``python`` script or module, or the program inside mpirun/srun/torchrun)."""
    import importlib.util

    from ddpkit.cli import build_parser

    name = PROGRAM.match(argv[0]).group(1)  # type: ignore[union-attr]
    if name in VENV_PROGRAMS and argv[0] == name:  # a shell without the venv activated has no such program
        return [f"{name} without .venv/bin/: every page names the project's venv (`.venv/bin/{name}`)"]
    if name in ("mpirun", "srun"):  # their own flags, then the program they start
        inner = next((i for i, t in enumerate(argv) if PROGRAM.match(t) and i > 0), None)
        return problems(argv[inner:]) if inner is not None else []
    if name == "bash":
        return [] if (ROOT / argv[1]).is_file() else [f"no file {argv[1]}"]
    if name == "torchrun":
        script = next((t for t in argv[1:] if t.endswith(".py")), None)
        return [] if script is None or (ROOT / script).is_file() else [f"no file {script}"]
    if name.startswith("python"):
        if argv[1] == "-m":
            if argv[2] == "ddpkit":
                return problems([".venv/bin/ddpkit", *argv[3:]])
            return [] if importlib.util.find_spec(argv[2]) else [f"no module {argv[2]}"]
        if argv[1] in USER_SCRIPTS or (ROOT / argv[1]).is_file():
            return []
        return [f"no file {argv[1]}"]
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv[1:])
    except SystemExit:
        return [f"the parser refuses it (run `{' '.join(argv[:3])} --help`)"]
    if unknown:
        return [f"unrecognized arguments: {' '.join(unknown)}"]
    program = getattr(args, "program", None)
    if argv[1] == "launch" and program and not getattr(args, "module", False):
        if program not in USER_SCRIPTS and not (ROOT / program).is_file():
            return [f"no file {program}"]
    return []


SHELL = [b for b in ALL if b.language in SHELL_LANGUAGES and any(PROGRAM.match(c[0]) for c in shell_commands(b))]


@pytest.mark.parametrize("block", SHELL, ids=[b.name for b in SHELL])
def test_every_documented_command_parses_and_names_files_that_exist(block: Block) -> None:
    # Run or not: a command shown for another machine must still be one this version accepts.
    wrong = [f"{' '.join(c)}: {p}" for c in shell_commands(block) if PROGRAM.match(c[0]) for p in problems(c)]
    assert not wrong, "\n".join(wrong)


def test_the_command_check_sees_a_wrong_flag_and_a_missing_file(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- test: not run (x) -->\n```bash\nddpkit launch --nnodes 2 --deterministic-shards 4 \\\n"
                    "    train.py\n.venv/bin/python examples/no_such.py && FOO=1 .venv/bin/ddpkit train --epochs 1\n"
                    "mpirun -np 2 python train.py\nenv OMP_NUM_THREADS=1 time ddpkit train\n"
                    ".venv/bin/python -m ddpkit train --epochs 1\n```\n")
    [block] = blocks(page)
    found = {" ".join(c): problems(c) for c in shell_commands(block)}
    assert found == {"ddpkit launch --nnodes 2 --deterministic-shards 4 train.py": [
                         "ddpkit without .venv/bin/: every page names the project's venv (`.venv/bin/ddpkit`)"],
                     ".venv/bin/python examples/no_such.py": ["no file examples/no_such.py"],
                     ".venv/bin/ddpkit train --epochs 1": [],
                     "mpirun -np 2 python train.py": [
                         "python without .venv/bin/: every page names the project's venv (`.venv/bin/python`)"],
                     "ddpkit train": [
                         "ddpkit without .venv/bin/: every page names the project's venv (`.venv/bin/ddpkit`)"],
                     ".venv/bin/python -m ddpkit train --epochs 1": []}
    assert problems([".venv/bin/ddpkit", "launch", "--nnodes", "2", "--deterministic-shards", "4", "train.py"]) == [
        "unrecognized arguments: --deterministic-shards"]


# ---------------------------------------------------------------- navigation agrees with the pages


def _pages() -> list[str]:
    """Every page of the site (``docs/``, relative), but the benches' generated summaries."""
    return sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")
                  if "bench" not in p.relative_to(ROOT / "docs").parts)


def _nav_pages() -> set[str]:
    yaml = pytest.importorskip("yaml", reason="pyyaml is a test dependency (pip install 'ddpkit[test]')")

    def walk(node) -> set[str]:  # type: ignore[no-untyped-def]
        if isinstance(node, str):
            return {node}
        if isinstance(node, list):
            return set().union(*(walk(n) for n in node)) if node else set()
        if isinstance(node, dict):
            return set().union(*(walk(v) for v in node.values())) if node else set()
        return set()

    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)  # the plugins' tags are text
    return walk(config["nav"])


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: a front page has at most 200 (move detail to docs/)"


def test_every_page_is_in_the_sites_navigation_and_every_guide_in_the_front_pages_lists() -> None:
    pages = _pages()
    assert not set(pages) - _nav_pages(), f"pages not in mkdocs.yml's nav: {sorted(set(pages) - _nav_pages())}"
    guides = [p for p in pages if "/" not in p and p != "index.md"] + ["api/index.md", "plans/fault-tolerance.md"]
    readme = (ROOT / "README.md").read_text()
    missing = [g for g in guides if f"(docs/{g}" not in readme]
    assert not missing, f"guides the README's list does not link: {missing}"
    index = (ROOT / "docs" / "index.md").read_text()
    missing = [g for g in guides if g not in ("architecture.md", "plans/fault-tolerance.md", "api/index.md")
               and f"({g})" not in index]
    assert not missing, f"guides docs/index.md does not link: {missing}"
    built = re.search(r"stages 1-(\d) built", (ROOT / "mkdocs.yml").read_text())
    plan = re.search(r"\*\*Status: stages 1 to (\d) are built\*\*", (ROOT / "docs/plans/fault-tolerance.md").read_text())
    stage6 = "Stage 6 is built" in (ROOT / "docs/plans/fault-tolerance.md").read_text()
    assert built and plan and int(built.group(1)) == int(plan.group(1)) + stage6, "the nav and the plan disagree"


SPAWN_50 = """
import block  # the page's block, saved as block.py: its worker as the page defines it
import ddpkit
from ddpkit.runtime.spawn import start_forkserver

start_forkserver(["torch", "ddpkit", "ddpkit.runtime.group"])
for attempt in range(50):
    ddpkit.spawn(block.worker, nprocs=2, args=("hello from",), start_method="forkserver")
print("50 runs")
"""


@pytest.mark.slow("getting-started's ddpkit.spawn block 50 times in a row (children forked, to afford 50)")
def test_the_first_spawn_example_never_flakes(tmp_path: Path) -> None:
    # Rank 0 returned right after init() and closed the store while rank 1 still used it: once in 26 runs.
    [block] = [b for b in blocks(ROOT / "docs" / "getting-started.md") if "ddpkit.spawn(worker" in b.code]
    (tmp_path / "block.py").write_text(block.code)
    done = subprocess.run([sys.executable, "-c", SPAWN_50],
                          env=base_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0 and "50 runs" in done.stdout, done.stderr[-3000:]
    assert done.stdout.count("hello from") == 100 and "Traceback" not in done.stderr

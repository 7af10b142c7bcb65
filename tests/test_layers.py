"""The package's structure: imports run only downward, no import cycles, no private names across modules,
and the launcher path stays torch-free.

The checker reads every module's imports (module level and inside functions
alike: a lazy import is still an arrow) and is itself tested on synthetic
trees that break each rule, so it cannot pass by seeing nothing.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from procs import SCRIPTS, base_env

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddpkit"

# docs/architecture.md: data flows down,
# cli -> bench -> train -> launcher/parallel -> comm/data/models -> runtime.
LAYER = {"runtime": 0, "comm": 1, "data": 1, "models": 1, "launcher": 2, "parallel": 2, "train": 3,
         "integrations": 3, "bench": 4, "doctor": 4}
TOP = 5
"""ddpkit/__init__, cli, __main__ and the public facades (hooks, collectives) sit above everything."""
TOP_MODULES = {"__init__", "__main__", "cli", "hooks", "collectives"}
INNER: dict[str, dict[str, int]] = {
    "parallel": {"common": 0, "zero": 1, "ps": 1, "ddp": 2, "fault_tolerance": 3, "": 3},
    "bench": {"__init__.py": 0, "runners": 1, "bench_config.py": 2, "workloads.py": 3, "report": 3, "sections": 4,
              "command.py": 5},
}
"""The layers inside a package, by folder, or by module beside the folders (``name.py``, the package's own
``__init__.py`` too; ``""``: every other module beside them, the package's ``__init__`` among them if not named,
one group). ``parallel/``: what several engines share (the reducer, observers, join, broadcasts), then ZeRO and the
parameter servers, then DDP's wrapper, whose engine factory is the one place ddp/ meets zero/; the modules beside
the folders (DataParallel, SyncBatchNorm, Horovod's optimizer, local SGD, SSP) above them, and beside those
fault tolerance, which drives DDP's wrapper. ``bench/``: the runners
(ranks, a memory cap, dispatch counted), the flags, the workloads and the report, the sections, the command
(docs/architecture.md). Two groups of one level do not import each other (sideways)."""
REFERENCE = "_reference"
"""torch's implementations: imported only where the point is comparison."""
REFERENCE_USERS = {"train", "bench", "doctor"}
BY_NAME = "<by name>"
"""What :func:`imports` gives as the name of a module named in a string (``python -m``, ``importlib``, a preload
list): a tie the layers see (not an import cycle: nothing is imported at the time)."""
NAMED_UPWARD = {
    ("ddpkit.runtime.process", "ddpkit.parallel.ps.server"):
        "the parameter server's entry point, which ddpkit.spawn and ddpkit launch run by name in a process of "
        "its own (runtime/spawn.py imports it in that child): named here, in the runtime, so that both find it",
    **{("ddpkit.bench", f"ddpkit.bench.{name}"):
       "what the server that the bench's ranks fork from imports for them (RANKS_IMPORT): the package names its own "
       "modules, below the runners that start the server"
       for name in ("command", "sections.memory", "sections.zero", "sections.capped", "sections.scaling",
                    "sections.allreduce_perf")},
}
"""The ties by name that go up a layer, each with why (any other is a breach)."""


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` for every import of the package in ``path``.

    ``from a.b import c`` gives ``(line, "a.b.c", None)`` when ``a.b.c`` is a
    module of the package, else ``(line, "a.b", "c")``.
    """
    here = module_name(path, root)
    package = here.split(".") if path.name == "__init__.py" else here.split(".")[:-1]
    modules = {module_name(p, root) for p in root.rglob("*.py")}
    found: list[tuple[int, str, str | None]] = []
    tree = ast.parse(path.read_text())
    said = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # docstrings and bare strings: prose
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                found.append((node.lineno, full, None) if full in modules else (node.lineno, source, alias.name))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value
              and node.value in modules and id(node) not in said):
            found.append((node.lineno, node.value, BY_NAME))  # a module named, to be run or imported: an arrow too
    top = root.name
    return [(line, m, n) for line, m, n in found if m == top or m.startswith(top + ".")]


def layer(module: str) -> int | None:
    """The layer of a module of the package (``None``: a package the rules do not know)."""
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] in TOP_MODULES):
        return TOP
    if parts[1] == REFERENCE:
        return LAYER["runtime"]
    return LAYER.get(parts[1])


def inner_layer(module: str, root: Path) -> tuple[str, int, str] | None:
    """``(package, level, group)`` of a module inside a package of :data:`INNER` (``None``: outside them); a group is
    a folder, or a module beside the folders that has a level of its own, or ``""`` for the other modules beside
    them."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in INNER:
        return None
    levels = INNER[parts[1]]
    if len(parts) == 2:  # the package's own __init__
        group = "__init__.py" if "__init__.py" in levels else ""
    elif len(parts) > 3 or (root / parts[1] / parts[2]).is_dir():
        group = parts[2]
    else:
        group = parts[2] + ".py" if parts[2] + ".py" in levels else ""
    if group not in levels:
        return parts[1], -1, group
    return parts[1], levels[group], group


def graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    return {m: {target for _, target, name in imports(p, root) if target in modules and target != m and name != BY_NAME}
            for m, p in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: strongly connected groups of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def violations(root: Path) -> list[str]:
    """Every breach of the layering rules in the package at ``root`` (see the module notes)."""
    wrong = []
    for path in sorted(root.rglob("*.py")):
        here = module_name(path, root)
        mine = layer(here)
        if mine is None:
            wrong.append(f"{here}: its package is in no layer: give it one in tests/test_layers.py")
            continue
        inside = inner_layer(here, root)
        if inside is not None and inside[1] < 0:
            wrong.append(f"{here}: {inside[0]}/{inside[2] or '*.py'} has no level inside {inside[0]}/: give it one "
                         "in INNER, tests/test_layers.py")
        for line, module, name in imports(path, root):
            where = f"{path.relative_to(root.parent)}:{line}"
            parts = module.split(".")
            if len(parts) > 1 and parts[1] == REFERENCE:
                if (here.split(".") + [""])[1] not in REFERENCE_USERS:
                    wrong.append(f"{where} imports {module} (torch's references: bench, train and doctor only)")
                continue
            if mine != TOP and (layer(module) or 0) > mine and (name != BY_NAME or (here, module) not in NAMED_UPWARD):
                wrong.append(f"{where} {'names' if name == BY_NAME else 'imports'} {module}, a layer above")
            target = inner_layer(module, root)
            allowed = name == BY_NAME and (here, module) in NAMED_UPWARD
            if (inside is not None and target is not None and inside[0] == target[0] and inside[2] != target[2]
                    and not allowed):
                package, mine_at, theirs_at = inside[0], inside[2] or "*.py", target[2] or "*.py"
                if target[1] > inside[1]:
                    wrong.append(f"{where} imports {module}: {package}/{theirs_at} is a layer above "
                                 f"{package}/{mine_at}")
                elif target[1] == inside[1]:
                    wrong.append(f"{where} imports {module}: {package}/{mine_at} and {package}/{theirs_at} are "
                                 f"siblings (import neither from the other: move what both need a layer down)")
            private_module = next((p for p in parts[1:] if p.startswith("_") and not p.startswith("__")), None)
            if private_module and module.rsplit(".", 1)[0] != here.rsplit(".", 1)[0]:
                wrong.append(f"{where} imports {module}, a private module of another package")
            if name and name != BY_NAME and name.startswith("_") and not name.startswith("__") and module != here:
                wrong.append(f"{where} imports {name} from {module}: a private name of another module")
    wrong += [f"import cycle: {' -> '.join(group)}" for group in cycles(graph(root))]
    return wrong


def test_the_package_keeps_its_layers() -> None:
    wrong = violations(PACKAGE)
    assert not wrong, "\n".join(wrong)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "ddpkit"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_finds_a_cycle(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "parallel/__init__.py": "",
        "parallel/a.py": "from ddpkit.parallel import b\n",
        "parallel/b.py": "def f():\n    from .c import g  # lazy: still an arrow\n",
        "parallel/c.py": "import ddpkit.parallel.a\n",
        "parallel/d.py": "from ddpkit.parallel.a import x\n",
    })
    assert violations(root) == ["import cycle: ddpkit.parallel.a -> ddpkit.parallel.b -> ddpkit.parallel.c"]


@pytest.mark.parametrize(("files", "expected"), [
    ({"runtime/__init__.py": "", "runtime/x.py": "from ddpkit.parallel import ddp\n",
      "parallel/__init__.py": "", "parallel/ddp.py": ""},
     "ddpkit/runtime/x.py:1 imports ddpkit.parallel.ddp, a layer above"),
    ({"comm/__init__.py": "", "comm/x.py": "from ddpkit.parallel.y import _hidden\n",
      "parallel/__init__.py": "", "parallel/y.py": ""},
     "ddpkit/comm/x.py:1 imports ddpkit.parallel.y, a layer above"),
    ({"parallel/__init__.py": "", "parallel/x.py": "from ddpkit.parallel.y import _hidden\n", "parallel/y.py": ""},
     "ddpkit/parallel/x.py:1 imports _hidden from ddpkit.parallel.y: a private name of another module"),
    ({"parallel/__init__.py": "", "parallel/x.py": "from ddpkit._reference import torch_ddp\n", "_reference.py": ""},
     "ddpkit/parallel/x.py:1 imports ddpkit._reference (torch's references: bench, train and doctor only)"),
    # A module named in a string (run with python -m, imported with importlib) is a tie the layers see; the
    # docstring that names one is prose.
    ({"runtime/__init__.py": "", "runtime/x.py": '"""Runs ddpkit.train.loop."""\nMAIN = "ddpkit.train.loop"\n',
      "train/__init__.py": "", "train/loop.py": ""},
     "ddpkit/runtime/x.py:2 names ddpkit.train.loop, a layer above"),
    ({"newthing/__init__.py": "", "newthing/x.py": ""},
     "ddpkit.newthing: its package is in no layer: give it one in tests/test_layers.py"),
    # Inside parallel/: ddp/ reaches zero/ only through its engine factory, and nothing below reaches up.
    ({"parallel/__init__.py": "", "parallel/zero/__init__.py": "", "parallel/ddp/__init__.py": "",
      "parallel/zero/stage2.py": "from ddpkit.parallel.ddp.wrapper import DistributedDataParallel\n",
      "parallel/ddp/wrapper.py": ""},
     "ddpkit/parallel/zero/stage2.py:1 imports ddpkit.parallel.ddp.wrapper: parallel/ddp is a layer above "
     "parallel/zero"),
    ({"parallel/__init__.py": "", "parallel/common/__init__.py": "", "parallel/common/reducer.py":
      "from ddpkit.parallel import dp\n", "parallel/dp.py": ""},
     "ddpkit/parallel/common/reducer.py:1 imports ddpkit.parallel.dp: parallel/*.py is a layer above parallel/common"),
    ({"parallel/__init__.py": "", "parallel/zero/__init__.py": "", "parallel/ps/__init__.py": "",
      "parallel/ps/server.py": "from ddpkit.parallel.zero.units import find_units\n", "parallel/zero/units.py": ""},
     "ddpkit/parallel/ps/server.py:1 imports ddpkit.parallel.zero.units: parallel/ps and parallel/zero are siblings "
     "(import neither from the other: move what both need a layer down)"),
    # Inside bench/: the runners know no workload, and a section is not imported by the report.
    ({"bench/__init__.py": "", "bench/runners/__init__.py": "", "bench/runners/ranks.py":
      "from ddpkit.bench.workloads import workload\n", "bench/workloads.py": ""},
     "ddpkit/bench/runners/ranks.py:1 imports ddpkit.bench.workloads: bench/workloads.py is a layer above "
     "bench/runners"),
    ({"bench/__init__.py": "", "bench/report/__init__.py": "", "bench/report/summary.py":
      "from ddpkit.bench import workloads\n", "bench/workloads.py": ""},
     "ddpkit/bench/report/summary.py:1 imports ddpkit.bench.workloads: bench/report and bench/workloads.py are "
     "siblings (import neither from the other: move what both need a layer down)"),
    # A package's own __init__ is in its layers: parallel's beside the folders, bench's at the bottom.
    ({"parallel/__init__.py": "W = 1\n", "parallel/common/__init__.py": "", "parallel/common/x.py":
      "from ddpkit.parallel import W\n"},
     "ddpkit/parallel/common/x.py:1 imports ddpkit.parallel: parallel/*.py is a layer above parallel/common"),
    ({"bench/__init__.py": "from ddpkit.bench import command\n", "bench/command.py": ""},
     "ddpkit/bench/__init__.py:1 imports ddpkit.bench.command: bench/command.py is a layer above bench/__init__.py"),
    ({"bench/__init__.py": "", "bench/extra.py": ""},
     "ddpkit.bench.extra: bench/*.py has no level inside bench/: give it one in INNER, tests/test_layers.py"),
])
def test_the_checker_finds_each_breach(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    assert expected in violations(_tree(tmp_path, files))


def test_the_checker_passes_a_clean_tree(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "runtime/__init__.py": "", "runtime/group.py": "import os\n",
        "parallel/__init__.py": "", "parallel/ddp.py": "from ddpkit.runtime.group import init\nfrom . import sink\n",
        "parallel/sink.py": "from ddpkit.runtime import group\n",
        "bench/__init__.py": "", "bench/command.py": "from ddpkit._reference import torch_ddp\nfrom ddpkit.parallel import ddp\n",
        "_reference.py": "", "cli.py": "from ddpkit.bench import command\nfrom ddpkit import __version__\n",
    })
    assert violations(root) == []


def test_launch_starts_its_workers_before_it_imports_torch() -> None:
    # The launcher needs torch only to serve the job's store (torchrun's agent store): it imports it on a
    # thread after the workers have been started. An audit hook records, at each process the launcher starts,
    # whether torch is loaded yet.
    probe = (
        "import sys\n"
        "seen = []\n"
        "sys.addaudithook(lambda event, args: seen.append('torch' in sys.modules) if event == 'subprocess.Popen' "
        "else None)\n"
        "sys.argv = ['ddpkit', 'launch', '--standalone', '--nproc-per-node', '2', sys.argv[1]]\n"
        "from ddpkit.cli import main\n"
        "code = main()\n"
        "print('TORCH_AT_WORKER_START', seen[:2], 'torch' in sys.modules)\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(SCRIPTS / "report_env.py")],
        env=base_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("REPORT ") == 2, proc.stdout  # the workers really ran
    line = next(l for l in proc.stdout.splitlines() if l.startswith("TORCH_AT_WORKER_START"))
    assert line == "TORCH_AT_WORKER_START [False, False] True", line


def test_test_file_names_are_unique() -> None:
    # tests/ has no __init__.py files: pytest imports test modules by basename,
    # so two files of one name in different folders break collection.
    names = [p.name for p in Path(__file__).parent.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_no_two_source_modules_share_a_file_name() -> None:
    # One name, one module: a reader (and a traceback) that says "survive.py" or "config.py" names one file. Each
    # name says what its module is, beside the others of its idea (launch_config, train_config, bench_config).
    paths = [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    names = [p.name for p in paths]
    shared = sorted(str(p.relative_to(PACKAGE)) for p in paths if names.count(p.name) > 1)
    assert not shared, f"modules sharing a file name: {shared}"


def test_source_lines_fit_in_120_columns() -> None:
    # The house's width: lines packed past it hid code that a module's length cap had pushed together.
    long = [f"{path.relative_to(PACKAGE.parent)}:{n}" for path in sorted(PACKAGE.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 120]
    assert not long, "lines over 120 columns:\n" + "\n".join(long)

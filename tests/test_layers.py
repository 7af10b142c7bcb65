"""The package's layers: imports run only downward, and the launcher path stays torch-free."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from procs import SCRIPTS, base_env

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddpkit"

# ../shared/docs/architecture.md: cli -> train/bench/launcher -> parallel -> comm -> runtime.
LAYER = {"runtime": 0, "comm": 1, "data": 1, "launcher": 1, "parallel": 2, "train": 3, "bench": 3}
TOP = 4  # ddpkit/__init__, cli, __main__, the public facades (hooks, collectives)
# The torch references are imported only where the point is comparison.
REFERENCE_USERS = {"train", "bench"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every ddpkit import in ``path``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = list(parts[:-1]) if parts[-1] != "__init__" else list(parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "ddpkit":
                found += [(node.lineno, f"ddpkit.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, module))
    return [(line, m) for line, m in found if m == "ddpkit" or m.startswith("ddpkit.")]


def _layer(module_parts: list[str]) -> int:
    if len(module_parts) < 2:
        return TOP
    return LAYER.get(module_parts[1], TOP)


def test_imports_run_only_downward() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        here = _layer(list(rel.parts))
        if here == TOP:
            continue
        for line, module in _imports(path):
            parts = module.split(".")
            if parts[:2] == ["ddpkit", "_reference"]:
                if rel.parts[1] not in REFERENCE_USERS:
                    wrong.append(f"{rel}:{line} imports {module} (torch's references: bench and train only)")
                continue
            if _layer(parts) > here:
                wrong.append(f"{rel}:{line} imports {module}, a layer above")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    # The layer test above must be able to fail: feed it a runtime module that
    # imports the engine and the top-level facade.
    fake = PACKAGE / "runtime" / "_layer_probe_tmp.py"
    fake.write_text("from ddpkit.parallel import ddp\nimport ddpkit\nfrom ..train import loop\n")
    try:
        modules = [m for _, m in _imports(fake)]
        assert modules == ["ddpkit.parallel", "ddpkit", "ddpkit.train"]
        assert [_layer(m.split(".")) for m in modules] == [2, TOP, 3]
    finally:
        fake.unlink()


def test_launch_never_imports_torch_in_the_launcher() -> None:
    # The launcher process reports which torch modules it holds once its
    # workers (which do import torch and join a group) have finished.
    probe = (
        "import sys\n"
        "sys.argv = ['ddpkit', 'launch', '--standalone', '--nproc-per-node', '2', sys.argv[1]]\n"
        "from ddpkit.cli import main\n"
        "code = main()\n"
        "print('TORCH_IN_LAUNCHER', sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(SCRIPTS / "report_env.py")],
        env=base_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("REPORT ") == 2, proc.stdout  # the workers really ran
    line = next(l for l in proc.stdout.splitlines() if l.startswith("TORCH_IN_LAUNCHER"))
    assert line == "TORCH_IN_LAUNCHER []", line


def test_test_file_names_are_unique() -> None:
    # tests/ has no __init__.py files: pytest imports test modules by basename,
    # so two files of one name in different folders break collection.
    names = [p.name for p in Path(__file__).parent.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)

"""Reference runs computed once per session and shared by every test that compares with them.

Many fault tests compare a run that met a fault with the same run without one; the run without one is the same
job whichever test asks for it. :class:`SharedRuns` (the session fixture ``shared_runs`` of
``tests/conftest.py``) computes each such run once, in a folder of its own, and hands every later caller the
stored result: under pytest-xdist the folder lies beside the workers' temporary folders and a lock per run makes
the second worker wait for the first instead of computing it again.

A run's key names everything that makes it (its arguments); its result is what ``make`` returns, stored with
``torch.save`` (tensors, dicts, strings), plus whatever files ``make`` wrote into the folder it was given. Its
cost is the session's, not the test's that happened to ask first (``budget.charge_to_session``).
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import filelock
import torch
from budget import charge_to_session, cpu_seconds

SYNTHETIC_RUN = dict(dataset="synthetic", synthetic_samples=768, batch_size=16, epochs=2, checkpoint_every=5,
                     progress=False)
"""The training job that the restart and consistency tests compare with (the session fixture ``synthetic_run``):
two workers, 96 steps, a checkpoint every five."""


class SharedRuns:
    """Runs computed once per session, by key (see the module notes)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def get(self, key: str, make: Callable[[Path], Any]) -> tuple[Any, Path]:
        """``make(folder)``'s result for ``key`` and its folder: computed by the first caller of the session, read
        back by every other. A failed ``make`` stores nothing (the next caller tries again, and fails alike)."""
        name = hashlib.sha256(key.encode()).hexdigest()[:16]
        folder, result = self.root / name, self.root / f"{name}.pt"
        cpu, wall = cpu_seconds(), time.monotonic()
        with filelock.FileLock(str(self.root / f"{name}.lock")):
            if not result.exists():
                shutil.rmtree(folder, ignore_errors=True)  # what a failed caller before left: each try starts clean
                folder.mkdir()
                value = make(folder)
                torch.save(value, self.root / f"{name}.tmp")
                (self.root / f"{name}.tmp").rename(result)
        charge_to_session(cpu_seconds() - cpu, time.monotonic() - wall)  # computed, or waited for: the session's
        return torch.load(result, weights_only=False), folder


def ft_run(folder: Path, name: str, *, kill: str = "", det: bool = True, nproc: int = 3, replacements: int = 0,
           epochs: int = 2, grow: int = 0, launch_flags: tuple[str, ...] = (), program: str = "ft_train.py",
           **extra: str) -> tuple[dict, dict, str]:
    """``tests/scripts/ft_train.py`` (or ``program`` of ``tests/scripts``, which runs it) under ``ddpkit launch
    --on-failure continue`` on one node (with ``launch_flags`` too): its weights, its account (world sizes,
    changes) and the launcher's standard error."""
    import json

    from procs import base_env, launch, script

    out = folder / name
    env = base_env(OUT=str(out), KILL=kill, DET="1" if det else "0", EPOCHS=str(epochs), GROW=str(grow), **extra)
    done = launch("--standalone", "--nproc-per-node", str(nproc), "--on-failure", "continue", "--max-restarts",
                  str(replacements), *launch_flags, script(program), env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(f"{out}.pt"), json.loads(Path(f"{out}.json").read_text()), done.stderr


def ft_reference(runs: SharedRuns, *, det: bool = True, epochs: int = 2, **extra: str) -> tuple[dict, dict, str]:
    """:func:`ft_run` of three workers without a death: the run the fault tests of one node and of several
    compare with (once per session)."""
    run, _ = runs.get(f"ft_train.py 3 workers det={det} epochs={epochs} {sorted(extra.items())}",
                      lambda folder: ft_run(folder, "reference", det=det, epochs=epochs, **extra))
    return run

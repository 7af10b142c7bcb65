"""Shared fixtures: persistent rank pools and a clean environment per test."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import RankPool  # noqa: E402
from mpi_harness import MPIRankPool, mpi_missing, skip_or_fail  # noqa: E402

# the suite's time budget (tests/budget.py), the fast tier's reach (tests/fast_tier.py), tests that run alone (tests/alone.py)
pytest_plugins = ["budget", "fast_tier", "alone"]

ROOT = Path(__file__).resolve().parents[1]
MNIST_DIR = ROOT.parent / "shared" / "data" / "mnist"


@pytest.fixture(scope="session")
def dist2() -> Iterator[RankPool]:
    """Two gloo ranks, reused by every test that asks for them."""
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def dist3() -> Iterator[RankPool]:
    """Three gloo ranks (uneven splits, more than one peer)."""
    pool = RankPool(3)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def dist4() -> Iterator[RankPool]:
    """Four gloo ranks: two "nodes" of two for hierarchical algorithms."""
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory: pytest.TempPathFactory):  # -> SharedRuns
    """Reference runs computed once per session, shared by the tests (and pytest-xdist's workers) that compare
    with them (``tests/shared_runs.py``)."""
    from shared_runs import (
        SharedRuns,  # here: it imports the budget plugin, which pytest must import first
    )

    base = tmp_path_factory.getbasetemp()
    return SharedRuns((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs")


@pytest.fixture(scope="session")
def mpi_why() -> str | None:
    """Why MPI ranks cannot start here (checked once), or None."""
    return mpi_missing()


@pytest.fixture
def needs_mpi(mpi_why: str | None) -> None:
    """The test runs on the mpi backend: skipped without an MPI here, failed when one is installed and broken."""
    if mpi_why:
        skip_or_fail(mpi_why)


def _mpi_pool(world_size: int, why: str | None) -> Iterator[MPIRankPool]:
    if why:
        skip_or_fail(why)
    pool = MPIRankPool(world_size)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def mpi2(mpi_why: str | None) -> Iterator[MPIRankPool]:
    """Two ranks of one mpirun job on the mpi backend, reused by every test that asks for them."""
    yield from _mpi_pool(2, mpi_why)


@pytest.fixture(scope="session")
def mpi3(mpi_why: str | None) -> Iterator[MPIRankPool]:
    """Three ranks on the mpi backend (more than one peer; MPI's and gloo's summation orders may differ)."""
    yield from _mpi_pool(3, mpi_why)


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    """Restore environment variables and drop any process group a test made in-process."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    if "ddpkit.runtime.group" in sys.modules:
        from ddpkit.runtime.group import shutdown

        shutdown()  # destroys the process group a test made in-process, and forgets ddpkit's context of it
    elif "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="session")
def synthetic_run(shared_runs, dist2) -> Path:  # noqa: ANN001
    """``shared_runs.SYNTHETIC_RUN`` uninterrupted on two ranks, trained once per session: its run directory
    (read-only: copy it before resuming from it)."""
    from shared_runs import SYNTHETIC_RUN

    from ddpkit.train.loop import TrainConfig, worker

    def make(folder: Path) -> None:
        dist2.run(worker, 0, TrainConfig(**SYNTHETIC_RUN, output_dir=folder / "run"), None)

    _, folder = shared_runs.get(f"train {sorted(SYNTHETIC_RUN.items())} on 2 ranks", make)
    return folder / "run"

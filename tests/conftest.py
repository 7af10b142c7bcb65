"""Shared fixtures: persistent rank pools and a clean environment per test."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import RankPool  # noqa: E402

pytest_plugins = ["budget"]  # the suite's time budget (tests/budget.py)

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

"""The torch versions ddpkit declares, and the one place that bridges their API differences."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ddpkit.runtime import compat

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_torch_is_in_the_declared_range_which_starts_at_2_4():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = SpecifierSet(next(d for d in deps if d.startswith("torch"))[len("torch"):])
    assert Version(torch.__version__.split("+")[0]) in spec
    assert Version("2.4.0") in spec and Version("2.3.1") not in spec


def test_collective_names_follow_the_installed_torch():
    new = hasattr(dist, "reduce_scatter_single")
    assert compat.reduce_scatter_tensor is (dist.reduce_scatter_single if new else dist.reduce_scatter_tensor)
    assert compat.all_gather_tensor is (dist.all_gather_single if new else dist.all_gather_into_tensor)

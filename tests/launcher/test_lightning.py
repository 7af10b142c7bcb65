"""Lightning's Trainer under ddpkit launch picks its torchelastic environment, as under torchrun."""

from __future__ import annotations

import pytest

from tests.procs import SCRIPTS, launch

pytest.importorskip("lightning")


def test_lightning_trainer_runs_ddp_with_its_torchelastic_environment():
    done = launch("--nproc-per-node", "2", str(SCRIPTS / "lightning_fit.py"), timeout=180)
    assert done.returncode == 0, done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("LIGHTNING"))
    assert lines == [f"LIGHTNING rank {r} world 2 env TorchElasticEnvironment" for r in range(2)]

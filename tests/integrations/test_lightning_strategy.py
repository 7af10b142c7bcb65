"""Lightning with ddpkit's DDP: bitwise equal to Lightning with torch's DDP, under Lightning's launching and ddpkit's.

Three jobs of two CPU processes, run side by side: Lightning's own launching
with ``strategy="ddp"`` (the reference) and ``strategy="ddpkit"``; ``ddpkit
launch`` with ``DDPKitStrategy()`` and ``DDPKitStrategy(comm="auto")``; and Lightning's ``"ddp"`` with torch's
``DistributedDataParallel`` rebound to ddpkit's, as users adopt a drop-in.
Each fits a linear model, a model with BatchNorm, and one with manual
optimisation that accumulates a micro-batch under ``block_backward_sync``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
from procs import ROOT, SCRIPTS, base_env

if importlib.util.find_spec("lightning") is None:  # (looked for, not imported: importing Lightning's 2,000 modules
    # cost each pytest worker 3 s of its collection)
    pytest.skip("Lightning is an optional extra: pip install 'ddpkit[lightning]'", allow_module_level=True)

MODELS = "boring,bn,manual"

# The three jobs run once, in the module's fixture, whose time lands on whichever test comes first; the module's
# tests on one pytest-xdist worker, so that once is once per session, not once per worker.
pytestmark = [pytest.mark.slow("three Lightning jobs of two processes each, once for the module's tests"),
              pytest.mark.xdist_group("lightning-fits")]


def _start(args: list[str], cwd) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=base_env(PYTHONWARNINGS="ignore"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def fits(tmp_path_factory):  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("lightning")
    script = str(SCRIPTS / "lightning_parity.py")
    jobs = {
        "lightning": _start([script, "ddp,ddpkit", MODELS, str(out)], out),
        "ddpkit launch": _start(["-m", "ddpkit", "launch", "--nproc-per-node", "2", script, "ddpkit-object,ddpkit-auto",
                                 MODELS, str(out)], ROOT),
        "rebound": _start([script, "ddp-rebound", MODELS, str(out)], out),
    }
    done = {name: (p.communicate(timeout=300), p.returncode) for name, p in jobs.items()}
    for name, ((stdout, stderr), code) in done.items():
        assert code == 0, f"{name} failed:\n{stdout}\n{stderr[-4000:]}"
    lines = sorted(line for (stdout, _), _ in done.values() for line in stdout.splitlines()
                   if line.startswith("LIGHTNING"))
    return out, lines


@pytest.mark.parametrize("model", MODELS.split(","))
@pytest.mark.parametrize("strategy", ["ddpkit", "ddpkit-object", "ddp-rebound", "ddpkit-auto"])
def test_final_weights_equal_lightning_with_torch_ddp(fits, strategy, model):
    out, _ = fits
    reference, ours = torch.load(out / f"ddp-{model}.pt"), torch.load(out / f"{strategy}-{model}.pt")
    assert reference.keys() == ours.keys()
    for key in reference:
        assert torch.equal(reference[key], ours[key]), f"{strategy} {model}: {key} differs from torch's DDP"


def test_the_strategy_wraps_in_ddpkit_and_unwraps_at_teardown(fits):
    _, lines = fits
    for rank in (0, 1):
        for model, cls in (("boring", "Boring"), ("bn", "WithBatchNorm"), ("manual", "Manual")):
            assert (f"LIGHTNING rank {rank} ddpkit {model}: DDPKitStrategy, model after teardown {cls}, "
                    "env LightningEnvironment") in lines
            assert (f"LIGHTNING rank {rank} ddpkit-object {model}: DDPKitStrategy, model after teardown {cls}, "
                    "env TorchElasticEnvironment") in lines
            assert (f"LIGHTNING rank {rank} ddp-rebound {model}: DDPStrategy, model after teardown {cls}, "
                    "env LightningEnvironment") in lines


def test_comm_auto_is_given_the_fits_optimizer_steps(fits):
    _, lines = fits
    for rank in (0, 1):
        for model in MODELS.split(","):
            assert f"LIGHTNING rank {rank} ddpkit-auto {model}: run_steps 8" in lines, lines


def test_the_names_are_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    import ddpkit.integrations.lightning as integration

    for name in ("ddpkit", "ddpkit_spawn", "ddpkit_fork", "ddpkit_find_unused_parameters_true"):
        assert name in StrategyRegistry
        assert isinstance(StrategyRegistry.get(name), integration.DDPKitStrategy)
    assert StrategyRegistry.get("ddpkit_find_unused_parameters_true")._ddp_kwargs == {"find_unused_parameters": True}
    assert type(StrategyRegistry.get("ddp")).__name__ == "DDPStrategy"  # Lightning's own names untouched

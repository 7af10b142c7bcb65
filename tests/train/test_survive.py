"""Training that goes on through a worker's death (``--on-failure continue``, ``ddpkit.FaultTolerance``).

Real processes under ``ddpkit launch``: a worker SIGKILLs itself in the middle
of a step (``tests/scripts/ft_train.py``), or ``scripts/chaos.py`` kills, stops
and terminates random workers at random moments; the runs are compared with
the same run without a failure.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from procs import ROOT, base_env, launch, script

from ddpkit.data.sampler import DistributedSampler
from ddpkit.data.shards import VirtualShards
from ddpkit.launcher.config import LaunchConfig
from ddpkit.launcher.settings import resolve
from ddpkit.runtime.options import ConfigError
from ddpkit.train.config import TrainConfig

MNIST = ROOT.parent / "shared" / "data" / "mnist"


# ---------------------------------------------------------------- virtual shards


@pytest.mark.parametrize("samples,batch,shards", [(600, 48, 6), (100, 12, 4), (97, 8, 8), (10, 8, 8)])
def test_every_sample_is_in_exactly_one_shard_of_one_step_each_epoch(samples: int, batch: int, shards: int) -> None:
    vs = VirtualShards(samples, batch, shards, seed=3)
    for epoch in range(2):
        seen = torch.zeros(samples, dtype=torch.int64)
        for step in range(epoch * vs.steps_per_epoch, (epoch + 1) * vs.steps_per_epoch):
            for shard in range(shards):
                seen[vs.shard(step, shard)] += 1
        assert seen.min() == seen.max() == 1
    # Every world size takes every shard exactly once.
    for world in range(1, shards + 1):
        taken = sorted(s for rank in range(world) for s in vs.shards_of(rank, world))
        assert taken == list(range(shards))


def test_at_the_world_size_the_shards_are_the_batches_of_torchs_sampler() -> None:
    # Shard r of step k is rank r's k-th batch under a DistributedSampler with the same seed.
    world, per_rank, n = 3, 8, 240
    vs = VirtualShards(n, per_rank * world, world, seed=5)
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=5)
        sampler.set_epoch(1)
        mine = list(sampler)
        for k in range(vs.steps_per_epoch):
            assert vs.shard(vs.steps_per_epoch + k, rank) == mine[k * per_rank : (k + 1) * per_rank]


def test_a_batch_the_shards_do_not_divide_is_refused_with_a_fix() -> None:
    with pytest.raises(ValueError, match="batch_size 50 is not a multiple of virtual_shards 8.*e.g. 56"):
        VirtualShards(100, 50, 8)


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("extra,match", [
    ({"zero": 2}, "a ZeRO shard exists once"),
    ({"strategy": "local-sgd"}, "needs --engine ddpkit --strategy ddp"),
    ({"strategy": "ssp", "max_restarts": 1}, "nothing would hand a replacement the training state"),
    ({"strategy": "ssp", "deterministic_shards": 2}, "no shards to order"),
    ({"strategy": "ps-async", "max_restarts": 1}, "cannot take a seat in the parameter servers"),
    ({"strategy": "ps-sync", "deterministic_shards": 2}, "no shards to order"),
    ({"grad_accum": 2}, "the step's shards are its micro-batches"),
    ({"resume": True, "output_dir": "x"}, "keeps its state in the surviving processes"),
    ({"comm_hook": "fp16"}, "reduces whole steps"),
    ({"backend": "mpi"}, "rebuild gloo groups"),
])
def test_train_refuses_what_the_mode_cannot_keep(extra: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TrainConfig(on_failure="continue", **extra)


def test_server_replication_needs_the_mode_and_enough_servers() -> None:
    with pytest.raises(ConfigError, match="needs --strategy ps-sync|ps-async and --on-failure continue"):
        TrainConfig(strategy="ps-async", num_servers=2, ps_replication=2)
    with pytest.raises(ConfigError, match="must be between 1 and --num-servers 2"):
        TrainConfig(strategy="ps-async", num_servers=2, ps_replication=3, on_failure="continue")
    TrainConfig(strategy="ps-async", num_servers=2, ps_replication=2, on_failure="continue")


def test_deterministic_shards_need_the_mode_and_a_fitting_count() -> None:
    with pytest.raises(ConfigError, match="needs --on-failure continue"):
        TrainConfig(deterministic_shards=4)
    config = TrainConfig(on_failure="continue", deterministic_shards=3, batch_size=32)
    with pytest.raises(ConfigError, match="divide the global batch .32 x 2 = 64"):
        config.check_world(2)
    with pytest.raises(ConfigError, match="at least the world size"):
        TrainConfig(on_failure="continue", deterministic_shards=2, batch_size=32).check_world(4)


def test_launch_refuses_c10d_nodes_servers_across_nodes_and_replacements_beside_servers() -> None:
    LaunchConfig(program="x.py", on_failure="continue", nnodes=3, node_rank=1, master_addr="127.0.0.1")
    spare = LaunchConfig(program=str(script("ft_train.py")), on_failure="continue", nnodes="2:4", node_rank=3,
                         master_addr="127.0.0.1")
    assert resolve(spare).spare and resolve(spare).world_size == 2 and resolve(spare).max_nodes == 4
    with pytest.raises(ConfigError, match="--node-rank 4 is out of range for --nnodes 4"):
        LaunchConfig(program="x.py", on_failure="continue", nnodes="2:4", node_rank=4, master_addr="127.0.0.1")
    with pytest.raises(ConfigError, match="--rdzv-backend c10d: across nodes the mode's launchers decide"):
        LaunchConfig(program="x.py", on_failure="continue", nnodes="2:3", rdzv_backend="c10d",
                     rdzv_endpoint="127.0.0.1:29400")
    with pytest.raises(ConfigError, match="survive deaths on one node only"):
        LaunchConfig(program="x.py", on_failure="continue", nnodes=3, num_servers=1, master_addr="127.0.0.1")
    with pytest.raises(ConfigError, match="cannot take a seat in the parameter servers' channel"):
        LaunchConfig(program="x.py", on_failure="continue", num_servers=1, max_restarts=1)
    LaunchConfig(program="x.py", on_failure="continue", num_servers=2, ps_replication=2)


def test_a_ddp_script_under_the_mode_fails_at_once_instead_of_training_alone(tmp_path: Path) -> None:
    plain = tmp_path / "plain.py"
    plain.write_text("import torch, ddpkit\nddpkit.init()\nddpkit.DDP(torch.nn.Linear(2, 2))\n")
    done = launch("--standalone", "--nproc-per-node", "2", "--on-failure", "continue", str(plain))
    assert done.returncode == 1
    assert "no DDP wrapper spans it" in done.stderr and "ddpkit.FaultTolerance" in done.stderr


# ---------------------------------------------------------------- deaths


def _ft_run(tmp_path: Path, name: str, *, kill: str = "", det: bool = True, nproc: int = 3,
            replacements: int = 0, epochs: int = 2, sleep: float = 0.0) -> tuple[dict, dict, str]:
    out = tmp_path / name
    env = base_env(OUT=str(out), KILL=kill, DET="1" if det else "0", EPOCHS=str(epochs), SLEEP=str(sleep))
    done = launch("--standalone", "--nproc-per-node", str(nproc), "--on-failure", "continue", "--max-restarts",
                  str(replacements), script("ft_train.py"), env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(f"{out}.pt"), json.loads(Path(f"{out}.json").read_text()), done.stderr


def test_a_worker_killed_mid_step_costs_nothing_and_the_run_ends_bitwise_equal(tmp_path: Path) -> None:
    reference, plain, _ = _ft_run(tmp_path, "reference")
    weights, account, stderr = _ft_run(tmp_path, "killed", kill="1:4")
    assert "member 1 (rank 1 at the start) died: killed by signal SIGKILL; the job goes on with 2 worker(s)" in stderr
    assert account["world_size"] == 2 and len(account["changes"]) == 1
    change = account["changes"][0]
    assert change["rebuilt"] >= change["noticed"] and change["resumed"] >= change["rebuilt"]
    # Same steps, same learning rate (the scheduler follows the step), and every shard of every step
    # reduced exactly once: the step's own count of the samples it reduced.
    assert account["committed"] == plain["committed"] == 26 and account["lr"] == plain["lr"]
    assert account["trained"] == plain["trained"]
    assert all(weights[k].equal(reference[k]) for k in reference)  # batch norm, dropout, momentum included


@pytest.mark.slow("four runs of three workers: both modes, with and without a death")
def test_without_the_deterministic_mode_a_death_changes_only_the_order_of_additions(tmp_path: Path) -> None:
    reference, _, _ = _ft_run(tmp_path, "reference", det=False)
    weights, _, _ = _ft_run(tmp_path, "killed", kill="2:3", det=False)
    for name, ref in reference.items():
        scale = ref.double().abs().max().clamp(min=1e-12)
        assert float((weights[name].double() - ref.double()).abs().max() / scale) < 1e-5, name


@pytest.mark.slow("two runs of three workers, one with two deaths and their replacements")
def test_replacements_join_live_and_take_the_state_from_a_peer(tmp_path: Path) -> None:
    reference, _, _ = _ft_run(tmp_path, "reference", epochs=6)
    # 78 steps of 0.15 s: time for the replacements' interpreters to start and join.
    weights, account, stderr = _ft_run(tmp_path, "replaced", kill="1:2,2:3", replacements=2, epochs=6, sleep=0.15)
    assert stderr.count("to replace it") == 2 and stderr.count("joined:") == 2
    assert account["world_size"] == 3  # grown back
    assert [c["size"] for c in account["changes"]][-1] == 3 and account["committed"] == 78
    assert all(weights[k].equal(reference[k]) for k in reference)


def test_replacements_that_never_joined_are_stopped_when_training_ends(tmp_path: Path) -> None:
    # Two deaths in a short run: the last worker finishes before the replacements' interpreters are up.
    _, account, stderr = _ft_run(tmp_path, "short", kill="1:2,2:3", replacements=2)
    assert "training is over: stopping 2 replacement(s) that had not joined yet" in stderr
    assert account["world_size"] == 1 and account["committed"] == 26


def test_the_last_workers_death_fails_the_job_and_leaves_nothing(tmp_path: Path) -> None:
    done = launch("--standalone", "--nproc-per-node", "2", "--on-failure", "continue", script("ft_train.py"),
                  env=base_env(KILL="0:2,1:5"), timeout=120)
    assert done.returncode == 1
    assert "the job goes on with 1 worker(s)" in done.stderr
    assert "no worker holding the training state is left" in done.stderr


def test_a_replacement_never_trains_from_scratch_when_every_holder_of_the_state_died(tmp_path: Path) -> None:
    # Member 1 dies, its replacement starts; member 0 dies before the replacement joined: nobody can hand it the
    # state, so the job fails (a replacement alone would start training again from step 0).
    done = launch("--standalone", "--nproc-per-node", "2", "--on-failure", "continue", "--max-restarts", "1",
                  script("ft_train.py"), env=base_env(KILL="1:2,0:4"), timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "started member 2 to replace it" in done.stderr
    assert "no worker holding the training state is left (stopping 1 replacement(s) that had not joined)" in done.stderr


def _train(out: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "ddpkit", "train", "--dataset", "mnist", "--data-dir", str(MNIST),
                           "--epochs", "1", "--no-progress", "--output-dir", str(out), *args],
                          env=base_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.mark.skipif(not MNIST.is_dir(), reason="needs ../shared/data/mnist")
def test_train_in_the_mode_trains_ddps_bits_when_nobody_dies(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    # With a warm-up: the learning rate of every step is the default mode's too.
    ddp = _train(tmp_path / "ddp", "--nproc-per-node", "2", "--warmup-epochs", "0.5")
    survive = _train(tmp_path / "continue", "--nproc-per-node", "2", "--warmup-epochs", "0.5", "--on-failure",
                     "continue")
    assert survive["test_accuracy"] == ddp["test_accuracy"] and survive["steps"] == ddp["steps"]
    a, b = load_file(tmp_path / "ddp" / "model.safetensors"), load_file(tmp_path / "continue" / "model.safetensors")
    assert all(a[k].equal(b[k]) for k in a)
    metrics = [json.loads(line) for line in (tmp_path / "continue" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["min_seen"] == metrics[-1]["max_seen"] == 1


@pytest.mark.slow("a reference run of four workers, then ten faults at random moments in one run (about 2.5 min)")
def test_ten_faults_in_one_run_of_four_workers_end_bitwise_equal_with_every_sample_once(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "chaos.py"), "--mode", "continue", "--faults", "10",
                           "--seed", "3", "--epochs", "150", "--json", str(report), "--workdir", str(tmp_path / "w")],
                          env=base_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(report.read_text())
    assert result["ok"] and sum(result["sent"].values()) == 10 and result["survived_by_the_job"] == 10
    [run] = result["runs"]  # one run took all ten
    assert run["bit_identical"] and not run["epochs_not_once"] and not run["processes_left"]
    assert run["membership_changes"] >= 1 and run["world_size_at_the_end"] == 4


ALONE = """
import torch, torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
import ddpkit

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused, self.frozen = nn.Linear(6, 2), nn.Linear(6, 2), nn.Linear(2, 2)
        self.frozen.requires_grad_(False)
    def forward(self, x):
        return self.frozen(self.used(x))

torch.manual_seed(0)
x, y = torch.randn(30, 6), torch.randint(0, 2, (30,))
net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.1)
ft = ddpkit.FaultTolerance(net, opt, TensorDataset(x, y), batch_size=12, virtual_shards=3, shuffle=False)
for step in ft.steps(max_steps=3):
    for xb, yb in step:
        F.cross_entropy(net(xb), yb).backward()
    assert step.sync(values=torch.tensor([1.0, 2.0]))
    batch = step.engine.shards.step(step.index)
    expected = torch.autograd.grad(F.cross_entropy(net(x[batch]), y[batch]), [net.used.weight])[0]
    assert torch.allclose(net.used.weight.grad, expected, atol=1e-6), step.index  # the global batch's mean
    assert net.unused.weight.grad is None and net.frozen.weight.grad is None  # as under DDP
    assert step.values.tolist() == [1.0, 2.0] and sum(step.trained) == len(batch)
    opt.step()
    opt.zero_grad()
assert [len(ft.shards.step(i)) for i in range(3)] == [12, 12, 6]  # the epoch's last step is short
try:
    for step in ft.steps(max_steps=4):
        list(step)
        step.sync(values=torch.zeros(17))
except ValueError as e:
    assert "at most 16 values" in str(e)
else:
    raise AssertionError("17 values went through")
print("OK")
"""


def test_alone_the_engine_gives_the_global_batchs_gradient_and_leaves_unused_ones_none(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", ALONE], env=base_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]

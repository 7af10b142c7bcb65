"""Parameter servers (ddpkit.ParameterServerOptimizer) and stale-synchronous training (StaleSynchronousOptimizer).

Real processes: ``ddpkit.spawn(..., num_servers=K)`` starts the workers and the servers; references are
ddpkit's DDP (itself bitwise equal to torch's) with the same optimizer, side by side in the same workers.
"""

from __future__ import annotations

import copy
import json
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.parallel.ps.channel import ps_place
from ddpkit.parallel.ps.optimizer import partition
from ddpkit.runtime.spawn import WorkerError, start_forkserver


@pytest.fixture(autouse=True, scope="module")
def _forkserver() -> None:
    """Workers and servers fork from one server that imported torch and this module once (``ddpkit train``'s
    way), instead of each importing them afresh: what the tests check is the processes' conversation."""
    start_forkserver(["torch", "ddpkit", __name__])


def _spawn(fn, nprocs: int, **kw) -> None:  # type: ignore[no-untyped-def]
    ddpkit.spawn(fn, nprocs, start_method="forkserver", **kw)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(steps)]


def _groups(model: nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [{"params": params[:2], "weight_decay": 0.01}, {"params": params[2:]}]


def _sync_vs_ddp(rank: int, out: str, optimizer: str) -> None:
    ddpkit.init()
    net = _net()
    ref_net = copy.deepcopy(net)
    cls, kw = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}) if optimizer == "sgd" else (torch.optim.AdamW,
                                                                                       {"lr": 0.01})
    opt = ddpkit.ParameterServerOptimizer(_groups(net), cls, mode="sync", **kw)
    ddp = ddpkit.DDP(ref_net)
    ref = cls(_groups(ddp.module), **kw)
    for x, y in _batches(rank, 12):
        for model, o in ((net, opt), (ddp, ref)):
            o.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            o.step()
    same = all(torch.equal(a, b) for a, b in zip(net.parameters(), ref_net.parameters()))
    mine, theirs = opt.state_dict(), ref.state_dict()
    state_same = all(torch.equal(mine["state"][i][k], theirs["state"][i][k])
                     for i in theirs["state"] for k in theirs["state"][i] if torch.is_tensor(theirs["state"][i][k]))
    groups_same = [{k: v for k, v in g.items()} for g in mine["param_groups"]] == theirs["param_groups"]
    # A state saved and loaded back (every worker) goes on as before: one more step on each side.
    opt.load_state_dict(copy.deepcopy(mine))
    x, y = _batches(rank + 10, 1)[0]
    for model, o in ((net, opt), (ddp, ref)):
        o.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        o.step()
    after_load = all(torch.equal(a, b) for a, b in zip(net.parameters(), ref_net.parameters()))
    diff = max((a - b).abs().max().item() for a, b in zip(net.parameters(), ref_net.parameters()))
    opt.close()
    Path(out, f"{rank}.json").write_text(json.dumps({"same": same, "state": state_same, "groups": groups_same,
                                                     "after_load": after_load, "diff": diff,
                                                     "stats": opt.stats.as_dict()}))


@pytest.mark.parametrize("world, servers, optimizer", [(2, 2, "sgd"), (2, 1, "adamw"), (3, 2, "sgd")])
def test_sync_parameter_servers_make_ddps_update(tmp_path: Path, world: int, servers: int, optimizer: str) -> None:
    _spawn(_sync_vs_ddp, world, args=(str(tmp_path), optimizer), num_servers=servers)
    for rank in range(world):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got["stats"]["steps"] == 13 and got["stats"]["staleness_max"] == 0
        assert got["groups"], "the state dict's groups are the local optimizer's"
        if world == 2:
            # Two workers: the server's (g0/2 + g1/2) is gloo's all-reduce of the pre-divided gradients, bit for bit.
            assert got["same"] and got["state"] and got["after_load"], got
        else:
            # Three: gloo's ring adds the three shares in another order than the server (worker order): a few ulps.
            assert got["diff"] < 1e-5, got


def _straggle(rank: int, out: str, strategy: str, staleness: int | None) -> None:
    ddpkit.init()
    net = _net()
    if strategy == "ssp":
        ddpkit.broadcast_parameters(net.state_dict(), root_rank=0)
        opt = ddpkit.StaleSynchronousOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), staleness=staleness)
    else:
        opt = ddpkit.ParameterServerOptimizer(net.parameters(), torch.optim.SGD, lr=0.05, mode="async",
                                              staleness=staleness)
    launched, finished = [], []
    dist.barrier()  # both start together: a worker slow to start would look like a straggler's lead
    for x, y in _batches(rank, 14):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        if rank == 1:
            time.sleep(0.12)  # the straggler
        launched.append(time.monotonic())
        opt.step()
        finished.append(time.monotonic())
    dist.barrier()
    if strategy == "ssp":
        opt.synchronize()
        stats = opt.stats()
    else:
        opt.pull()
        stats = opt.stats.as_dict()
        opt.close()
    replicas = [torch.cat([p.detach().reshape(-1) for p in net.parameters()])]
    gathered = [torch.empty_like(replicas[0]) for _ in range(2)]
    dist.all_gather(gathered, replicas[0])
    Path(out, f"{rank}.json").write_text(json.dumps({
        "launched": launched, "finished": finished, "stats": stats,
        "one_model": torch.equal(gathered[0], gathered[1])}))


def _leads(out: Path) -> list[int]:
    """For each step of the fast worker (0): how many steps it had finished beyond the straggler's launches."""
    fast, slow = (json.loads((out / f"{r}.json").read_text()) for r in (0, 1))
    return [t + 1 - sum(1 for s in slow["launched"] if s <= end) for t, end in enumerate(fast["finished"])]


@pytest.mark.slow("a straggler slowed on purpose")
@pytest.mark.parametrize("strategy", ["ps-async", "ssp"])
def test_a_straggler_makes_the_fast_worker_wait_after_s_steps_never_more(tmp_path: Path, strategy: str) -> None:
    s = 2
    kw = {"num_servers": 1} if strategy == "ps-async" else {}
    _spawn(_straggle, 2, args=(str(tmp_path), strategy, s), **kw)
    leads = _leads(tmp_path)
    # Finishing step t (and starting to compute step t+1) needs the straggler to have launched step t+1-S-ish:
    # the fast worker ends each step at most S+1 steps of gradients ahead of the straggler's launches.
    assert max(leads) <= s + 1, leads
    assert max(leads) >= s, leads  # it did run S steps ahead (then waited), not fewer
    fast = json.loads((tmp_path / "0.json").read_text())
    assert fast["one_model"], "after synchronising, both workers hold one model"
    if strategy == "ps-async":
        assert fast["stats"]["max_lead"] == s  # the server's own count: S ahead at most, and reached
        assert fast["stats"]["bound_wait_s"] > 0.5  # held back for the straggler
    else:
        assert fast["stats"]["staleness_max"] <= s
        assert fast["stats"]["wait_s"] > 0.5


def test_without_a_bound_the_fast_worker_runs_ahead(tmp_path: Path) -> None:
    _spawn(_straggle, 2, args=(str(tmp_path), "ps-async", None), num_servers=1)
    fast = json.loads((tmp_path / "0.json").read_text())
    assert max(_leads(tmp_path)) > 4  # nothing holds it: it runs through its shard
    assert fast["stats"]["bound_wait_s"] == 0.0
    assert fast["one_model"]


def _ssp_zero(rank: int, out: str) -> None:
    ddpkit.init()
    net = _net()
    ref_net = copy.deepcopy(net)
    opt = ddpkit.StaleSynchronousOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), staleness=0)
    state = ddpkit.TrainState(model=net, optimizer=opt)
    ddp = ddpkit.DDP(ref_net)
    ref = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches(rank, 8):
        for model, o in ((net, opt), (ddp, ref)):
            o.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            o.step()
    Path(out, f"{rank}.json").write_text(json.dumps({
        "same": all(torch.equal(a, b) for a, b in zip(net.parameters(), ref_net.parameters())),
        "steps": state.step}))


def test_ssp_with_staleness_zero_is_ddp_bit_for_bit(tmp_path: Path) -> None:
    _spawn(_ssp_zero, 2, args=(str(tmp_path),))
    for rank in range(2):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got == {"same": True, "steps": 8}  # and a TrainState counts each step once


def _no_servers(rank: int) -> None:
    ddpkit.init()
    ddpkit.ParameterServerOptimizer(_net().parameters(), torch.optim.SGD, lr=0.1)


def test_without_servers_the_optimizer_says_how_to_start_them() -> None:
    with pytest.raises(WorkerError, match="ddpkit launch --num-servers K"):
        _spawn(_no_servers, 1)


def _server_dies(rank: int) -> None:
    import os
    import signal

    ddpkit.init()
    net = _net()
    opt = ddpkit.ParameterServerOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    if rank == 0:
        os.kill(_server_pid(), signal.SIGKILL)
    for x, y in _batches(rank, 50):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        time.sleep(0.05)


def _server_pid() -> int:
    """The job's parameter server: the process that names itself ``ddpkit-server0``, a child of our parent."""
    import os

    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if name == "ddpkit-server0" and parent == os.getppid():
                return int(entry)
    raise AssertionError("no process named ddpkit-server0 beside this worker")


def test_a_killed_server_fails_the_job_naming_it() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError, match="parameter server 0 failed: process killed by signal SIGKILL"):
        _spawn(_server_dies, 2, num_servers=1)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "eventual"}, "mode='eventual' is not a parameter server mode"),
    ({"mode": "sync", "staleness": 2}, "staleness=2 bounds mode='async'"),
    ({"mode": "async", "staleness": -1}, "staleness=-1 must be a whole number >= 0"),
])
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ddpkit.ParameterServerOptimizer(_net().parameters(), torch.optim.SGD, lr=0.1, **kwargs)


def test_ssp_refuses_a_bad_staleness() -> None:
    with pytest.raises(ValueError, match="staleness=-1 must be a whole number >= 0"):
        ddpkit.StaleSynchronousOptimizer(torch.optim.SGD(_net().parameters(), lr=0.1), staleness=-1)


def test_partition_balances_whole_tensors_over_the_servers() -> None:
    assert partition([100, 10, 10, 50, 60], 2) == [0, 1, 1, 1, 1]
    assert partition([5, 5, 5], 3) == [0, 1, 2]
    assert partition([7], 2) == [0]


def test_the_channel_reads_its_place_from_the_environment() -> None:
    env = {"DDPKIT_NUM_SERVERS": "2", "WORLD_SIZE": "3", "RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "5000"}
    place = ps_place(env)
    assert (place.role, place.index, place.rank, place.port, place.servers) == ("worker", 1, 1, 5001, 2)
    server = ps_place({**env, "DDPKIT_ROLE": "server", "DDPKIT_SERVER_RANK": "1", "DDPKIT_PS_PORT": "6000"})
    assert (server.role, server.rank, server.port) == ("server", 4, 6000)
    assert ps_place({"WORLD_SIZE": "2"}) is None
    with pytest.raises(ValueError, match="DDPKIT_SERVER_RANK=2 is not below DDPKIT_NUM_SERVERS=2"):
        ps_place({**env, "DDPKIT_ROLE": "server", "DDPKIT_SERVER_RANK": "2"})
    with pytest.raises(ValueError, match="DDPKIT_NUM_SERVERS='x' must be a whole number >= 1"):
        ps_place({**env, "DDPKIT_NUM_SERVERS": "x"})


def _more_servers_than_tensors(rank: int, out: str) -> None:
    ddpkit.init()
    torch.manual_seed(0)
    net = nn.Linear(8, 1)  # two tensors, three servers: one server holds nothing
    ref_net = copy.deepcopy(net)
    opt = ddpkit.ParameterServerOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    ddp = ddpkit.DDP(ref_net)
    ref = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in _batches(rank, 3):
        for model, o in ((net, opt), (ddp, ref)):
            o.zero_grad()
            nn.functional.mse_loss(model(x).squeeze(1), y.float()).backward()
            o.step()
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
    opt.close()
    Path(out, f"{rank}.json").write_text(json.dumps(
        all(torch.equal(a, b) for a, b in zip(net.parameters(), ref_net.parameters()))))


def test_a_server_without_tensors_still_serves_its_part(tmp_path: Path) -> None:
    _spawn(_more_servers_than_tensors, 2, args=(str(tmp_path),), num_servers=3)
    assert [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)] == [True, True]


def test_ssp_step_hooks_run_once_per_step() -> None:
    model = nn.Linear(2, 2)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ddpkit.TrainState(model=model, optimizer=plain)
    opt = ddpkit.StaleSynchronousOptimizer(plain, staleness=1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert state.step == 1


def _leaves_early(rank: int) -> None:
    ddpkit.init()
    net = _net()
    opt = ddpkit.ParameterServerOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    for x, y in _batches(rank, 2 if rank == 1 else 4):  # rank 1 takes fewer synchronous steps
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    opt.close()


def test_a_worker_that_leaves_a_synchronous_job_early_is_named_not_waited_for() -> None:
    with pytest.raises(WorkerError, match="worker 1 left .* while worker 0 waits for it in a synchronous request"):
        _spawn(_leaves_early, 2, num_servers=1)


def test_the_channel_meets_under_the_jobs_secret_and_listens_where_the_store_does(monkeypatch) -> None:
    import threading

    import torch.distributed as dist

    from ddpkit.parallel.ps.channel import PSPlace, connect
    from ddpkit.runtime.process import free_port
    from ddpkit.runtime.rendezvous import job_keys

    monkeypatch.setenv("DDPKIT_JOB_TOKEN", "a secret of this job")
    port = free_port()
    places = [PSPlace(role="worker", index=0, workers=1, servers=1, master_addr="127.0.0.1", port=port),
              PSPlace(role="server", index=0, workers=1, servers=1, master_addr="127.0.0.1", port=port)]
    groups: list = [None, None]
    threads = [threading.Thread(target=lambda i=i: groups.__setitem__(i, connect(places[i], timeout=30)))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(g is not None for g in groups)
    client = dist.TCPStore("127.0.0.1", port, None, False, wait_for_workers=False)
    prefix = job_keys("a secret of this job")[1]
    assert client.check([f"{prefix}ps//0/0"]) and not client.check(["ddpkit-ps//0/0"])  # not a fixed prefix any more
    outside = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)} - {"127.0.0.1"}
    outside |= {a for a in _interface_addresses() if not a.startswith("127.")}
    for address in outside:  # loopback alone, as the job's address is loopback
        with pytest.raises(OSError):
            socket.create_connection((address, port), timeout=2).close()


def _interface_addresses() -> set[str]:
    import subprocess

    done = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True)
    return {line.split()[3].split("/")[0] for line in done.stdout.splitlines() if len(line.split()) > 3}


def test_a_channel_whose_member_never_comes_says_so_not_to_check_the_port() -> None:
    # The store answered and the server never came: the error said to check that the port was free (until
    # 2026-12-02), whatever had failed.
    from ddpkit.parallel.ps.channel import PSPlace, connect
    from ddpkit.runtime.process import free_port

    port = free_port()
    alone = PSPlace(role="worker", index=0, workers=1, servers=1, master_addr="127.0.0.1", port=port)
    with pytest.raises(RuntimeError) as caught:
        connect(alone, timeout=1)
    said = str(caught.value)
    assert f"worker 0 reached the parameter servers' channel at 127.0.0.1:{port}, but its 1 worker(s) and 1 " \
           "server(s) did not all meet there within 1 s" in said, said
    assert "died, was stopped or never started" in said and "port is free" not in said

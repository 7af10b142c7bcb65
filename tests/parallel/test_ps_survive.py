"""Parameter servers through deaths: ``ddpkit launch --on-failure continue --num-servers K --ps-replication R``.

Real processes (``tests/scripts/ps_survive.py``): the launcher keeps the workers left after a worker's death,
and the job after a server's death while every key range still has a server; the runs are compared with the
same run without a death, or counted update by update.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from procs import launch, script

from ddpkit.launcher.launch_config import LaunchConfig
from ddpkit.runtime.options import ConfigError
from ddpkit.runtime.process import lost_key_ranges

pytestmark = pytest.mark.alone("a parameter server's job, and faults sent while it trains")


SHORT_KEEP_ALIVE = ("--rdzv-conf", "keep_alive_interval=0.25,keep_alive_max_attempt=8")
"""A process silent for 2 s is stalled (6 s by default): the tests of stalls wait less."""


def _run(out: Path, *args: str, workers: int = 2, servers: int = 3, replication: int = 2, timeout: float = 120,
         launch_flags: tuple[str, ...] = ()):
    out.mkdir()
    return launch("--standalone", "--nproc-per-node", str(workers), "--num-servers", str(servers),
                  "--ps-replication", str(replication), "--on-failure", "continue", *launch_flags,
                  script("ps_survive.py"), "--out", str(out), *args, timeout=timeout)


def _params(out: Path, rank: int) -> list[torch.Tensor]:
    return torch.load(out / f"rank{rank}.pt")


def _plain(folder: Path) -> list[list[torch.Tensor]]:
    plain = _run(folder / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    return [_params(folder / "plain", rank) for rank in range(2)]


@pytest.mark.slow("a whole job of two workers and three servers, a server killed, against the run without (shared)")
@pytest.mark.parametrize("kill", ["0@3", "1@7", "stop 0@3"])
def test_a_synchronous_job_loses_a_server_and_ends_bitwise_equal_to_the_run_without(tmp_path: Path, shared_runs,
                                                                                    kill: str) -> None:
    # Momentum and weight decay: the replica must have made every update the dead head made, in its order.
    # A server stopped (SIGSTOP) held every worker's request to it for good (it had no beat): now its launcher
    # kills it after the keep-alive, and its death is survived as any other.
    plain, _ = shared_runs.get("ps_survive sync 2 workers 3 servers replication 2", _plain)
    stop = kill.startswith("stop ")
    kill = kill.removeprefix("stop ")
    killed = _run(tmp_path / "killed", "--stop-server" if stop else "--kill-server", kill,
                  launch_flags=SHORT_KEEP_ALIVE if stop else ())
    assert killed.returncode == 0, killed.stderr[-3000:]
    server = kill.split("@")[0]
    if stop:
        assert (f"parameter server {server} sent no word for 2 s (a beat is due every 0.25 s): it stalled (paused, "
                "or holding Python's lock); killing it") in killed.stderr, killed.stderr[-3000:]
    assert f"parameter server {server} died: killed by signal SIGKILL; its key ranges are served by the next " \
           "server of their chains (--ps-replication 2), the job goes on with 2 server(s)" in killed.stderr
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(plain[rank], _params(tmp_path / "killed", rank)))


@pytest.mark.slow("a whole job of three workers and two servers through two deaths")
def test_asynchronous_workers_go_on_through_a_worker_and_a_server_death_losing_no_answered_update(
        tmp_path: Path) -> None:
    # Every gradient is all ones: each update a server applies takes 1/3 off each element of its tensors, so
    # the final values count the updates applied, tensor by tensor.
    out = tmp_path / "run"
    done = _run(out, "--mode", "async", "--model", "ones", "--steps", "40", "--kill-self", "2@0.5",
                "--kill-server", "0@20", workers=3, servers=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "member 2 (rank 2 at the start) died" in done.stderr
    assert "parameter server 0 died" in done.stderr
    acked = {r: int((out / f"acked{r}").read_text()) for r in range(3)}
    assert acked[0] == acked[1] == 40 and 1 <= acked[2] < 40
    final = _params(out, 0)
    assert all(torch.equal(a, b) for a, b in zip(final, _params(out, 1)))
    for t in final:
        assert torch.equal(t, t[0].expand_as(t)), "an update was applied to part of a tensor"
        applied = round(float(-t[0] * 3))
        # Every answered update is applied once (none lost with the server, none twice after the resend); the
        # dead worker's last push, never answered, was applied whole or not at all.
        assert applied - sum(acked.values()) in (0, 1)


@pytest.mark.slow("a whole job of two workers and two servers, a server killed or stopped")
@pytest.mark.parametrize("fault", ["--kill-server", "--stop-server"])
def test_a_server_death_that_loses_a_key_range_fails_the_job_naming_the_server(tmp_path: Path, fault: str) -> None:
    done = _run(tmp_path / "run", fault, "0@3", servers=2, replication=1,
                launch_flags=SHORT_KEEP_ALIVE if fault == "--stop-server" else ())
    assert done.returncode != 0
    assert "parameter server 0 failed first: killed by signal SIGKILL" in done.stderr
    assert ("(killed by its launcher: it had stalled, no word from it for 2 s)" in done.stderr) == (
        fault == "--stop-server"), done.stderr[-3000:]


@pytest.mark.slow("a whole job of two workers and two servers, a worker killed")
def test_a_synchronous_job_that_loses_a_worker_fails_at_once_saying_why(tmp_path: Path) -> None:
    # The server raises (a synchronous step needs every worker); its replica would raise the same, so the job
    # ends at the first server's failure instead of handing the range down the chain.
    done = _run(tmp_path / "run", "--steps", "400", "--kill-self", "1@0.3", servers=2)
    assert done.returncode != 0
    assert "failed first: exit code 1" in done.stderr
    assert "worker 1 left" in done.stderr
    assert "its key ranges are served by the next server" not in done.stderr


def test_a_worker_that_dies_before_the_channel_is_built_ends_the_job_at_once(tmp_path: Path) -> None:
    # The channel is one group of every worker and server: without the launcher's word the others would wait
    # for the dead one until the channel's timeout (300 s).
    start = time.monotonic()
    done = _run(tmp_path / "run", "--exit-early", "1")
    assert done.returncode != 0
    assert "worker(s) 1 died before it was built" in done.stderr
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("fault", ["--kill-server", "--stop-server"])
def test_a_server_lost_before_the_channel_is_built_ends_the_job_at_once_naming_it(tmp_path: Path, fault: str) -> None:
    # The launcher survives a server's death while every key range keeps a server, but the channel is one group of
    # every process, made once: the others waited for the lost server until the channel's timeout (300 s).
    start = time.monotonic()
    done = _run(tmp_path / "run", fault, "0@-1", launch_flags=SHORT_KEEP_ALIVE if fault == "--stop-server" else ())
    assert done.returncode != 0
    assert ("parameter server 0 died before the channel to the servers was built (killed by signal SIGKILL): it is "
            "one group of every worker and server, made once, so no replica stands in for it there; stopping the "
            "job") in done.stderr, done.stderr[-3000:]
    assert "parameter server 0 failed first" in done.stderr and "the job goes on with 2 server(s)" not in done.stderr
    assert time.monotonic() - start < 60


def test_key_ranges_are_lost_only_when_a_whole_chain_died() -> None:
    assert lost_key_ranges({0}, 3, 2) == []
    assert lost_key_ranges({0, 1}, 3, 2) == [0]
    assert lost_key_ranges({0, 2}, 3, 2) == [2]
    assert lost_key_ranges({0, 1}, 3, 3) == []
    assert lost_key_ranges({1}, 2, 1) == [1]


@pytest.mark.parametrize("kwargs, message", [
    ({"num_servers": 2, "ps_replication": 3}, "--ps-replication 3 must be between 1 and --num-servers 2"),
    ({"ps_replication": 2}, "--ps-replication 2 without --num-servers"),
    ({"num_servers": 1, "ps_replication": 0}, "--ps-replication 0 must be between 1"),
])
def test_bad_replication_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LaunchConfig(program="x.py", **kwargs)

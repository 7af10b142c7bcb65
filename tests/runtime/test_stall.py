"""The stall inspector: a stopped rank, an extra collective and a slow rank are named (real launches)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ddpkit.launcher.supervise import extract_stall_report
from ddpkit.runtime import stall
from ddpkit.runtime.process import free_port
from tests.procs import SCRIPTS, base_env, launch


def _job(mode: str, **env: str):
    start = time.monotonic()
    done = launch("--nproc-per-node", "2", "--prefix-output", str(SCRIPTS / "stall.py"), mode, timeout=120,
                  env=base_env(**env))
    return done, time.monotonic() - start


@pytest.mark.slow("waits past the stall inspector's threshold")
def test_a_stopped_rank_is_named_with_its_operation_and_becomes_the_root_cause():
    done, took = _job("stop", DDPKIT_TIMEOUT="8", DDPKIT_STALL_WARN="3")
    assert done.returncode == 1, done.stderr
    err = done.stderr
    # The warning, while rank 0 still waits: within the threshold plus a tick or two.
    warning = next(line for line in err.splitlines() if "ddpkit stall: rank 1 stalled" in line)
    assert "[rank0]" in warning and 'DDP bucket 0 all-reduce, step 4"' in warning, warning
    waited = int(warning.split(" waited ")[1].split(" s ")[0])
    assert 3 <= waited <= 6, warning
    assert "still waiting" in err
    assert "no heartbeat for" in err and "process stopped, hung or gone" in err
    # The launcher's root cause is the stopped rank, not rank 0 that timed out.
    verdict = err.split("ddpkit launch: ")[-1]
    assert verdict.startswith("rank 1 stalled: collective #"), verdict
    assert "Root cause (stall inspector, reported by rank 0)" in verdict
    assert "rank 0 (local rank 0) then failed first" in verdict
    assert "Root cause: rank 0" not in err
    assert took < 60


@pytest.mark.slow("waits past the stall inspector's threshold")
def test_an_extra_collective_on_one_rank_is_named_with_both_operations():
    done, _ = _job("extra", DDPKIT_TIMEOUT="8", DDPKIT_STALL_WARN="3")
    assert done.returncode == 1, done.stderr
    verdict = done.stderr.split("ddpkit launch: ")[-1]
    assert verdict.startswith("ranks disagree on collective #"), verdict
    assert 'rank 1 issued "barrier"' in verdict
    assert 'rank 0 issued "DDP broadcast buffers from group rank 0"' in verdict or \
        'rank 0 issued "DDP bucket 0 all-reduce, step 4"' in verdict, verdict


@pytest.mark.slow("waits past the stall inspector's threshold")
def test_a_slow_but_alive_rank_is_reported_once_and_the_job_finishes():
    done, _ = _job("slow", DDPKIT_STALL_WARN="2", SLOW_S="5")
    assert done.returncode == 0, done.stderr
    reports = [line for line in done.stderr.splitlines() if "ddpkit stall: rank 1 stalled" in line]
    assert len(reports) == 1, done.stderr
    assert "heartbeat" in done.stderr and "running, but not reaching the collective" in done.stderr
    assert done.stdout.count("finished") == 2


@pytest.mark.slow("two launched jobs past the stall inspector's threshold")
def test_a_healthy_job_prints_nothing_and_warn_zero_turns_it_off():
    done, _ = _job("ok", DDPKIT_STALL_WARN="3")  # (1 s: a loaded machine can hold a rank that long)
    assert done.returncode == 0 and "ddpkit stall" not in done.stderr, done.stderr
    done, _ = _job("slow", DDPKIT_STALL_WARN="0", SLOW_S="3")
    assert done.returncode == 0 and "ddpkit stall" not in done.stderr, done.stderr


def test_a_bad_stall_setting_names_the_value():
    done, _ = _job("ok", DDPKIT_STALL_WARN="soon")
    assert done.returncode == 2  # refused by the launcher before any worker starts
    assert "DDPKIT_STALL_WARN='soon' is not a number of seconds" in done.stderr and "Traceback" not in done.stderr


def _state(seq, recent, since=0.0, wall=100.0):
    return {"seq": seq, "op": recent[-1][1] if recent else "", "since": since, "wall": wall,
            "recent": [list(r) for r in recent], "host": "h", "pid": 1}


@pytest.mark.slow("waits past the stall inspector's threshold")
def test_a_peer_that_exited_is_named_so_and_a_zero3_state_dict_on_one_rank_is_explained():
    done, _ = _job("zero3", DDPKIT_TIMEOUT="8", DDPKIT_STALL_WARN="2")
    assert done.returncode == 1, done.stderr
    err = done.stderr
    assert "rank 1 stalled" in err
    assert "then its process exited without an exception before issuing this collective" in err, err[-3000:]
    assert "a ZeRO-3 model's state_dict() and forward gather its parameters: a collective every rank calls" in err
    assert "hung or gone" not in err.split("ddpkit stall: rank 1 stalled", 1)[1].split("\n")[1]


def test_diagnose_names_laggards_and_the_first_disagreement():
    a = _state(3, [(1, "barrier"), (2, "x"), (3, "DDP bucket 0 all-reduce, step 1")], since=40, wall=100)
    b = _state(2, [(1, "barrier"), (2, "x")], since=30, wall=60)
    lines = stall.diagnose(0, {0: a, 1: b, 2: None}, now=100.0, stale_s=3)
    assert lines[0].startswith('ranks 1, 2 stalled: collective #3 "DDP bucket 0 all-reduce, step 1" waited 60 s')
    assert "rank 1 (h, pid 1): last seen entering #2 \"x\", 70 s ago; no heartbeat for 40 s" in lines[1]
    assert "rank 2: never published" in lines[2]
    c = _state(2, [(1, "barrier"), (2, "y")], wall=100)
    lines = stall.diagnose(0, {0: a, 1: c}, now=100.0, stale_s=3)
    assert lines[0].startswith('ranks disagree on collective #2: rank 0 issued "x"; rank 1 issued "y"')
    assert stall.diagnose(0, {0: a, 1: _state(3, a["recent"], wall=100)}, now=100.0, stale_s=3) == []
    gone = {**b, "ended": "exited without an exception"}
    z = _state(3, [(3, "DDP zero-3 unit 0 all-gather of the parameters")], since=40, wall=100)
    lines = stall.diagnose(0, {0: z, 1: gone}, now=100.0, stale_s=3)
    assert "then its process exited without an exception before issuing this collective" in lines[1]
    assert "no heartbeat" not in lines[1] and "a collective every rank calls" in lines[2]


def test_extract_stall_report_keeps_the_last_report():
    tail = ["noise", f"{stall.PREFIX}rank 1 stalled: first", f"{stall.PREFIX}  still waiting; ...",
            f"[rank0]: {stall.PREFIX}rank 1 stalled: second", f"[rank0]: {stall.PREFIX}  rank 1: where",
            f"{stall.PREFIX}  rank 0's collective failed; the error follows", "Traceback (most recent call last):"]
    assert extract_stall_report(tail) == ["rank 1 stalled: second", "  rank 1: where",
                                          "  rank 0's collective failed; the error follows"]
    assert extract_stall_report(["nothing"]) == []


@pytest.mark.parametrize("raw", ["-1", "x"])
def test_warn_seconds_rejects_bad_values(monkeypatch, raw):
    monkeypatch.setenv("DDPKIT_STALL_WARN", raw)
    with pytest.raises(ValueError, match="DDPKIT_STALL_WARN"):
        stall.warn_seconds()


@pytest.mark.slow("waits past the stall inspector's threshold")
def test_a_stopped_rank_0_is_named_while_the_launcher_serves_the_store():
    # Under ddpkit launch the store is the launcher's (torchrun's agent store): it outlives rank 0.
    done, took = _job("stop", DDPKIT_TIMEOUT="8", DDPKIT_STALL_WARN="3", STALL_RANK="0")
    assert done.returncode == 1, done.stderr
    verdict = done.stderr.split("ddpkit launch: ")[-1]
    assert verdict.startswith("rank 0 stalled: collective #"), verdict
    assert "Root cause (stall inspector, reported by rank 1)" in verdict
    assert took < 60


@pytest.mark.slow("waits past the stall inspector's threshold")
def test_a_stopped_rank_0_which_serves_the_store_is_named_and_nothing_hangs():
    # Ranks started by hand: rank 0 serves the store, and stopping it stops the store too.
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "stall.py"), "stop"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=base_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DDPKIT_JOB_TOKEN="stall",
                                           DDPKIT_TIMEOUT="8", DDPKIT_STALL_WARN="3", STALL_RANK="0"))
             for r in (0, 1)]
    start = time.monotonic()
    try:
        _, err = procs[1].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert procs[1].returncode != 0
    assert "the rendezvous store stopped answering" in err, err
    assert "rank 0, which serves it, is stopped, hung or gone" in err
    assert time.monotonic() - start < 60

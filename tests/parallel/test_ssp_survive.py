"""``ddpkit.StaleSynchronousOptimizer`` under ``ddpkit launch --on-failure continue``: a worker's death does not
stop the others, and its in-flight share is applied by every survivor or by none (``tests/scripts/ssp_survive.py``:
every gradient is all ones, so the values count the shares applied)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from procs import base_env, launch, script

pytestmark = pytest.mark.alone("a stale-synchronous job, and faults sent while it trains")

STEPS = 40


def _run(staleness: int, kill: str = "", *flags: str, joined: Path | None = None) -> tuple[list[dict], str]:
    done = launch("--standalone", "--nproc-per-node", "3", "--on-failure", "continue", *flags,
                  script("ssp_survive.py"), timeout=180,
                  env=base_env(STALENESS=str(staleness), KILL=kill, STEPS=str(STEPS), JOINED=str(joined or "")))
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")], done.stderr


@pytest.mark.slow("whole jobs of three workers (the fast tier runs the mode's SSP through a death)")
@pytest.mark.parametrize("staleness", [0, 2])
def test_without_a_death_every_share_of_every_step_is_applied(staleness: int) -> None:
    workers, _ = _run(staleness)
    assert len(workers) == 3
    assert all(w["applied"] == pytest.approx(-STEPS, abs=1e-4) and w["uniform"] for w in workers)


@pytest.mark.parametrize("staleness,kill", [
    pytest.param(2, "1:5", marks=pytest.mark.slow("a whole job of three workers through a death")),
    pytest.param(2, "0:17", marks=pytest.mark.slow("a whole job of three workers through a death")),
    (0, "2:9")])
def test_a_dead_workers_in_flight_share_is_applied_by_every_survivor_or_by_none(staleness: int, kill: str) -> None:
    workers, err = _run(staleness, kill)
    assert f"member {kill.split(':')[0]} (rank" in err and "the job goes on with 2 worker(s)" in err
    assert len(workers) == 2 and all(w["world"] == 2 and w["uniform"] for w in workers)
    applied = [w["applied"] for w in workers]
    assert applied[0] == pytest.approx(applied[1], abs=1e-4), "the survivors applied different shares"
    # Each share is a third (posted by three workers) or a half (posted after the change): a step the dead worker
    # never contributed to brings the survivors' shares only, on every survivor alike; at most the S + 1 steps it
    # had not started lose anything, each at most its third.
    lost_sixths = 6 * (STEPS + applied[0])
    assert lost_sixths == pytest.approx(round(lost_sixths), abs=1e-3) and 0 <= round(lost_sixths) <= 2 * (staleness + 1)


@pytest.mark.slow("a whole job of three workers, a death and a replacement's interpreter")
def test_a_replacement_stops_at_once_saying_why_and_the_survivors_go_on(tmp_path: Path) -> None:
    # The survivors wait for the replacement's refusal before their last steps (an event, not a time: a loaded
    # machine may take many seconds to start its interpreter)
    workers, err = _run(2, "1:5", "--max-restarts", "1", joined=tmp_path / "joined")
    assert "stale-synchronous job takes none" in (tmp_path / "joined").read_text()
    assert "member 3 joins a running job (a replacement, or a spare node's worker): a stale-synchronous job takes " \
           "none" in err, err[-3000:]
    assert len(workers) == 2 and all(w["world"] == 2 and w["uniform"] for w in workers)

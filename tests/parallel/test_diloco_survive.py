"""``ddpkit.DiLoCo`` under ``ddpkit launch --on-failure continue``: a worker's death lets the others go on.

Whole jobs (``tests/scripts/diloco_survive.py``: member ``m``'s inner gradient is all ``3 * 2 ** m``, so the final
values say which outer steps each survivor applied) with a member killed between outer steps, just before one,
and a few milliseconds into one; and, on the rank pool, an outer step that ends on one rank and not on the
other (as when a peer dies inside the exchange): the rank behind takes the global model from the one ahead.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from procs import base_env, launch, script

import ddpkit
from ddpkit.runtime import membership

H, STEPS = 4, 24


def _job(kill: str = "", **env: str) -> tuple[list[dict], str]:
    done = launch("--standalone", "--nproc-per-node", "3", "--on-failure", "continue", script("diloco_survive.py"),
                  timeout=120, env=base_env(KILL=kill, SYNC_EVERY=str(H), STEPS=str(STEPS), **env))
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")], done.stderr


def _expected(dead: int, rounds_with_it: int) -> tuple[float, int]:
    """The final value and the samples held when member ``dead`` took part in the first ``rounds_with_it`` outer
    steps only (each of H inner steps of a sample; member m moves by 3 * 2 ** m per inner step)."""
    rounds = STEPS // H
    others = [3 * 2**m for m in range(3) if m != dead]
    value = -(H * 7.0 * rounds_with_it + H * sum(others) / 2 * (rounds - rounds_with_it))
    return value, 3 * H * rounds_with_it + 2 * H * (rounds - rounds_with_it)


_WHOLE_SUITE = pytest.mark.slow("a job of three workers run alone: the fast tier keeps the death inside an exchange "
                                "(1:7), the hardest of the three")


@pytest.mark.alone("a job of three workers, and a fault timed inside an outer step")
@pytest.mark.parametrize("kill, codec, rounds_with_it", [
    pytest.param("2:6", "fp32", [1], marks=_WHOLE_SUITE), pytest.param("0:8", "int8", [1, 2], marks=_WHOLE_SUITE),
    ("1:7", "fp32", [1, 2])])
def test_a_death_between_or_inside_outer_steps_leaves_the_survivors_equal_and_counts_the_samples(
        kill: str, codec: str, rounds_with_it: list[int]) -> None:
    # 2:6 between outer steps (the dead's second round lost); 0:8 right after its second exchange ended on it
    # (ended on the others too, or given up and done again without it); 1:7 killed 2 ms into its second exchange
    # (in it, or not). Either outcome is right; the survivors must agree on it.
    workers, err = _job(kill, CODEC=codec, INSIDE="1" if kill == "1:7" else "0")
    dead = int(kill.split(":")[0])
    assert f"member {dead} (rank" in err and "the job goes on with 2 worker(s)" in err
    assert len(workers) == 2 and all(w["world"] == 2 and w["uniform"] for w in workers)
    assert workers[0]["value"] == workers[1]["value"] and workers[0]["samples"] == workers[1]["samples"]
    assert (workers[0]["value"], workers[0]["samples"]) in [_expected(dead, r) for r in rounds_with_it]
    assert all(w["changes"][0]["lost"] == [dead] for w in workers)


class _Flaky:
    """The membership of the pool's two ranks, whose view gets a new generation (the same members, the same
    group) as operation ``at`` of their DiLoCo ends: rank 1 gives it up, as when a peer dies inside it, rank 0
    has ended it. Every operation still completes: the harness's group stays usable. The waits: 3 for the start
    (an all-gather, a broadcast of the length, of the bytes), then 2 per exchange (the pseudo-gradient, the
    count)."""

    def __init__(self, at: int | None) -> None:
        self.member, self.generation, self.waits, self.at = dist.get_rank(), 0, 0, at

    def latest(self) -> membership.View:
        return membership.View(self.generation, (0, 1))

    def group(self, view: membership.View) -> dist.ProcessGroup:
        return dist.group.WORLD

    def wait(self, work, view: membership.View) -> None:
        work.wait()
        self.waits += 1
        if self.at is not None and self.generation == 0 and self.waits == self.at:
            self.generation = 1
            if self.member == 1:
                raise membership.MembershipChanged(self.latest(), ())


SCENARIOS = {  # the wait rank 1 gives up, inner steps, mixing, a sync() to evaluate and 6 steps more
    "the start": (3, 12, 0.0, False),
    "a mid-run exchange": (6, 12, 0.0, False),
    "the last scheduled exchange": (10, 12, 0.0, False),
    "sync()'s own exchange, with mixing": (10, 11, 0.5, False),
    "the exchange before a sync() to evaluate": (10, 12, 0.0, True),
    "the agreement of a sync() to evaluate": (12, 12, 0.0, True),
    "the agreement of the last sync()": (12, 12, 0.0, False),
}


def _diloco_with_a_lopsided_exchange(scenario: str, lopsided: bool) -> tuple[list[torch.Tensor], dict]:
    at, steps, mixing, evaluate = SCENARIOS[scenario]
    was = membership._membership
    membership._membership = flaky = _Flaky(at if lopsided else None)
    try:
        torch.manual_seed(dist.get_rank())  # each rank its own start: the first one's must reach the others
        model = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.BatchNorm1d(3))
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        diloco = ddpkit.DiLoCo(model, sync_every=3, mixing=mixing)  # outer Nesterov: its momentum must travel
        for step in range(steps + (6 if evaluate else 0)):
            if evaluate and step == steps:
                diloco.sync()
            g = torch.Generator().manual_seed(10 * step + dist.get_rank())
            inner.zero_grad()
            model(torch.randn(4, 6, generator=g)).square().mean().backward()
            inner.step()
            diloco.step(samples=4)
        diloco.sync()
        diloco.agree()  # as ddpkit train ends
        return [t.detach().clone() for t in model.state_dict().values()], {
            "samples": diloco.samples, "outer_steps": diloco.syncs, "changes": diloco.changes,
            "momentum": [s["momentum_buffer"].clone() for s in diloco.outer.state.values()], "waits": flaky.waits}
    finally:
        membership._membership = was


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_rank_behind_takes_the_global_model_and_the_outer_state_from_the_rank_ahead(dist2, scenario) -> None:
    straight = dist2.run(_diloco_with_a_lopsided_exchange, scenario, False)
    lopsided = dist2.run(_diloco_with_a_lopsided_exchange, scenario, True)
    for rank, ((got, info), (want, plain)) in enumerate(zip(lopsided, straight)):
        # A rank that never started takes the first one's buffers as they are when it gets them (one batch on).
        kept = (0, 1) if scenario == "the start" and rank == 1 else range(len(want))  # Linear's weight and bias
        assert all(torch.equal(got[i], want[i]) for i in kept)
        assert all(torch.equal(a, b) for a, b in zip(info["momentum"], plain["momentum"]))
        assert info["samples"] == plain["samples"] and info["outer_steps"] == plain["outer_steps"]
    assert straight[0][1]["samples"] == 2 * 4 * (SCENARIOS[scenario][1] + (6 if SCENARIOS[scenario][3] else 0))
    assert lopsided[0][1]["waits"] > SCENARIOS[scenario][0]  # the fault came
    if "agreement" not in scenario and scenario != "the start":  # (an agreement's end, or the start's, moves
        assert [c["took_state"] for c in lopsided[1][1]["changes"]] == [True]  # no state: the counts were equal)
    assert lopsided[0][1]["changes"] == []  # ahead: nothing lost, nothing taken

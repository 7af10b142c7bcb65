"""``comm="auto"`` (ddpkit.comm.auto): specs, the cost model, the decision's phases, the decision on real ranks
(gloo and MPI), pinned specs against the hooks registered by hand, and ``ddpkit train --comm-hook auto``."""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from procs import ROOT, base_env, script
from torch import nn

import ddpkit
from ddpkit.bench.sections.links.testbed import Testbed
from ddpkit.comm import auto
from ddpkit.comm.auto import MOVES, AutoComm, Phase
from ddpkit.comm.link_model import PROBE_LIMIT_S, Link, fit_link, predict
from ddpkit.comm.schemes import CANDIDATE_SPECS, Scheme, parse_comm, parse_scheme
from ddpkit.runtime.options import ConfigError
from ddpkit.train.train_config import TrainConfig


@pytest.mark.parametrize("spec,expected", [
    ("none", Scheme("none")), ("fp16", Scheme("fp16")), ("bf16", Scheme("bf16")),
    ("powersgd:4", Scheme("powersgd", 4)), (" powersgd:12 ", Scheme("powersgd", 12)),
    ("auto", tuple(parse_scheme(s) for s in CANDIDATE_SPECS)),
    ("auto:fp16,powersgd:2", (Scheme("fp16"), Scheme("powersgd", 2))),
    ("auto:none,fp16,fp16", (Scheme("fp16"),)),  # the exact all-reduce is always a candidate; repeats once
])
def test_specs_read_as_written(spec, expected):
    assert parse_comm(spec) == expected


@pytest.mark.parametrize("spec,match", [
    ("fast", "'fast' is not a reduction: use none, fp16, bf16 or powersgd:R"),
    ("powersgd", "PowerSGD needs its rank"), ("powersgd:0", "PowerSGD needs its rank"),
    ("powersgd:x", "PowerSGD needs its rank"), ("powersgd:\u00b2", "PowerSGD needs its rank"),
    ("fp16:2", "fp16 takes no ':2'"), ("fp16:", "fp16 takes no ':'"), ("none:", "none takes no ':'"),
    ("auto:", "list the candidates after 'auto:'"), ("auto:zip", "'zip' is not a reduction"), ("", "give 'auto'"),
    ("auto:none", "leaves nothing to choose"), ("auto:auto", "list reductions .*, not 'auto'"), (None, "give 'auto'"),
])
def test_a_bad_spec_is_refused_naming_it_and_the_fix(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_comm(spec)


MLP = [[torch.Size([4096, 2048]), torch.Size([4096])], [torch.Size([2048, 4096]), torch.Size([2048])]]
"""Two buckets of a 16 M-parameter MLP."""


def _link(bytes_per_s: float, latency_s: float = 100e-6) -> Link:
    return Link(latency_s=latency_s, seconds_per_byte=1 / bytes_per_s, flops_per_s=20e9, world=2)


def test_the_cost_model_follows_the_link():
    slow, fast = _link(12.5e6), _link(10e9)  # 100 Mbit/s; 80 Gbit/s
    at = {spec: predict(parse_scheme(spec), slow, MLP) for spec in ("none", "fp16", "bf16", "powersgd:1",
                                                                  "powersgd:4", "powersgd:8")}
    assert at["powersgd:1"] < at["powersgd:4"] < at["powersgd:8"] < at["fp16"] == at["bf16"] < at["none"]
    assert at["fp16"] == pytest.approx(at["none"] / 2, rel=1e-3)  # half the bytes, latency aside
    assert at["none"] == pytest.approx(2 * 100e-6 + 4 * sum(s.numel() for b in MLP for s in b) / 12.5e6)
    # on a fast link PowerSGD's products cost more than the bytes they save
    assert predict(Scheme("powersgd", 4), fast, MLP) > predict(Scheme("none"), fast, MLP)
    # a vector is never compressed: PowerSGD sends it whole, with two more collectives' latency per bucket
    only_vectors = [[torch.Size([1000])]]
    assert predict(Scheme("powersgd", 1), slow, only_vectors) == pytest.approx(
        predict(Scheme("none"), slow, only_vectors) + 2 * 100e-6)


def _probe_times(per_byte: float, latency: float, sizes: list[int]) -> list[float]:
    return [latency + size * per_byte for size in sizes]


def test_the_probes_fit_finds_the_links_rate_and_latency():
    sizes = [4096 * 4**k for k in range(6)]  # 4 KiB to 4 MiB, as a 100 Mbit/s link's probe stops
    times = _probe_times(1 / 12.5e6, 300e-6, sizes)
    latency, per_byte = fit_link(sizes, times, times)
    assert latency == pytest.approx(300e-6 + 4096 / 12.5e6) and per_byte == pytest.approx(1 / 12.5e6, rel=1e-3)


def test_one_lengthened_median_does_not_make_a_slow_link_look_fast():
    # A 100 Mbit/s probe whose 1 MiB median a retransmission lengthened to just under the probe's limit (0.084 s
    # in truth; at the limit the probe would have stopped there): the slope over 1 and 4 MiB alone is a third of
    # the rate, the largest message says it; one lengthened 4 MiB median makes the link look slower.
    sizes = [4096 * 4**k for k in range(6)]
    times = _probe_times(1 / 12.5e6, 300e-6, sizes)
    times[4] = PROBE_LIMIT_S - 0.01
    assert (times[5] - times[4]) / (sizes[5] - sizes[4]) < 0.5 / 12.5e6  # the slope alone
    _, per_byte = fit_link(sizes, times, times)
    assert per_byte == pytest.approx(1 / 12.5e6, rel=0.01)
    times = _probe_times(1 / 12.5e6, 300e-6, sizes)
    times[5] *= 1.5
    assert 1 / 12.5e6 < fit_link(sizes, times, times)[1] < 2 / 12.5e6


def _probed_sizes(most_bytes: int | None, auto_comm: bool = False) -> list[int]:
    """The all-reduce sizes a probe times (its 64 MiB ones taken as slow: loopback's speed varies), directly or as
    AutoComm's default probe of :func:`_decide`'s model (buckets of 0.1 MB)."""
    from ddpkit.comm import link_model

    sizes: list[int] = []
    real = link_model._timed_all_reduces

    def timed(group, device, nbytes, reps):
        sizes.append(nbytes)
        return [1.0 if nbytes >= 64 << 20 else 1e-3 + nbytes / 1e9] * reps

    link_model._timed_all_reduces = timed
    try:
        if auto_comm:
            _decide(40, False)
        else:
            link_model.probe_link(most_bytes=most_bytes)
    finally:
        link_model._timed_all_reduces = real
    return sizes


def test_the_probe_stops_at_the_largest_message_that_matters(dist2):
    whole = [4096 * 4**k for k in range(8)]  # 4 KiB to 64 MiB
    assert dist2.run(_probed_sizes, None)[0] == whole
    assert dist2.run(_probed_sizes, 100)[0] == whole[:6]  # 4 MiB at least: two sizes from 1 MiB for the slope
    assert dist2.run(_probed_sizes, 5 << 20)[0] == whole[:7]  # the first that reaches it
    assert dist2.run(_probed_sizes, None, True)[0] == whole[:6]  # AutoComm: its buckets of 0.1 MB


def test_a_probe_the_fit_cannot_read_is_refused():
    with pytest.raises(ValueError, match="one of each per size"):
        fit_link([4096, 1 << 20], [0.1], [0.1])
    with pytest.raises(ValueError, match="the first 64 KiB or less"):
        fit_link([1 << 20], [0.1], [0.1])
    with pytest.raises(ValueError, match="positive and growing"):
        fit_link([4096, 4096], [0.1, 0.1], [0.1, 0.1])
    with pytest.raises(ValueError, match="positive and growing"):
        fit_link([0, 4096], [0.1, 0.1], [0.1, 0.1])


@pytest.mark.parametrize("now,to", [(a, b) for a in Phase for b in Phase if b not in MOVES[a]])
def test_a_move_the_table_does_not_list_raises(now, to):
    state = AutoComm()
    state.phase = now
    with pytest.raises(RuntimeError, match=f"comm auto has no move from {now.value} to {to.value}"):
        state._move(to)


@pytest.mark.parametrize("kwargs,match", [
    ({"start": 2}, "start=2"), ({"start": 3.5}, "start=3.5"), ({"trial": 61}, "trial=61: a whole number from 4 to 60"),
    ({"trial": 3}, "trial=3"), ({"tries": 0}, "tries=0"),
    ({"tries": 2.5}, "tries=2.5"), ({"drift": 1.0}, "drift=1.0"), ({"drift": True}, "drift=True"),
    ({"candidates": [Scheme("powersgd", 0)]}, "PowerSGD needs a whole rank"), ({"candidates": [Scheme("zip")]},
                                                                               "not a reduction"),
    ({"candidates": [Scheme("fp16", 2)]}, "only powersgd has a rank"), ({"budget_s": 0}, "budget_s=0"),
    ({"guard": 0}, "guard=0: a relative change"), ({"guard": True}, "guard=True"), ({"guard": 1.0}, "between 0 and 1"),
])
def test_bad_settings_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoComm(**kwargs)


def test_a_candidate_that_is_not_a_scheme_is_refused_at_once():
    with pytest.raises(TypeError, match="'fp16' is not a Scheme: give parse_scheme"):
        AutoComm(candidates=["fp16"])


def test_auto_with_deterministic_is_refused_naming_the_flags_that_pin_it():
    for hook in ("auto", "auto:fp16"):
        with pytest.raises(ConfigError, match="pin the choice"):
            TrainConfig(comm_hook=hook, deterministic=True)


def test_the_training_commands_auto_takes_a_list_of_candidates_and_refuses_a_bad_one():
    assert TrainConfig(comm_hook="auto:bf16,powersgd:4,powersgd:8").comm_hook == "auto:bf16,powersgd:4,powersgd:8"
    with pytest.raises(ConfigError, match="--comm-hook 'auto:zip': 'zip' is not a reduction"):
        TrainConfig(comm_hook="auto:zip")
    with pytest.raises(ConfigError, match="--comm-hook 'fast' is not a comm hook: .*, or auto:LIST"):
        TrainConfig(comm_hook="fast")
    with pytest.raises(ConfigError, match="lists PowerSGD, whose collectives torch's DDP"):
        TrainConfig(comm_hook="auto:fp16,powersgd:4", engine="torch")


# ---------------------------------------------------------------- on real ranks


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def _slow_link(group, device) -> Link:
    return Link(latency_s=1e-4, seconds_per_byte=1 / 12.5e6, flops_per_s=1e9, world=2)


def _dial_up_link(group, device) -> Link:
    """1 MB/s: the exact reduction is most of the step, PowerSGD's a small part of it."""
    return Link(latency_s=1e-4, seconds_per_byte=1 / 1e6, flops_per_s=1e9, world=2)


def _instant_link(group, device) -> Link:
    """A link whose reductions take no time: no candidate can shorten the step."""
    return Link(latency_s=0.0, seconds_per_byte=1e-15, flops_per_s=1e9, world=2)


def _decide(steps: int, slow: bool | str, accumulate: int = 1, run_steps: int | None = None) -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    net = _Net()
    model = ddpkit.DDP(net, bucket_cap_mb=0.1)
    lines: list[str] = []
    # drift=None: a loaded machine's step times may double after the decision and re-open it (drift has tests of
    # its own); here the one decision is the subject.
    probe = {False: None, True: _slow_link, "instant": _instant_link, "dial-up": _dial_up_link}[slow]
    state = AutoComm(say=lines.append, probe=probe, start=4, trial=6, drift=None, run_steps=run_steps)
    model.register_comm_hook(state, auto.auto_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        for k in range(accumulate):
            x, y = torch.randn(16, 64, generator=g), torch.randint(0, 4, (16,), generator=g)
            if k < accumulate - 1:
                with model.no_sync():
                    F.cross_entropy(model(x), y).backward()
            else:
                F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            model(x)  # a forward without a backward between steps changes nothing
        opt.step()
        opt.zero_grad()
    [d] = state.decisions
    return {"lines": lines, "chosen": d["chosen"], "step": d["step"], "tried": sorted(d["tried_s"]),
            "predicted": d["predicted_s"], "phase": state.phase.name, "steps": state.steps,
            "weights": [p.detach().clone() for p in net.parameters()]}


@pytest.mark.parametrize("slow", [False, True], ids=["probed", "a slow link"])
def test_every_rank_takes_the_same_decision_once_and_rank_0_says_it(dist2, slow):
    out = dist2.run(_decide, 32, slow, accumulate=2)
    zero, one = out
    assert zero["chosen"] == one["chosen"] and zero["step"] == one["step"] and zero["tried"] == one["tried"]
    assert zero["phase"] == one["phase"] == "DECIDED" and zero["steps"] == one["steps"] == 32
    assert all(torch.equal(a, b) for a, b in zip(zero["weights"], one["weights"]))  # one model on every rank
    assert len(zero["lines"]) == 1 and one["lines"] == []
    line = zero["lines"][0]
    assert line.startswith(f"comm auto at step {zero['step']}: measured all-reduce ")
    assert f"chose {zero['chosen']} (" in line and line.endswith(f"pin it with comm={zero['chosen']!r}")
    assert zero["tried"] == _expected_trials(zero["predicted"])
    # PowerSGD's ranks below 16 only when listed (a language model's loss pays for them): never predicted unasked
    assert sorted(zero["predicted"]) == ["bf16", "fp16", "none", "powersgd:16", "powersgd:32"]
    if slow:  # at 100 Mbit/s PowerSGD is predicted to pay: it is tried, after the exact all-reduce's own trial
        assert len(zero["tried"]) > 1 and zero["step"] == 4 + 1 + 6 * len(zero["tried"])
        assert "tried none " in line


def test_a_runs_length_bounds_its_trials_to_2_percent_of_its_steps(dist2):
    # 500 steps leave 10 for trials: at 100 Mbit/s three candidates are predicted to pay; the two best are tried,
    # 5 steps each (4 at least), and the exact all-reduce's start stands for its own trial (it would take 4 more)
    zero, one = dist2.run(_decide, 20, True, run_steps=500)
    assert zero["chosen"] == one["chosen"] and zero["step"] == one["step"] == 4 + 1 + 10
    expected = _expected_trials(zero["predicted"])
    assert len(expected) == 4 and zero["tried"] == sorted(["none", *[s for s in _ranked(zero["predicted"])][:2]])
    assert "tried none " in zero["lines"][0]


def test_a_run_too_short_for_a_trial_takes_the_prediction_only_where_it_leaves_no_doubt(dist2):
    # 150 steps leave 3 for trials, fewer than one trial's 4: nothing is tried; at 1 MB/s PowerSGD is predicted to
    # take a fraction of the exact step and is chosen at once; where the link costs nothing, nothing is
    zero, one = dist2.run(_decide, 12, "dial-up", run_steps=150)
    assert zero["chosen"] == one["chosen"] and zero["step"] == one["step"] == 4 + 1 and zero["tried"] == []
    best = _ranked(zero["predicted"])[0]
    assert zero["chosen"] == best, (zero["predicted"], zero["lines"])
    assert zero["predicted"][best] <= auto.UNTRIED * zero["predicted"]["none"]
    line = zero["lines"][0]
    assert "nothing tried (3 steps for trials, 2% of the run's: fewer than a trial's 4)" in line, line
    assert f"chose {best} (predicted to take at most 0.5 of the exact step)" in line, line
    instant = dist2.run(_decide, 12, "instant", run_steps=150)[0]
    assert instant["chosen"] == "none" and instant["tried"] == [] and instant["step"] == 5
    assert "no candidate was predicted to take at most 0.5 of the exact step" in instant["lines"][0]


def _kilobyte_link(group, device) -> Link:
    """800 KB/s: two 100 x 100 buckets (80 KB) in 100 ms exactly, with PowerSGD at rank 16 in about a third."""
    return Link(latency_s=0.0, seconds_per_byte=1 / 0.8e6, flops_per_s=1e9, world=2)


def test_a_choice_made_on_its_prediction_takes_its_own_steps_as_the_baseline(dist2):
    # 150 steps: no trial; PowerSGD predicted at a third of the exact 100 ms step and chosen untried; its steps take
    # 80 ms, more than twice the prediction: that is the prediction's error, not a drift of the link, so the
    # decision stands (it was re-opened at every look, deciding the same again and again)
    out = dist2.run(_drive, ["powersgd:16"], "powersgd a little faster", 120, link=_kilobyte_link,
                    shape=(100, 100), run_steps=150)
    zero, one = out
    assert zero["decisions"] == one["decisions"] and zero["used"] == one["used"]
    [decision] = zero["decisions"]
    assert decision["step"] == 11 and decision["chosen"] == "powersgd:16" and decision["tried_s"] == {}
    assert 2 * decision["predicted_s"]["powersgd:16"] < 0.08
    assert zero["used"] == ["none"] * 10 + ["powersgd:16"] * 110
    assert not any("deciding again" in line for line in zero["lines"]), zero["lines"]


def test_a_choice_made_on_its_prediction_that_does_not_pay_gives_way_to_the_exact_all_reduce(dist2):
    # the same prediction, but PowerSGD's steps take 300 ms against the exact 100: at the drift's first look (25
    # steps after the choice) the exact all-reduce comes back, as a decision of its own, said once
    zero, one = dist2.run(_drive, ["powersgd:16"], "powersgd slower", 80, link=_kilobyte_link, shape=(100, 100),
                          run_steps=150)
    assert zero["decisions"] == one["decisions"] and zero["used"] == one["used"]
    first, second = zero["decisions"]
    assert first["chosen"] == "powersgd:16" and first["step"] == 11
    assert second["chosen"] == "none" and second["step"] == 35
    assert second["tried_s"] == {"none": pytest.approx(0.1), "powersgd:16": pytest.approx(0.3)}
    assert zero["used"] == ["none"] * 10 + ["powersgd:16"] * 24 + ["none"] * 46
    assert sum("chosen on its prediction, takes 300.0 ms a step" in line for line in zero["lines"]) == 1


def _uneven_run_lengths() -> dict:
    import torch.distributed as dist

    return _drive(["fp16"], "by step", 14, budget_s=1000, run_steps=150 if dist.get_rank() == 0 else 600)


def test_ranks_given_other_run_lengths_take_the_fewest_trial_steps(dist2):
    # rank 0 is told 150 steps (no trial), rank 1 600 (12 for trials): every rank takes rank 0's, at the same steps
    zero, one = dist2.run(_uneven_run_lengths)
    assert zero["used"] == one["used"] == ["none"] * 14 and zero["decisions"] == one["decisions"]
    assert zero["decisions"][0]["step"] == 11 and zero["decisions"][0]["tried_s"] == {}


def test_the_trials_of_a_bounded_run_take_the_steps_they_say(dist2):
    # 512 steps: 10 for trials; fp16 alone pays, so the exact all-reduce is tried again as well: 5 steps each
    # (steps 11-15 and 16-20), decided at step 21
    out = dist2.run(_drive, ["fp16"], "by step", 24, budget_s=1000, run_steps=512)
    used, [decision] = out[0]["used"], out[0]["decisions"]
    assert used == ["none"] * 15 + ["fp16"] * 5 + ["none"] * 4 and decision["step"] == 21
    assert out[0]["decisions"] == out[1]["decisions"]


def _ranked(predicted: dict[str, float]) -> list[str]:
    """The candidates by predicted step, the less lossy first among equals (one half precision)."""
    ranked = sorted((s for s in predicted if s != "none"), key=lambda s: (predicted[s], parse_scheme(s).lossiness))
    return [s for i, s in enumerate(ranked) if not (s in ("fp16", "bf16") and {"fp16", "bf16"} & set(ranked[:i]))]


def _expected_trials(predicted: dict[str, float]) -> list[str]:
    """The exact all-reduce, and the three best-predicted of the candidates predicted to make the step 5 % shorter
    (one half precision: fp16's and bf16's bytes are the same); only the exact all-reduce when none is."""
    pays = sorted((s for s, p in predicted.items() if s != "none" and p <= 0.95 * predicted["none"]),
                  key=lambda s: (predicted[s], parse_scheme(s).lossiness))
    tried: list[str] = []
    for spec in pays:
        if len(tried) < 3 and not (spec in ("fp16", "bf16") and {"fp16", "bf16"} & set(tried)):
            tried.append(spec)
    return sorted(["none", *tried]) if tried else []


def _train(model: nn.Module, net: nn.Module, steps: int) -> list[torch.Tensor]:
    """``steps`` SGD steps of ``model`` (a DDP of ``net``) on this rank's random batches; ``net``'s weights."""
    import torch.distributed as dist

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 4, (16,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def _pinned(spec: str, steps: int) -> list[list[torch.Tensor]]:
    from ddpkit.hooks import (
        PowerSGDState,
        bf16_compress_hook,
        fp16_compress_hook,
        powersgd_hook,
    )

    out = []
    torch.manual_seed(0)
    base = _Net()
    for way in ("comm", "by hand"):
        net = copy.deepcopy(base)
        if way == "comm":
            model = ddpkit.DDP(net, bucket_cap_mb=0.1, comm=spec)
            assert spec != "none" or model.reducer.comm_hook is None  # none: DDP's own reduction, no hook
        else:
            model = ddpkit.DDP(net, bucket_cap_mb=0.1)
            if spec.startswith("powersgd"):
                model.register_comm_hook(PowerSGDState(None, int(spec.split(":")[1]), start_powerSGD_iter=10),
                                         powersgd_hook)
            elif spec != "none":
                model.register_comm_hook(None, {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}[spec])
        out.append(_train(model, net, steps))
    return out


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "powersgd:2"])
def test_a_pinned_spec_trains_the_bits_of_its_hook_registered_by_hand(dist2, spec):  # none: of no hook
    for mine, by_hand in dist2.run(_pinned, spec, 14):
        assert all(torch.equal(a, b) for a, b in zip(mine, by_hand))


class _Bucket:
    """A bucket as a comm hook sees it (index, last, buffer, parameters), for driving AutoComm step by step."""

    def __init__(self, index: int, count: int, numel: int = 64, value: float = 1.0,
                 shape: tuple[int, int] | None = None) -> None:
        # shape: a real parameter's (the buffer its size; PowerSGD can then reduce it), else 1000 x 1000 to the cost
        # model alone
        self._index, self._count, self._shape = index, count, shape
        self._buffer = torch.full((shape[0] * shape[1] if shape else numel,), value)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        assert self._shape is not None
        return [self._buffer.view(self._shape)]

    def parameters(self) -> list[torch.Tensor]:
        if self._shape is not None:
            return [torch.empty(*self._shape)]
        return [torch.empty(1000, 1000, device="meta")]  # 4 MB a bucket to the cost model (its shape alone)


def _fake_link(group, device) -> Link:
    """Two of :class:`_Bucket`'s 4 MB in 40 ms: exactly, 40 ms of a step; in half precision, 20."""
    return Link(latency_s=0.0, seconds_per_byte=1 / 200e6, flops_per_s=1e9, world=2)


def _crawling_link(group, device) -> Link:
    """Two of :class:`_Bucket`'s 4 MB in 8 s."""
    return Link(latency_s=0.0, seconds_per_byte=1 / 1e6, flops_per_s=1e9, world=2)


class _Clock:
    """A step's time set by the test: ``auto.time`` while :func:`_drive` runs (the same on every rank)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _drive(candidates: list[str], period: str, steps: int, link: Callable = _fake_link, late: float = 0.0,
           grads: str = "steady", shape: tuple[int, int] | None = None, **kwargs) -> dict:
    """Run AutoComm for ``steps`` steps of two buckets with the step times of :data:`PERIODS` [``period``] and the
    gradients of :data:`GRADS` [``grads``]; what scheme each step used and what was said. ``late``: rank 1's first
    step starts that many seconds after rank 0's (its clock is ahead by that much from its second step on)."""
    import torch.distributed as dist

    clock, real = _Clock(), auto.time
    auto.time = clock
    lines: list[str] = []
    try:
        state = AutoComm(candidates=[parse_scheme(c) for c in candidates], probe=link, say=lines.append,
                         **kwargs)
        used = []
        for step in range(1, steps + 1):
            for index in range(2):
                state.reduce(_Bucket(index, 2, value=GRADS[grads](step), shape=shape)).wait()
            used.append(state.scheme.spec)
            clock.now += PERIODS[period](step, used[-1]) + (late if step == 1 and dist.get_rank() == 1 else 0.0)
    finally:
        auto.time = real
    return {"used": used, "lines": lines, "guards": state.guards,
            "decisions": [{k: d[k] for k in ("step", "chosen", "tried_s", "predicted_s")} for d in state.decisions]}


PERIODS = {
    "by step": lambda step, spec: (100 + step if spec == "none" else 1000 + step) / 1e3,
    "warm start": lambda step, spec: 0.060 if step <= 10 else 0.050,
    "doubles at 30": lambda step, spec: (0.1 if spec == "none" else 0.05) * (2 if step >= 30 else 1),
    "crawling": lambda step, spec: 8.7 if spec == "none" else 4.4,
    "halves": lambda step, spec: 0.1 if spec == "none" else 0.05,
    "slows after the start": lambda step, spec: 0.01 if step <= 10 else (8.7 if spec == "none" else 4.4),
    "powersgd a little faster": lambda step, spec: 0.1 if spec == "none" else 0.08,
    "powersgd slower": lambda step, spec: 0.1 if spec == "none" else 0.3,
}
"""Step times (seconds) by step and scheme: each a case of :func:`test_the_phases_take_the_steps_they_say`."""


GRADS = {
    "steady": lambda step: 1.0,
    "jumps at 60": lambda step: 1.0 if step < 60 else 4.0,
    "rank's nan at 73": lambda step: math.nan if step == 73 and torch.distributed.get_rank() == 1 else 1.0,
    "halves at 60": lambda step: 1.0 if step < 60 else 0.5,
    "rank 1 joins at 60": lambda step: 0.0 if step >= 60 and torch.distributed.get_rank() == 1 else 1.0,
}
"""Each bucket's gradient (every element) by step."""


def test_the_phases_take_the_steps_they_say(dist2):
    # start 10, trial 8: exact steps 1-10; the exact all-reduce tried on steps 11-18, fp16 on 19-26, each timed
    # from its second step; decided at step 27.
    out = dist2.run(_drive, ["fp16"], "by step", 30, budget_s=1000)  # the budget aside (the next test's)
    assert out[0]["used"] == out[1]["used"] and out[0]["decisions"] == out[1]["decisions"] and not out[1]["lines"]
    used, [decision] = out[0]["used"], out[0]["decisions"]
    assert used == ["none"] * 18 + ["fp16"] * 8 + ["none"] * 4 and decision["step"] == 27
    assert decision["tried_s"] == {"none": pytest.approx((100 + 15) / 1e3), "fp16": pytest.approx(1.023)}
    assert decision["chosen"] == "none"  # fp16's steps took a second


def test_where_steps_take_seconds_the_decision_keeps_to_its_budget(dist2):
    # exact steps of 8.7 s: the start ends after 3 (its 10 s fit 2 of them; 3 at least), the exact all-reduce is
    # not tried again (8 steps would take 70 s), fp16's trial ends after 4 (its 10 s fit 3 of 4.4 s; 4 at least)
    out = dist2.run(_drive, ["fp16"], "crawling", 12, link=_crawling_link)[0]
    [decision] = out["decisions"]
    assert out["used"] == ["none"] * 3 + ["fp16"] * 9 and decision["step"] == 8
    assert decision["tried_s"] == {"none": pytest.approx(8.7), "fp16": pytest.approx(4.4)}
    assert decision["chosen"] == "fp16"


def test_a_link_that_slowed_during_the_start_still_gets_its_trials(dist2):
    # exact steps of 10 ms, then the link slows (8.7 s exact, 4.4 s in half precision) before the probe, which
    # measures 8 s of exact reduction a step: the measures disagree, and fp16 keeps its predicted saving (taking
    # its 4 s of reduction as its step, it was predicted slower than the start's 10 ms, and nothing was tried)
    out = dist2.run(_drive, ["fp16"], "slows after the start", 24, link=_crawling_link)[0]
    [decision] = out["decisions"]
    assert decision["predicted_s"]["fp16"] == pytest.approx(0.01 * 4 / 8)  # the start's step, halved
    assert set(decision["tried_s"]) == {"none", "fp16"} and decision["chosen"] == "fp16"
    assert decision["tried_s"]["none"] == pytest.approx(8.7) and decision["tried_s"]["fp16"] == pytest.approx(4.4)


def test_a_rank_that_starts_late_takes_the_same_steps_as_the_others(dist2):
    # rank 1's first step is 5 s longer (its data loader, say): its clock counts the phases' time apart from rank
    # 0's, and yet both end each phase at the same step (a phase's length comes from the all-reduced second step)
    zero, one = dist2.run(_drive, ["fp16"], "crawling", 12, link=_crawling_link, late=5.0)
    assert zero["used"] == one["used"] == ["none"] * 3 + ["fp16"] * 9
    assert zero["decisions"] == one["decisions"]


def test_a_slow_warm_start_does_not_make_a_lossy_scheme_win(dist2):
    # steps 1-10 take 60 ms, every later one 50 ms whatever the scheme: the exact all-reduce's own trial says so
    [decision] = dist2.run(_drive, ["fp16"], "warm start", 30)[0]["decisions"]
    assert decision["tried_s"]["none"] == pytest.approx(0.05) and decision["chosen"] == "none"


def test_a_step_that_doubles_soon_after_the_decision_reopens_it_within_50_steps(dist2):
    out = dist2.run(_drive, ["fp16"], "doubles at 30", 120)[0]
    first, second = out["decisions"][:2]
    assert first["chosen"] == "fp16" and first["step"] == 27  # 50 ms against 100
    assert any("(2.00x) under fp16: deciding again" in line for line in out["lines"])
    reopened = next(i + 1 for i, spec in enumerate(out["used"]) if i + 1 > first["step"] and spec == "none")
    assert reopened - 30 <= 50 and second["step"] > reopened


def test_the_guard_hands_a_window_to_the_exact_all_reduce_when_the_gradient_jumps(dist2):
    # fp16 chosen at step 27 (50 ms against 100), its steps counted from 1 there; the guard looks at its 25th,
    # 50th, ... step, at the norms of the four steps before: steps 47-50 set the first norm, steps 72-75 (after
    # the jump at 60, four times it) hand steps 76-99 to the exact all-reduce (counted from 1 again), and steps
    # 96-99 (unchanged since) give fp16 back at step 100.
    out = dist2.run(_drive, ["fp16"], "halves", 130, grads="jumps at 60")
    assert out[1] == out[0] | {"lines": []}  # the same steps on both ranks; rank 0 says it
    used = out[0]["used"]
    assert out[0]["decisions"][0]["step"] == 27 and set(used[26:75]) == {"fp16"}
    assert set(used[75:99]) == {"none"} and set(used[99:]) == {"fp16"}
    assert [(g["step"], g["action"]) for g in out[0]["guards"]] == [(76, "exact"), (100, "fp16")]
    assert out[0]["guards"][0]["norm"] == pytest.approx(4 * out[0]["guards"][0]["before"])
    said = [line for line in out[0]["lines"] if "gradient's norm" in line]
    assert "(+300%) in 25 steps: the exact all-reduce until it settles (a look every 25 steps), then fp16" in said[0]
    assert said[1].endswith(": fp16 again")


def test_the_guard_sees_a_fall_as_a_fall(dist2):
    out = dist2.run(_drive, ["fp16"], "halves", 130, grads="halves at 60")[0]
    assert [(g["step"], g["action"]) for g in out["guards"]] == [(76, "exact"), (100, "fp16")]
    assert any("(-50%) in 25 steps" in line for line in out["lines"])


@pytest.mark.parametrize("grads,guard", [("steady", 0.5), ("jumps at 60", None), ("rank's nan at 73", 0.5),
                                         ("rank 1 joins at 60", 0.5)])
def test_the_guard_leaves_a_steady_gradient_a_skipped_step_a_joined_rank_and_guard_none_alone(dist2, grads, guard):
    # a joined rank's shadow buckets are zeros: not counted in the average, which would halve
    out = dist2.run(_drive, ["fp16"], "halves", 130, grads=grads, guard=guard)[0]
    assert out["guards"] == [] and set(out["used"][26:]) == {"fp16"}


def test_the_guard_does_not_measure_an_exact_choice(dist2):
    out = dist2.run(_drive, ["fp16"], "by step", 130, grads="jumps at 60")[0]  # the exact all-reduce wins
    assert out["decisions"][0]["chosen"] == "none" and out["guards"] == [] and set(out["used"][26:]) == {"none"}


def _feedback() -> float:
    """A constant gradient G, a PowerSGD trial that loses (its steps timed slower), then the exact all-reduce: the
    weights must end where exact steps all along put them (PowerSGD's error fed back, not dropped)."""
    clock, real = _Clock(), auto.time
    auto.time = clock
    try:
        torch.manual_seed(0)
        net = nn.Linear(64, 64, bias=False)
        start, g = net.weight.detach().clone(), torch.randn(64, 64)
        model = ddpkit.DDP(net)
        state = AutoComm(candidates=[Scheme("powersgd", 1)], probe=_slow_link, say=lambda line: None, start=3,
                         trial=6, drift=None)
        model.register_comm_hook(state, auto.auto_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        steps = 25
        for _ in range(steps):
            model(torch.ones(1, 64))
            (model.module.weight * g).sum().backward()
            opt.step()
            opt.zero_grad()
            clock.now += 0.02 if state.scheme.name == "powersgd" else 0.01
        assert [d["chosen"] for d in state.decisions] == ["none"] and "powersgd:1" in state.decisions[0]["tried_s"]
        return (net.weight.detach() - (start - 0.01 * steps * g)).abs().max().item()
    finally:
        auto.time = real


def test_powersgds_error_is_fed_back_when_the_scheme_changes(dist2):
    assert max(dist2.run(_feedback)) < 1e-4  # float32 rounding of 25 steps; a dropped error is ~0.1 here


def _exact_start(steps: int) -> list[list[torch.Tensor]]:
    out = []
    torch.manual_seed(0)
    base = _Net()
    for comm in ("auto", None):
        net = copy.deepcopy(base)
        model = ddpkit.DDP(net, bucket_cap_mb=0.1, comm=comm)
        out.append(_train(model, net, steps))
    return out


def test_the_exact_start_trains_the_bits_of_ddp_without_a_hook_at_world_3(dist3):
    # 1/3 is not a power of two: dividing before the sum (torch's allreduce_hook) rounds apart from DDP's own
    # multiplying by 1/3; the exact start multiplies, as DDP
    for mine, plain in dist3.run(_exact_start, 8):
        assert all(torch.equal(a, b) for a, b in zip(mine, plain))


def _join(comm: str) -> tuple[list[int], str]:
    import torch.distributed as dist

    torch.manual_seed(0)
    if comm == "auto":  # PowerSGD predicted to pay: the exact all-reduce and PowerSGD tried, decided at step 13
        model = ddpkit.DDP(_Net())
        state = AutoComm(candidates=[Scheme("powersgd", 1)], probe=_slow_link, start=4, trial=4,
                         say=lambda line: None)
        model.register_comm_hook(state, auto.auto_hook)
    else:
        model = ddpkit.DDP(_Net(), comm=comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with model.join():
        for _ in range(20 if dist.get_rank() == 0 else 8):  # rank 1 runs out first and shadows the rest
            F.cross_entropy(model(torch.randn(8, 64)), torch.randint(0, 4, (8,))).backward()
            opt.step()
            opt.zero_grad()
    if comm != "auto":
        return [], "pinned"
    return [d["step"] for d in state.decisions], state.phase.name


def test_join_with_uneven_inputs_runs_under_auto(dist2):
    # rank 1 shadows steps 9-20: the trials and the decision at step 13 run there too, on both ranks alike
    zero, one = dist2.run(_join, "auto")
    assert zero == one == ([13], "DECIDED")


def test_join_with_uneven_inputs_runs_under_pinned_powersgd(dist2):
    # PowerSGD compresses from step 10, while rank 1 shadows: a shadow bucket's gradients() are its zeros' pieces
    assert dist2.run(_join, "powersgd:1") == [([], "pinned")] * 2


def _refused() -> str:
    try:
        ddpkit.DDP(_Net(), comm="auto", zero_stage=2)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_comm_with_zero_stage_2_is_refused_by_name(dist2):
    assert all("does not fit zero_stage=2" in said for said in dist2.run(_refused))


@pytest.mark.slow("an MPI pool of its own on its pytest worker: the fast tier decides on gloo; the MPI backend's "
                  "fast test is test_collectives.py's")
def test_the_decision_on_mpi_as_on_gloo(mpi2):
    zero, one = mpi2.run(_decide, 30, True)
    assert zero["chosen"] == one["chosen"] and zero["tried"] == one["tried"] == _expected_trials(zero["predicted"])
    assert len(zero["tried"]) > 1
    assert all(torch.equal(a, b) for a, b in zip(zero["weights"], one["weights"]))


def test_ddpkit_train_comm_hook_auto_says_its_choice_and_trains(tmp_path: Path):
    done = subprocess.run([sys.executable, "-m", "ddpkit", "train", "--nproc-per-node", "2", "--comm-hook", "auto",
                           "--epochs", "1", "--no-progress", "--output-dir", str(tmp_path)], cwd=ROOT,
                          env=base_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("comm auto at step")]
    assert "pin it with --comm-hook " in line
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.5


@pytest.mark.skipif(Testbed.why_not() is not None, reason=f"the testbed {Testbed.why_not()}")
@pytest.mark.slow("two testbed nodes, about 40 steps at 100 Mbit/s (0.2-0.45 s each, mostly waiting on the link)")
def test_across_nodes_a_link_slowed_to_100mbit_reopens_the_decision_and_half_precision_is_chosen(tmp_path: Path):
    # Two testbed nodes, one rank each: decided on the unshaped link, then, once the decision's baseline is taken,
    # the link is shaped to 100 Mbit/s (the exact step of this 1.3 M-parameter MLP goes from ~10-30 ms to ~0.45 s,
    # half precision's to ~0.23 s): the decision re-opens within 50 steps and half precision is chosen. The
    # candidates are fp16 and bf16: with PowerSGD among them a loaded machine may choose it on the unshaped link
    # already, whose step then barely feels the change (and nothing needs deciding again).
    import os
    import random
    import time

    env = base_env(DDPKIT_JOB_TOKEN=os.urandom(16).hex(), PAUSE_DIR=str(tmp_path), COMM="auto:fp16,bf16")
    port = random.randint(20000, 40000)
    with Testbed(2) as bed:
        procs = [subprocess.Popen(bed.command(k, [
            sys.executable, "-m", "ddpkit", "launch", "--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "1",
            "--master-addr", bed.nodes[0].address, "--master-port", str(port), script("auto_drift.py")]),
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in range(2)]
        try:
            deadline = time.monotonic() + 120
            while not (tmp_path / "decided").exists():
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no first decision"
                time.sleep(0.05)
            bed.shape("100mbit")
            (tmp_path / "changed").write_text("")
            said = [p.communicate(timeout=240)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
                p.communicate()
    assert all(p.returncode == 0 for p in procs), said[0][-3000:] + said[1][-3000:]
    found = [re.search(r"DECISIONS (\d) (\d+) (.*)", s) for s in said]
    assert all(found), said
    paused_at = int(found[0].group(2))
    decisions = json.loads(found[0].group(3))
    assert json.loads(found[1].group(3)) == decisions  # every rank: the same decisions at the same steps
    lines = "\n".join(line for line in said[0].splitlines() if "comm auto" in line)
    [second] = [d for d in decisions if d["step"] > paused_at]  # (a loaded machine may have decided twice before)
    assert second["chosen"] in ("fp16", "bf16") and second["tried_s"]["none"] > 0.2, lines
    reopened = re.findall(r"comm auto: the step went from .* ms \((\d+\.\d+)x\) under .*: deciding again", said[0])
    assert reopened and float(reopened[-1]) >= 2, lines  # the last re-opening: the change's
    # re-opened within 50 steps of the change (then the exact start and the trials)
    assert second["step"] - paused_at <= 50 + 10 + 1 + 3 * 8, lines


def _auto_run(resume_at: int | None, steps: int = 40) -> tuple[torch.Tensor, list[str], list[str]]:
    """AutoComm choosing PowerSGD (its steps timed faster on a slow link), ``steps`` steps of a gradient that
    differs by rank; with ``resume_at``, the run is saved there (its weights, the hook's state, the buckets) and
    goes on in a new model, hook and optimizer, as ``ddpkit train --resume`` does. The weights, the schemes used
    and what was said."""
    import torch.distributed as dist

    clock, real = _Clock(), auto.time
    auto.time = clock
    lines: list[str] = []
    try:
        def fresh(weights: torch.Tensor | None) -> tuple[nn.Module, nn.Module, AutoComm, torch.optim.Optimizer]:
            torch.manual_seed(0)
            net = _Net()
            if weights is not None:
                net.load_state_dict(weights)
            model = ddpkit.DDP(net)
            state = AutoComm(candidates=[Scheme("powersgd", 1)], probe=_slow_link, say=lines.append, start=3,
                             trial=6, drift=None)
            model.register_comm_hook(state, auto.auto_hook)
            return net, model, state, torch.optim.SGD(model.parameters(), lr=0.01)

        net, model, state, opt = fresh(None)
        used = []
        for step in range(steps):
            if step == resume_at:
                buckets = model.bucket_indices() if model.buckets_final else None  # as ddpkit train keeps them
                saved = (copy.deepcopy(net.state_dict()), copy.deepcopy(state.state_dict()), buckets)
                net, model, state, opt = fresh(saved[0])
                if buckets is not None:
                    model.restore_buckets(buckets)
                lines.append(state.load_state_dict(saved[1]))
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            used.append(state.scheme.spec)
            clock.now += 0.01 if state.scheme.name == "powersgd" else 0.02
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()]), used, lines
    finally:
        auto.time = real


def test_a_decision_saved_and_loaded_goes_on_with_powersgds_error_and_the_buckets_bit_for_bit(dist2):
    straight, resumed = dist2.run(_auto_run, None), dist2.run(_auto_run, 30)
    for rank, ((weights, used, _), (again, used_again, _)) in enumerate(zip(straight, resumed)):
        assert used[-1] == "powersgd:1" and torch.equal(again, weights) and used_again == used, rank
    said, said_again = straight[0][2], resumed[0][2]  # rank 0's lines
    assert len(said) == 1 and "chose powersgd:1" in said[0], said
    assert said_again == [said[0], "comm auto resumed at step 30: powersgd:1 as decided at step 16"], said_again


def test_a_run_saved_before_its_decision_decides_again_one_step_later(dist2):
    # Saved at step 1 (before the buckets' rebuild: none kept, the resumed run rebuilds as the saved one did): the
    # resumed run's first step settles in, untimed, as a fresh start's, so every phase comes one step later.
    straight, resumed = dist2.run(_auto_run, None), dist2.run(_auto_run, 1)
    used, used_again = straight[0][1], resumed[0][1]
    first, first_again = used.index("powersgd:1"), used_again.index("powersgd:1")
    assert first_again == first + 1 and used_again[first_again:] == used[first:-1], (used, used_again)
    assert resumed[0][2][0] == ("comm auto resumed at step 1 while deciding (timing exact steps): deciding again "
                                "from the exact all-reduce")


def _resumed_while_deciding() -> tuple[str, list[str]]:
    state = AutoComm(candidates=[Scheme("powersgd", 1)], probe=_slow_link, say=lambda line: None)
    saved = {**AutoComm(say=lambda line: None).state_dict(), "phase": "TRIAL", "scheme": "powersgd:1", "steps": 12,
             "powersgd": {1: {**auto.powersgd.PowerSGDState(None, 1, 2).state_dict(),
                              "error": {0: torch.ones(64)}}}}
    line = state.load_state_dict(saved)
    with pytest.raises(RuntimeError, match="before the first step"):
        state.load_state_dict(saved)
    return line, [state.phase.name, state.scheme.spec, str(state._carry[0].sum().item())]


def test_a_decision_under_way_when_saved_starts_again_and_keeps_powersgds_error():
    state = AutoComm(say=lambda line: None)
    with pytest.raises(ValueError, match="not a comm auto state"):
        state.load_state_dict({"phase": "DECIDED"})
    line, facts = _resumed_while_deciding()
    assert line == ("comm auto resumed at step 12 while deciding (trying candidates): deciding again from the "
                    "exact all-reduce")
    assert facts == ["START", "none", "64.0"]  # the trial's error carried into the next steps, not dropped

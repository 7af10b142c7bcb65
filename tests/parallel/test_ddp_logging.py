"""``_get_ddp_logging_data()``: the same keys and values as torch's DDP, iteration by iteration, on gloo ranks."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from ddp_models import batch, make
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # both engines take it
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddpkit

# Times differ between any two runs; the port is the harness's.
_VARIABLE = ("time", "master_port")


def _history(engine: str, name: str, kwargs: dict, steps: int, micro: int, hook: bool, rate: int | None) -> list:
    torch.manual_seed(0)
    wrap = ddpkit.DDP if engine == "ddpkit" else TorchDDP
    model = wrap(make(name), **kwargs)
    if hook:
        model.register_comm_hook(None, allreduce_hook)
    if rate:
        model._set_ddp_runtime_logging_sample_rate(rate)
    seen = [model._get_ddp_logging_data()]
    for step in range(steps):
        for m in range(micro):
            x, _ = batch(name, 100 * step + 10 * dist.get_rank() + m)
            kw = {"branch": dist.get_rank() == 0 and step % 2 == 0} if name == "branchy" else {}
            with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
                model(x, **kw).sum().backward()
        seen.append(model._get_ddp_logging_data())
    return seen


def _both(name: str, kwargs: dict, steps: int = 13, micro: int = 1, hook: bool = False,
          rate: int | None = None) -> tuple[list, list]:
    return (_history("ddpkit", name, kwargs, steps, micro, hook, rate),
            _history("torch", name, kwargs, steps, micro, hook, rate))


def _assert_same(ours: list, theirs: list) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert set(a) == set(b), f"after step {i}: only ddpkit {set(a) - set(b)}, only torch {set(b) - set(a)}"
        for key in a:
            if not any(v in key for v in _VARIABLE):
                assert a[key] == b[key], f"after step {i}, {key}: ddpkit {a[key]!r}, torch {b[key]!r}"


CASES = {
    "default": ("convbn", {}, {}),
    "unused parameters": ("branchy", {"find_unused_parameters": True}, {}),
    "static graph": ("convbn", {"static_graph": True}, {}),
    "small buckets": ("convbn", {"bucket_cap_mb": 1e-4}, {}),
    "no_sync": ("convbn", {}, {"micro": 2}),
    "comm hook": ("plain", {}, {"hook": True}),
    "sample rate": ("plain", {}, {"rate": 2}),
    "no buffer sync": ("convbn", {"forward_sync_buffers": False}, {}),
}


@pytest.mark.parametrize("case", CASES)
def test_logging_data_matches_torch(dist2, case):
    name, kwargs, extra = CASES[case]
    if case == "unused parameters":
        # torch logs can_set_static_graph once per process, into the first model that sees its set of unused
        # parameters change (a model destroyed takes the one logging too): fresh ranks, so that this case's models
        # are both engines' first, whatever ran in the pool before
        dist2.close()
    results = dist2.run(_both, name, kwargs, **extra)
    for ours, theirs in results:
        _assert_same(ours, theirs)
    if case == "unused parameters":  # rank 0's set changes (its branch is used every other step): logged as 0
        (ours, theirs), (ours1, _) = results
        assert ours[-1]["can_set_static_graph"] == theirs[-1]["can_set_static_graph"] == 0
        assert "can_set_static_graph" not in ours1[-1]  # rank 1 never uses the branch: its graph stays static


def _timed(name: str) -> dict:
    model = ddpkit.DDP(make(name))
    for step in range(3):
        model(batch(name, step + 10 * dist.get_rank())[0]).sum().backward()
    model(batch(name, 99)[0])  # the forward that records the previous iteration
    return model._get_ddp_logging_data()


def test_logging_data_times_are_ordered(dist2):
    for data in dist2.run(_timed, "convbn"):
        assert data["iteration"] == 3
        start, fwd_end = data["forward_compute_time_start"], data["backward_compute_time_start"]
        assert 0 < start <= fwd_end <= data["backward_compute_time_end"]
        assert data["backward_comm_time_start"] <= data["backward_comm_time_end"]
        assert data["forward_compute_time"] == fwd_end - start
        assert data["backward_comm_time"] == data["backward_comm_time_end"] - data["backward_comm_time_start"]
        assert all(data[f"avg_{k}"] >= 0 for k in ("forward_compute_time", "backward_compute_time",
                                                    "backward_comm_time", "backward_compute_comm_overlap_time"))


def _joined() -> dict:
    model = ddpkit.DDP(make("plain"))
    with model.join():
        for step in range(2 + dist.get_rank()):
            model(batch("plain", step)[0]).sum().backward()
    return model._get_ddp_logging_data()


def test_join_is_recorded_and_a_bad_sample_rate_refused(dist2):
    assert all(d["join_uneven_inputs"] == 1 for d in dist2.run(_joined))
    model = ddpkit.DDP(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="sample rate should be equal or greater than 1"):
        model._set_ddp_runtime_logging_sample_rate(0)
    assert "can_set_static_graph" not in model._get_ddp_logging_data()  # torch writes it only at destruction


def _with_empty_env() -> tuple[dict, dict]:
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # set, but empty (torch 2.13's test_ddp_logging_data_cpu does this)
    os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    try:
        ours, theirs = ddpkit.DDP(make("plain")), TorchDDP(make("plain"))
        return ours._get_ddp_logging_data(), theirs._get_ddp_logging_data()
    finally:
        del os.environ["CUDA_VISIBLE_DEVICES"]


def test_an_environment_variable_set_but_empty_logs_as_under_torch(dist2):
    for ours, theirs in dist2.run(_with_empty_env):
        assert ours["cuda_visible_devices"] == theirs["cuda_visible_devices"] == ""
        assert ours["torch_distributed_debug"] == theirs["torch_distributed_debug"] == "N/A"

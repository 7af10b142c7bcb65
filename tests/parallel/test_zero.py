"""ddpkit.ZeroRedundancyOptimizer (ZeRO stage 1) against torch's, and against an unsharded optimizer, on gloo ranks.

The same model and data train under three setups per rank: ddpkit's DDP with
ddpkit's ZeRO, torch's DDP with torch's ZeRO, and ddpkit's DDP with the plain
optimizer. Each owner steps its parameters with the same optimizer code on
the same averaged gradients, and the broadcast copies bits, so the three end
bit for bit equal.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from ddp_models import batch, make
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddpkit

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def _groups(model: nn.Module, grouped: bool) -> list:
    if not grouped:
        return list(model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 0.02}]


def _train(wrapped: nn.Module, optimizer: torch.optim.Optimizer, name: str, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        x, y = batch(name, 500 + 10 * step + dist.get_rank())
        optimizer.zero_grad()
        nn.functional.cross_entropy(wrapped(x), y).backward()
        optimizer.step()


def _three_ways(name: str, opt: str, grouped: bool, bucket_view: bool) -> dict:
    cls, kw = OPTIMIZERS[opt]
    base = make(name)
    ours, theirs, plain = (copy.deepcopy(base) for _ in range(3))
    a = ddpkit.DDP(ours)
    za = ddpkit.ZeroRedundancyOptimizer(_groups(ours, grouped), cls, parameters_as_bucket_view=bucket_view, **kw)
    b = TorchDDP(theirs)
    zb = TorchZero(_groups(theirs, grouped), cls, parameters_as_bucket_view=bucket_view, **kw)
    c = ddpkit.DDP(plain)
    zc = cls(_groups(plain, grouped), **kw)
    for wrapped, optimizer in ((a, za), (b, zb), (c, zc)):
        _train(wrapped, optimizer, name, 4)
    za.consolidate_state_dict(to=0)
    zb.consolidate_state_dict(to=0)
    out = {"ours": ours.state_dict(), "torch": theirs.state_dict(), "plain": plain.state_dict(),
           "owned": sum(len(g["params"]) for g in za.optim.param_groups),
           "torch_owned": sum(len(g["params"]) for g in zb.optim.param_groups),
           "groups": [{k: v for k, v in g.items() if k != "params"} for g in za.param_groups],
           "torch_groups": [{k: v for k, v in g.items() if k != "params"} for g in zb.param_groups]}
    if dist.get_rank() == 0:
        out.update(sd=za.state_dict(), torch_sd=zb.state_dict(), plain_sd=zc.state_dict())
    return out


def _same(a, b) -> bool:  # type: ignore[no-untyped-def]
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name,opt,grouped,bucket_view", [
    ("convbn", "sgd", False, False), ("embed", "adam", True, False), ("plain", "adamw", True, True),
])
@pytest.mark.parametrize("world", [2, 3])
def test_equals_torchs_zero_and_the_unsharded_optimizer(request, world, name, opt, grouped, bucket_view):
    pool = request.getfixturevalue(f"dist{world}")
    results = pool.run(_three_ways, name, opt, grouped, bucket_view)
    for r in results:
        assert _same(r["ours"], r["torch"]) and _same(r["ours"], r["plain"])
        assert r["owned"] == r["torch_owned"]  # torch's partition
        assert r["groups"] == r["torch_groups"]
    assert sum(r["owned"] for r in results) == sum(len(list(make(name).parameters())) for _ in [0])
    sd = results[0]
    # The consolidated state is torch's, and an unsharded optimizer's.
    assert _same(sd["sd"], sd["torch_sd"]) and _same(sd["sd"], sd["plain_sd"])


def _resume(world_saved: int) -> dict:
    """Train 3 steps, save the consolidated state; load it into a fresh optimizer (as from world ``world_saved``)."""
    name, (cls, kw) = "embed", OPTIMIZERS["adamw"]
    base = make(name)
    straight, first = copy.deepcopy(base), copy.deepcopy(base)
    s = ddpkit.DDP(straight)
    zs = ddpkit.ZeroRedundancyOptimizer(_groups(straight, True), cls, **kw)
    _train(s, zs, name, 6)
    f = ddpkit.DDP(first)
    zf = ddpkit.ZeroRedundancyOptimizer(_groups(first, True), cls, **kw)
    _train(f, zf, name, 3)
    zf.consolidate_state_dict(to=0)
    saved = ddpkit.broadcast_object(zf.state_dict() if dist.get_rank() == 0 else None)
    kept = copy.deepcopy(saved)
    again = copy.deepcopy(first)
    a = ddpkit.DDP(again)
    za = ddpkit.ZeroRedundancyOptimizer(_groups(again, True), cls, **kw)
    za.load_state_dict(saved)
    untouched = _same(saved, kept)
    _train(a, za, name, 3, first=3)
    # The same file into a plain optimizer: the format is an unsharded optimizer's.
    plain = copy.deepcopy(first)
    p = ddpkit.DDP(plain)
    zp = cls(_groups(plain, True), **kw)
    zp.load_state_dict(saved)
    _train(p, zp, name, 3, first=3)
    return {"straight": straight.state_dict(), "resumed": again.state_dict(), "plain": plain.state_dict(),
            "untouched": untouched}


def test_a_consolidated_state_resumes_bit_identically_and_loads_into_a_plain_optimizer(dist2):
    for r in dist2.run(_resume, 2):
        assert _same(r["straight"], r["resumed"]) and _same(r["straight"], r["plain"])
        assert r["untouched"]  # the dict given to load_state_dict is left as it was


def _add_group() -> dict:
    name, (cls, kw) = "convbn", OPTIMIZERS["sgd"]
    base = make(name)
    out = {}
    for engine, wrap, zero in (("ours", ddpkit.DDP, ddpkit.ZeroRedundancyOptimizer), ("torch", TorchDDP, TorchZero)):
        model = copy.deepcopy(base)
        params = list(model.parameters())
        head, body = params[-2:], params[:-2]
        wrapped = wrap(model)
        z = zero(body, cls, **kw)
        _train(wrapped, z, name, 2)
        z.param_groups[0]["lr"] *= 0.5  # as a scheduler between steps: add_param_group put the last step's back
        z.consolidate_state_dict(to=0)
        z.add_param_group({"params": head, "lr": 0.05})
        if engine == "ours" and dist.get_rank() == 0:  # the consolidation is of the groups before
            try:
                z.state_dict()
            except RuntimeError as e:
                out["stale"] = str(e)
        with _logged("ddpkit.parallel.zero.stage1") as records:
            _train(wrapped, z, name, 2, first=2)
        out[engine] = model.state_dict()
        out[engine + "_owned"] = [len(g["params"]) for g in z.optim.param_groups]
        out[engine + "_logged"] = [r.getMessage() for r in records]
    return out


@contextlib.contextmanager
def _logged(name: str) -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_add_param_group_as_torch(dist3):
    results = dist3.run(_add_group)
    for r in results:
        assert _same(r["ours"], r["torch"]) and r["ours_owned"] == r["torch_owned"]
        assert r["ours_logged"] == []  # new parameters are not a change of trainability (torch says nothing)
    # It blamed "add_param_group ran on some ranks only" (torch's: a bare AssertionError).
    assert results[0]["stale"].startswith("Optimizer state has not been consolidated on this rank")


def _raised(calls) -> list[str]:  # type: ignore[no-untyped-def]
    """What each call raised, as ``Type: message`` (``no error`` when it did not)."""
    seen = []
    for call in calls:
        try:
            call()
            seen.append("no error")
        except (TypeError, ValueError, RuntimeError) as e:
            seen.append(f"{type(e).__name__}: {e}")
    return seen


def _errors() -> list[str]:
    model = make("plain")
    return _raised((
        lambda: ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1),
        lambda: ddpkit.ZeroRedundancyOptimizer([], torch.optim.SGD, lr=0.1),
        lambda: ddpkit.ZeroRedundancyOptimizer(next(model.parameters()), torch.optim.SGD, lr=0.1),
        lambda: ddpkit.ZeroRedundancyOptimizer(model.parameters(), "adam", lr=0.1),
        lambda: ddpkit.ZeroRedundancyOptimizer([{"lr": 0.1}], torch.optim.SGD, lr=0.1),
        lambda: ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1).state_dict(),
        lambda: ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1).load_state_dict(
            {"state": {}, "param_groups": [{"params": [0]}]}),
        lambda: ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1).consolidate_state_dict(7),
    ))


def test_bad_input_is_named(dist2):
    seen = dist2.run(_errors)[0]
    assert seen[0].startswith("ValueError: overlap_with_ddp=True") and "zero_stage=2" in seen[0]
    assert seen[1].startswith("ValueError: ZeroRedundancyOptimizer got an empty parameter list")
    assert seen[2].startswith("TypeError: params should be an iterable") and "model.parameters()" in seen[2]
    assert seen[3].startswith("TypeError: optimizer_class='adam' is not an optimizer class")
    assert seen[4].startswith("ValueError: a parameter group without a 'params' key")
    assert "consolidate_state_dict(to=" in seen[5] and seen[5].startswith("RuntimeError")
    assert seen[6].startswith("ValueError: load_state_dict: the saved optimizer has groups of [1] parameters")
    assert seen[7].startswith("ValueError: consolidate_state_dict(to=7): not a rank of the group")


def _uneven(engine: str) -> dict:
    name, (cls, kw) = "plain", OPTIMIZERS["adam"]
    model = make(name)
    if engine == "ours":
        wrapped, z = ddpkit.DDP(model), None
        z = ddpkit.ZeroRedundancyOptimizer(model.parameters(), cls, **kw)
        join = ddpkit.parallel.common.join_context.Join
    else:
        from torch.distributed.algorithms.join import Join as join  # noqa: N813

        wrapped = TorchDDP(model)
        z = TorchZero(model.parameters(), cls, **kw)
    with join([wrapped, z]):
        for step in range(3 + 2 * dist.get_rank()):
            x, y = batch(name, 700 + 10 * step + dist.get_rank())
            z.zero_grad()
            nn.functional.cross_entropy(wrapped(x), y).backward()
            z.step()
    return model.state_dict()


def test_uneven_inputs_under_join_as_torch(dist3):
    import ddpkit.parallel.common.join_context  # noqa: F401 - the name the ranks use

    ours, theirs = dist3.run(_uneven, "ours"), dist3.run(_uneven, "torch")
    for a, b in zip(ours, theirs):
        assert _same(a, b)


# -- stage 2: DistributedDataParallel(zero_stage=2) --------------------------------------------------------------

def _stage2(name: str, opt: str, grouped: bool, micro: int, find_unused: bool, amp: bool, cap: float | None) -> dict:
    """Stage 2 against ddpkit's DDP with the unsharded optimizer: parameters and the consolidated state."""
    cls, kw = OPTIMIZERS[opt]
    base = make(name)
    sharded, plain = copy.deepcopy(base), copy.deepcopy(base)
    a = ddpkit.DDP(sharded, zero_stage=2, find_unused_parameters=find_unused, bucket_cap_mb=cap)
    za = ddpkit.ZeroRedundancyOptimizer(_groups(sharded, grouped), cls, **kw)
    c = ddpkit.DDP(plain, find_unused_parameters=find_unused, bucket_cap_mb=cap)
    zc = cls(_groups(plain, grouped), **kw)
    left = []
    for wrapped, optimizer in ((a, za), (c, zc)):
        for step in range(4):
            optimizer.zero_grad()
            for m in range(micro):
                x, y = batch(name, 900 + 10 * step + dist.get_rank() + 100 * m)
                kwargs = {"branch": step % 2 == 0} if name == "branchy" else {}
                ctx = wrapped.no_sync() if m < micro - 1 else contextlib.nullcontext()
                with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    nn.functional.cross_entropy(wrapped(x, **kwargs).float(), y).backward()
            left.append(sum(p.grad is not None for p in wrapped.parameters()))
            optimizer.step()
    za.consolidate_state_dict(to=0)
    out = {"sharded": sharded.state_dict(), "plain": plain.state_dict(), "grads_left": left[:4],
           "shard_elems": sum(t.numel() for t in a.reducer.grad_shards),
           "elems": sum(p.numel() for p in sharded.parameters())}
    if dist.get_rank() == 0:
        out.update(sd=za.state_dict(), plain_sd=zc.state_dict())
    return out


@pytest.mark.parametrize("name,opt,grouped,micro,find_unused,amp,cap", [
    ("convbn", "sgd", False, 1, False, False, 0.0005),
    ("embed", "adamw", True, 2, False, False, None),
    ("branchy", "adam", False, 1, True, False, 0.0001),
    ("plain", "adamw", True, 1, False, True, 0.0002),
])
@pytest.mark.parametrize("world", [2, 3])
def test_stage2_equals_ddp_with_the_unsharded_optimizer(request, world, name, opt, grouped, micro, find_unused,
                                                        amp, cap):
    pool = request.getfixturevalue(f"dist{world}")
    results = pool.run(_stage2, name, opt, grouped, micro, find_unused, amp, cap)
    # On gloo each bucket is all-reduced and each rank keeps its chunk. At world 2 a sum of two is the same in
    # any order: bit for bit. At world 3 gloo's ring adds three values in an order that depends on where an
    # element falls in its buffer, and stage 2's buckets (fixed) are not DDP's (rebuilt): a few ulps.
    for r in results:
        if world == 2:
            assert _same(r["sharded"], r["plain"])
        else:
            for k, v in r["sharded"].items():
                torch.testing.assert_close(v, r["plain"][k], rtol=1e-5, atol=1e-6)
        assert r["grads_left"] == [0, 0, 0, 0]  # no full gradient stays after a synchronised backward
        assert r["shard_elems"] <= r["elems"] / world + 2 * world * 8  # 1/W, plus padding per bucket
    sd = results[0]
    if world == 2:
        assert _same(sd["sd"], sd["plain_sd"])
    else:
        assert sd["sd"]["param_groups"] == sd["plain_sd"]["param_groups"]
        assert sd["sd"]["state"].keys() == sd["plain_sd"]["state"].keys()


def _stage2_clipped(norm_type: float) -> dict:
    """Stage 2 and DDP, each clipping with ``model.clip_grad_norm_`` before every SGD step (with momentum: Adam
    would turn the rounding of a gradient near zero into a step of full size)."""
    base = make("convbn")
    sharded, plain = copy.deepcopy(base), copy.deepcopy(base)
    a, c = ddpkit.DDP(sharded, zero_stage=2, bucket_cap_mb=0.0005), ddpkit.DDP(plain)
    za = ddpkit.ZeroRedundancyOptimizer(sharded.parameters(), torch.optim.SGD, lr=0.5, momentum=0.9)
    zc = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)
    norms: dict[str, list[float]] = {"sharded": [], "plain": []}
    for key, wrapped, optimizer in (("sharded", a, za), ("plain", c, zc)):
        for step in range(4):
            optimizer.zero_grad()
            x, y = batch("convbn", 700 + 10 * step + dist.get_rank())
            nn.functional.cross_entropy(wrapped(x), y).backward()
            norms[key].append(float(wrapped.clip_grad_norm_(0.05, norm_type)))
            optimizer.step()
    return {"norms": norms, "sharded": sharded.state_dict(), "plain": plain.state_dict()}


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_stage2_clips_the_whole_models_gradient_norm_as_ddp(dist2, norm_type):
    # The shards hold disjoint pieces of the averaged gradients: the norm is one collective over them, and the
    # same coefficient scales every shard. The norm adds its pieces in another order than torch's function
    # (per tensor, then over tensors): equal within rounding, not bit for bit.
    for r in dist2.run(_stage2_clipped, norm_type):
        for ours, torchs in zip(r["norms"]["sharded"], r["norms"]["plain"]):
            assert abs(ours - torchs) <= 1e-6 * max(1.0, torchs)
        assert min(r["norms"]["plain"]) > 0.05  # every step clipped (else this tests nothing)
        for k, v in r["sharded"].items():
            torch.testing.assert_close(v, r["plain"][k], rtol=1e-5, atol=1e-6)


def _stage2_resume(saved: dict | None) -> dict:
    """Continue from ``saved`` (a consolidated stage-2 state from another world size) under stage 2 and plain."""
    name, (cls, kw) = "embed", OPTIMIZERS["adamw"]
    if saved is None:  # make one: 3 steps at this world size
        model = make(name)
        a = ddpkit.DDP(model, zero_stage=2)
        z = ddpkit.ZeroRedundancyOptimizer(_groups(model, True), cls, **kw)
        _train(a, z, name, 3)
        z.consolidate_state_dict(to=0)
        return {"model": model.state_dict(), "optimizer": z.state_dict() if dist.get_rank() == 0 else None}
    # The pool hands tensors over in shared memory, which every rank would then step in place: copies.
    saved = copy.deepcopy(saved)
    out = {}
    for stage in (2, 0):
        model = make(name)
        model.load_state_dict(saved["model"])
        wrapped = ddpkit.DDP(model, zero_stage=stage)
        z = (ddpkit.ZeroRedundancyOptimizer(_groups(model, True), cls, **kw) if stage
             else cls(_groups(model, True), **kw))
        z.load_state_dict(copy.deepcopy(saved["optimizer"]))
        _train(wrapped, z, name, 3, first=3)
        out[stage] = model.state_dict()
    return out


def test_a_stage2_state_resumes_at_another_world_size(dist2, dist3):
    saved = dist2.run(_stage2_resume, None)[0]
    for r in dist3.run(_stage2_resume, saved):  # world 3: a few ulps, as above
        for k, v in r[2].items():
            torch.testing.assert_close(v, r[0][k], rtol=1e-5, atol=1e-6)


class _Layouts(nn.Module):
    """A channels-last convolution (its weight keeps its own memory under stage 2) before a larger linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.lin = nn.Linear(4 * 6 * 6, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.conv(x).flatten(1))


def _stage2_memory() -> dict:
    """Stage 2 against DDP on parameters that live in the buckets' memory, one that does not (channels last), and
    one whose memory is replaced (``param.data = ...``) between steps."""
    torch.manual_seed(0)
    base = _Layouts()
    sharded, plain = copy.deepcopy(base), copy.deepcopy(base)
    a = ddpkit.DDP(sharded, zero_stage=2)
    za = ddpkit.ZeroRedundancyOptimizer(sharded.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    c = ddpkit.DDP(plain)
    zc = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for wrapped, optimizer, model in ((a, za, sharded), (c, zc, plain)):
        for step in range(4):
            if step == 2:
                model.lin.weight.data = model.lin.weight.data * 0.5  # new memory, new values
            g = torch.Generator().manual_seed(10 * step + dist.get_rank())
            x = torch.randn(6, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
            optimizer.zero_grad()
            nn.functional.cross_entropy(wrapped(x), torch.randint(0, 64, (6,), generator=g)).backward()
            optimizer.step()
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*sharded.parameters(), *a.reducer.param_shards]}
    return {"sharded": sharded.state_dict(), "plain": plain.state_dict(), "held": sum(held.values()),
            "params": sum(p.numel() * p.element_size() for p in sharded.parameters()),
            "channels_last": sharded.conv.weight.is_contiguous(memory_format=torch.channels_last)}


def _stepped_under_a_graph() -> list[str]:
    """A forward, then a step that changes the weights it saved, then its backward: autograd refuses, as under
    DDP."""
    import warnings

    seen = []
    for stage in (0, 2):
        model = ddpkit.DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), zero_stage=stage)
        opt = ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1) if stage else \
            torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # stage 2: the gradients of that backward are stepped after a forward
            out = model(torch.randn(3, 4)).sum()
        opt.step()
        seen.append(_raised([out.backward])[0])
    return seen


def test_stage2_a_step_under_a_saved_graph_is_refused_as_under_ddp(dist2):
    for ddp, stage2 in dist2.run(_stepped_under_a_graph):
        assert "modified by an inplace operation" in ddp, ddp
        assert "modified by an inplace operation" in stage2, stage2


def test_stage2_parameters_live_in_the_buckets_and_train_as_ddp(dist2):
    for r in dist2.run(_stage2_memory):
        assert _same(r["sharded"], r["plain"])
        assert r["channels_last"]  # a layout the flat buffer cannot hold stays the parameter's own
        # The shards the optimizer steps are the parameters' own memory, not a copy beside them: before, the
        # parameters and the shards held 1.5 x the parameters' bytes at world 2.
        assert r["held"] <= 1.05 * r["params"], r


def _stage2_errors() -> list[str]:
    model = make("plain")
    return _raised((
        lambda: ddpkit.DDP(make("plain"), zero_stage=1),
        lambda: ddpkit.DDP(make("plain"), zero_stage=2, static_graph=True),
        lambda: ddpkit.DDP(make("plain"), zero_stage=2, gradient_as_bucket_view=True),
        lambda: ddpkit.DDP(model, zero_stage=2).register_comm_hook(None, lambda state, bucket: None),
        lambda: ddpkit.DDP(make("plain"), zero_stage=2).join(),
        lambda: _optimizer_over_a_part(model),
        lambda: _optimizer_over_a_part(model, torch.optim.Adafactor, whole=True),
    ))


def _optimizer_over_a_part(model: torch.nn.Module, cls: type = torch.optim.SGD,
                           whole: bool = False) -> torch.optim.Optimizer:
    # The wrapper is kept until the optimizer is made: a stage-2 model that was collected shards nothing, so an
    # optimizer over its parameters is refused by nothing (with the wrapper as a temporary, whether a garbage
    # collection came between the two decided the answer: this test failed once in CI so).
    wrapped = ddpkit.DDP(copy.deepcopy(model) if whole else model, zero_stage=2)
    params = list(wrapped.parameters())
    return ddpkit.ZeroRedundancyOptimizer(params if whole else params[:1], cls, lr=0.1)


def _unstepped() -> list[list[str]]:
    import warnings

    seen = []
    for zero in (False, True):
        model = ddpkit.DDP(make("plain"), zero_stage=2)
        opt = ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1) if zero else \
            torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                opt.zero_grad()
                model(torch.randn(4, 1, 8, 8)).sum().backward()
                opt.step()
        seen.append([str(w.message) for w in caught if "zero_stage=2" in str(w.message)])
    return seen


def test_stage2_warns_once_when_a_backwards_gradients_are_never_stepped_on(dist2):
    plain, zero = dist2.run(_unstepped)[0]
    assert len(plain) == 1, plain  # the second forward sees it; once per model
    assert "were not stepped on" in plain[0] and "only ddpkit.ZeroRedundancyOptimizer" in plain[0]
    assert zero == []


def test_stage2_refuses_what_it_cannot_do(dist2):
    seen = dist2.run(_stage2_errors)[0]
    assert seen[0].startswith("ValueError: zero_stage=1: use 0") and "ZeroRedundancyOptimizer" in seen[0]
    assert "static_graph" in seen[1] and "gradient_as_bucket_view" in seen[2]
    assert seen[3].startswith("RuntimeError: a comm hook reduces whole buckets")
    assert seen[4].startswith("RuntimeError: join() is not supported with zero_stage=2")
    assert "needs one ZeroRedundancyOptimizer over all of its trainable parameters" in seen[5]
    # It stepped flat segments: Adafactor factored no matrix, 1e-2 off DDP's, without a word.
    assert seen[6].startswith("ValueError: Adafactor over a zero_stage=2 model: its update depends on whole")


def _engines() -> dict:
    from ddpkit.parallel.ddp.engine import Engine

    out = {}
    for stage in (0, 2, 3):
        torch.manual_seed(0)
        model = ddpkit.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), zero_stage=stage)
        out[stage] = (type(model.reducer).__name__, isinstance(model.reducer, Engine))
    return out


def test_every_stage_s_engine_is_the_one_interface_ddp_drives(dist2):
    # DDP's wrapper drives one interface (ddpkit.parallel.ddp.engine.Engine), whatever the stage.
    assert dist2.run(_engines)[0] == {0: ("Reducer", True), 2: ("ShardedReducer", True),
                                      3: ("ShardedParameters", True)}

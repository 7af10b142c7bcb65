"""ddpkit.DistributedOptimizer (Horovod's contract) against ddpkit's DDP, on real gloo ranks."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from ddp_models import MODELS, batch
from torch import nn

import ddpkit
from ddpkit.parallel.common.observer import BucketEvent, Observer

# At world size 2 both engines pre-scale by 1/2 (exact in binary) and gloo adds
# two values (one rounding, commutative): bitwise equal. The fp16 and
# predivide variants round differently on purpose: a float16 mantissa keeps
# 11 bits, so a relative error of a few 1e-3 per step.
EXACT = {"rtol": 0.0, "atol": 0.0}
FP16 = {"rtol": 2e-2, "atol": 2e-3}


def _model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed + 10 * dist.get_rank())  # different on purpose: the broadcast must fix it
    return MODELS[name]()


def _ddp_run(name: str, steps: int, micro: int, momentum: float, **ddp_kwargs) -> dict:
    model = _model(name)
    ddp = ddpkit.DDP(model, **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for step in range(steps):
        for m in range(micro):
            x, y = batch(name, 1000 + 100 * step + 10 * dist.get_rank() + m)
            ctx = ddp.no_sync() if m < micro - 1 else _null()
            with ctx:
                nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _hvd_run(name: str, steps: int, micro: int, momentum: float, **kwargs) -> dict:
    model = _model(name)
    ddpkit.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    opt = ddpkit.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                      backward_passes_per_step=micro, **kwargs)
    assert isinstance(opt, torch.optim.SGD)
    for step in range(steps):
        for m in range(micro):
            x, y = batch(name, 1000 + 100 * step + 10 * dist.get_rank() + m)
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _compare(name: str, steps: int, micro: int, momentum: float, tol: dict, ddp_kwargs: dict, **kwargs) -> None:
    theirs = _ddp_run(name, steps, micro, momentum, **ddp_kwargs)
    ours = _hvd_run(name, steps, micro, momentum, **kwargs)
    for k in theirs:
        if "running_" in k or "num_batches" in k:
            continue  # DDP broadcasts BatchNorm statistics from rank 0; the optimizer leaves them local
        torch.testing.assert_close(ours[k], theirs[k], **tol, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("name", ["plain", "convbn", "embed"])
def test_same_weights_as_ddp(dist2, name):
    dist2.run(_compare, name, 4, 1, 0.9, EXACT, {})


def test_accumulation_matches_ddp_no_sync(dist2):
    # backward_passes_per_step=3 against DDP with two no_sync micro-batches and a synchronised one.
    dist2.run(_compare, "plain", 3, 3, 0.9, EXACT, {})


def test_world3_and_small_buckets(dist3):
    # Three ranks: gloo's ring adds in an order that depends on the chunk, so a few ulps.
    dist3.run(_compare, "convbn", 3, 1, 0.0, {"rtol": 1e-5, "atol": 1e-6}, {"bucket_cap_mb": 1e-4},
              bucket_cap_mb=1e-4)


def test_compression_and_predivide(dist2):
    dist2.run(_compare, "plain", 3, 1, 0.0, FP16, {}, compression=ddpkit.Compression.fp16)
    dist2.run(_compare, "plain", 3, 1, 0.0, FP16, {}, compression=ddpkit.Compression.bf16, gradient_predivide_factor=2.0)
    dist2.run(_compare, "plain", 3, 1, 0.0, {"rtol": 1e-6, "atol": 1e-7}, {}, gradient_predivide_factor=4.0)


def _sum_op() -> list:
    model = _model("plain")
    ddpkit.broadcast_parameters(model.state_dict())
    opt = ddpkit.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op="sum")
    x, y = batch("plain", 10 * dist.get_rank())
    nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    mine = {n: p.grad.clone() for n, p in model.named_parameters()}
    # Each rank's local gradient, summed by hand.
    ref = _model("plain")
    ref.load_state_dict(model.state_dict())
    nn.functional.cross_entropy(ref(x), y).backward()
    for n, p in ref.named_parameters():
        local = p.grad.clone()
        dist.all_reduce(local)
        torch.testing.assert_close(mine[n], local, rtol=0, atol=0)
    with opt.skip_synchronize():
        opt.step()
    return []


def test_op_sum_and_skip_synchronize(dist2):
    dist2.run(_sum_op)


def _clip_between() -> dict:
    model = _model("plain")
    ddpkit.broadcast_parameters(model.state_dict())
    opt = ddpkit.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    out = {}
    for step in range(3):
        x, y = batch("plain", 100 * step + 10 * dist.get_rank())
        nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        out[step] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no double-synchronise warning inside skip_synchronize
            with opt.skip_synchronize():
                opt.step()
        opt.zero_grad()
    # step() right after synchronize() without the context: Horovod's warning, and it still works.
    x, y = batch("plain", 500 + 10 * dist.get_rank())
    nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["warned"] = any("skip_synchronize" in str(w.message) for w in caught)
    out["weights"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_synchronize_then_clip(dist2):
    a, b = dist2.run(_clip_between)
    assert a[0] == b[0] and a[1] == b[1]  # the norm of the averaged gradient: the same everywhere
    assert a["warned"] and b["warned"]
    for x, y in zip(a["weights"], b["weights"]):
        assert torch.equal(x, y)


def _unused_gets_zero_grad() -> list:
    model = MODELS["branchy"]()
    ddpkit.broadcast_parameters(model.state_dict())
    opt = ddpkit.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters())
    x, _ = batch("branchy", 10 * dist.get_rank())
    # "sometimes" is used on rank 0 only, "never" nowhere: Horovod reduces both (zeros where unused).
    model(x, branch=dist.get_rank() == 0).sum().backward()
    opt.synchronize()
    return [model.sometimes.weight.grad.clone(), model.never.weight.grad.clone()]


def test_unused_parameters_reduced_as_zeros(dist2):
    (s0, n0), (s1, n1) = dist2.run(_unused_gets_zero_grad)
    assert torch.equal(s0, s1) and s0.abs().sum() > 0  # rank 0's gradient, halved, on both
    assert torch.equal(n0, torch.zeros_like(n0)) and torch.equal(n1, n0)


def _misuse() -> dict:
    model = _model("plain")
    opt = ddpkit.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batch("plain", 10 * dist.get_rank())
    nn.functional.cross_entropy(model(x), y).backward()
    errors = {}
    try:
        opt.zero_grad()
    except AssertionError as e:
        errors["zero_grad"] = str(e)
    try:
        nn.functional.cross_entropy(model(x), y).backward()
    except AssertionError as e:
        errors["overrun"] = str(e)
    opt.step()  # still usable: the first pass's reduction completes
    opt.zero_grad()
    # The same overrun at a later step, once the buckets are final (the engine's short path): Horovod's error too.
    for step in range(2):
        nn.functional.cross_entropy(model(x), y).backward()
        try:
            nn.functional.cross_entropy(model(x), y).backward()
        except AssertionError as e:
            errors[f"overrun at step {step + 2}"] = str(e)
        opt.step()
        opt.zero_grad()
    # Two passes per step: zero_grad after the first is refused too (Horovod's rule).
    model2 = _model("plain")
    opt2 = ddpkit.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1), backward_passes_per_step=2)
    nn.functional.cross_entropy(model2(x), y).backward()
    try:
        opt2.zero_grad()
    except AssertionError as e:
        errors["zero_grad_2"] = str(e)
    nn.functional.cross_entropy(model2(x), y).backward()
    opt2.step()
    opt2.zero_grad()
    return errors


def test_zero_grad_and_overrun_errors(dist2):
    errors = dist2.run(_misuse)[0]
    assert "zero_grad() was called after loss.backward()" in errors["zero_grad"]
    assert "before optimizer.step() or optimizer.synchronize()" in errors["zero_grad"]
    assert "more than backward_passes_per_step=1" in errors["overrun"]
    assert "more than backward_passes_per_step=1" in errors["overrun at step 2"]
    assert "more than backward_passes_per_step=1" in errors["overrun at step 3"]
    assert "zero_grad() was called after loss.backward()" in errors["zero_grad_2"]


def _bad_inputs() -> dict:
    model = _model("plain")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = {}
    cases = {
        "not_named": lambda: ddpkit.DistributedOptimizer(sgd, named_parameters=list(model.named_parameters())[:1]),
        "duplicates": lambda: ddpkit.DistributedOptimizer(
            sgd, named_parameters=[("a", p) for p in model.parameters()]),
        "not_tuples": lambda: ddpkit.DistributedOptimizer(sgd, named_parameters=list(model.parameters())),
        "passes": lambda: ddpkit.DistributedOptimizer(sgd, backward_passes_per_step=0),
        "op": lambda: ddpkit.DistributedOptimizer(sgd, op="adasum"),
        "predivide": lambda: ddpkit.DistributedOptimizer(sgd, op="sum", gradient_predivide_factor=2.0),
        "compression": lambda: ddpkit.DistributedOptimizer(sgd, compression="fp16"),
        "adasum": lambda: ddpkit.DistributedOptimizer(sgd, op=2),
        "num_groups": lambda: ddpkit.DistributedOptimizer(sgd, num_groups=-1),
        "groups": lambda: ddpkit.DistributedOptimizer(sgd, groups=[[torch.zeros(2)]]),
        "root": lambda: ddpkit.broadcast_parameters(model.state_dict(), root_rank=5),
        "params_type": lambda: ddpkit.broadcast_parameters(torch.zeros(3)),
        "lbfgs": lambda: ddpkit.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters())),
    }
    for key, fn in cases.items():
        try:
            fn()
        except (ValueError, TypeError) as e:
            errors[key] = f"{type(e).__name__}: {e}"
    return errors


def test_bad_inputs(dist2):
    errors = dist2.run(_bad_inputs)[0]
    assert "not in it: param_groups[0]['params'][1]" in errors["not_named"]
    assert "duplicates: a" in errors["duplicates"]
    assert "sequence of tuples (name, parameter)" in errors["not_tuples"]
    assert "backward_passes_per_step=0" in errors["passes"]
    assert "op='adasum'" in errors["op"]
    assert "only supported with op='avg'" in errors["predivide"]
    assert errors["compression"].startswith("TypeError: compression='fp16'")
    assert "root_rank=5" in errors["root"] and "0..1" in errors["root"]
    assert "invalid params of type Tensor" in errors["params_type"]
    assert "LBFGS" in errors["lbfgs"]
    assert "op=2 (Horovod's Adasum) is not implemented" in errors["adasum"]
    assert "num_groups=-1 must be an integer >= 0" in errors["num_groups"]
    assert "every entry must be a parameter of the optimizer" in errors["groups"]


def _horovod_style() -> dict:
    from ddp_models import SparseEmbeddings

    torch.manual_seed(dist.get_rank())  # different weights: broadcast_parameters must even them out
    model = SparseEmbeddings()
    ddpkit.broadcast_parameters(list(model.parameters()), root_rank=0)  # bare tensors, as Horovod takes them
    start = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randint(0, 50, (4, 5), generator=g), torch.randint(0, 30, (4, 3), generator=g)
    # Horovod's positional order: optimizer, named_parameters, compression, backward_passes_per_step, op.
    opt = ddpkit.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                      ddpkit.Compression.none, 1, 1, sparse_as_dense=True)  # 1: hvd.Sum
    model(x, y).square().sum().backward()
    opt.synchronize()
    summed = [p.grad.clone() for p in model.parameters()]
    ref = SparseEmbeddings()
    ref.load_state_dict(dict(zip(ref.state_dict(), start)))
    ref(x, y).square().sum().backward()
    local = [p.grad.to_dense() for p in ref.parameters()]
    for t in local:
        dist.all_reduce(t)  # the sum over ranks
    refused = ddpkit.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1), ref.named_parameters())
    ref.zero_grad()
    try:
        ref(x, y).square().sum().backward()
        refused.synchronize()
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    return {"start": start, "summed": summed, "local": local, "error": error}


def test_horovods_argument_order_op_values_sparse_as_dense_and_broadcast_of_a_list(dist2):
    r0, r1 = dist2.run(_horovod_style)
    assert all(torch.equal(a, b) for a, b in zip(r0["start"], r1["start"]))
    for r in (r0, r1):
        assert all(not g.is_sparse for g in r["summed"])
        assert all(torch.equal(g, t) for g, t in zip(r["summed"], r["local"]))
        assert "parameter 'emb.weight' has a sparse gradient" in r["error"] and "sparse_as_dense=True" in r["error"]


def _mismatched() -> str:
    model = nn.Linear(4, 3 if dist.get_rank() == 0 else 5)
    try:
        ddpkit.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters())
    except ValueError as e:
        return str(e)
    return "no error"


def test_mismatched_parameters_across_ranks(dist2):
    for msg in dist2.run(_mismatched):
        assert "DistributedOptimizer: the ranks hold different parameters" in msg
        assert "'weight' shape [3, 4]" in msg and "'weight' shape [5, 4]" in msg


def _broadcasts() -> dict:
    rank = dist.get_rank()
    model = _model("convbn")
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    if rank == 0:  # rank 0 "resumed": it has Adam state; rank 1 is fresh
        x, y = batch("convbn", 0)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    ddpkit.broadcast_parameters(model.state_dict(), root_rank=0)
    ddpkit.broadcast_optimizer_state(opt, root_rank=0)
    sd = opt.state_dict()
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "state": {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in v.items()}
                      for k, v in sd["state"].items()},
            "lr": sd["param_groups"][0]["lr"]}


def test_broadcast_parameters_and_optimizer_state(dist2):
    a, b = dist2.run(_broadcasts)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["lr"] == b["lr"] == 0.01
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for k in a["state"]:
        for n in a["state"][k]:
            assert torch.equal(a["state"][k][n], b["state"][k][n]), (k, n)


def _fresh_state_stays_fresh() -> tuple:
    model = _model("plain")
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    ddpkit.broadcast_optimizer_state(opt, root_rank=1)
    after = [p.detach().clone() for p in model.parameters()]
    return len(opt.state), all(torch.equal(x, y) for x, y in zip(before, after))


def test_broadcast_optimizer_state_of_a_fresh_optimizer(dist2):
    # Horovod steps a fresh optimizer with zero gradients here (moving weights under
    # weight decay); ddpkit copies the root's empty state and leaves parameters alone.
    assert dist2.run(_fresh_state_stays_fresh) == [(0, True), (0, True)]


class _ReadyAtLaunch(Observer):
    """How many buckets were ready at each launch."""

    def __init__(self) -> None:
        self.ready = 0
        self.at_launch: list[int] = []

    def on_bucket_ready(self, event: BucketEvent) -> None:
        self.ready += 1

    def on_launch(self, event: BucketEvent) -> None:
        self.at_launch.append(self.ready)


def _launch_points() -> tuple[list[int], list[bool]]:
    model = _model("plain")
    opt = ddpkit.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_cap_mb=1e-6)
    reducer = opt.reducer
    counts = _ReadyAtLaunch()
    opt.register_observer(counts)
    done_after_backward: list[bool] = []
    for step in range(3):
        x, y = batch("plain", 100 * step + 10 * dist.get_rank())
        nn.functional.cross_entropy(model(x), y).backward()
        done_after_backward.append(reducer.in_flight)  # backward returned with the reductions in flight
        counts.ready = 0
        opt.step()
        opt.zero_grad()
    return counts.at_launch, done_after_backward


def test_buckets_go_out_during_backward_and_complete_in_step(dist2):
    ready, in_flight = dist2.run(_launch_points)[0]
    n = len(list(MODELS["plain"]().parameters()))
    # One bucket in the first step (torch's layout before any gradient is seen),
    # then one per parameter in arrival order.
    assert len(ready) == 1 + 2 * n
    assert ready[1] < n and ready[1 + n] < n  # the first bucket left before the last gradient was ready
    assert in_flight == [True, True, True]


def test_step_hooks_run_once_per_step_through_the_wrapped_optimizer():
    # The wrapper's step calls the wrapped class's own (hooked) step: a hook must not run a second time there.
    model = nn.Linear(2, 2)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ddpkit.TrainState(model=model, optimizer=plain)
    calls = []
    plain.register_step_pre_hook(lambda *a: calls.append("pre"))
    plain.register_step_post_hook(lambda *a: calls.append("post"))
    opt = ddpkit.DistributedOptimizer(plain, named_parameters=model.named_parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert calls == ["pre", "post"] and state.step == 1


def _scheduled_before_wrapping(wrap_first: bool) -> tuple[list[torch.Tensor], list[float]]:
    model = _model("plain")
    ddpkit.broadcast_parameters(model.state_dict(), root_rank=0)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    if wrap_first:
        opt = ddpkit.DistributedOptimizer(base, named_parameters=model.named_parameters())
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    else:  # the scheduler puts a `step` of its own on the optimizer it is given
        schedule = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
        opt = ddpkit.DistributedOptimizer(base, named_parameters=model.named_parameters())
    rates = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (made before wrapping, it says it saw no optimizer.step(), as under Horovod)
        for step in range(3):
            x, y = batch("plain", 1000 + 100 * step + 10 * dist.get_rank())
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            schedule.step()
            rates.append(opt.param_groups[0]["lr"])
    return [p.detach().clone() for p in model.parameters()], rates


def test_a_scheduler_made_before_wrapping_leaves_the_steps_averaged(dist2):
    # Its `step` on the optimizer stepped the original without the all-reduce: each rank on its own gradients.
    first, second = dist2.run(_scheduled_before_wrapping, False)
    reference = dist2.run(_scheduled_before_wrapping, True)[0]
    assert first[1] == reference[1] == [0.05, 0.025, 0.0125]
    for a, b, c in zip(first[0], second[0], reference[0]):
        assert torch.equal(a, b) and torch.equal(a, c)


def _closures(optimizer: str) -> dict[str, list[torch.Tensor]]:
    out = {}
    for engine in ("horovod", "ddp"):
        model = _model("plain")
        ddpkit.broadcast_parameters(model.state_dict(), root_rank=0)
        ddp = ddpkit.DDP(model) if engine == "ddp" else model
        make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                "lbfgs": lambda ps: torch.optim.LBFGS(ps, lr=0.5, max_iter=4)}[optimizer]
        opt = make(model.parameters())
        if engine == "horovod":
            opt = ddpkit.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        for step in range(3):
            x, y = batch("plain", 1000 + 100 * step + 10 * dist.get_rank())

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(ddp(x), y)
                loss.backward()
                return loss

            opt.step(closure)
        out[engine] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.parametrize("optimizer", ["sgd", "lbfgs"])
def test_a_closure_steps_on_the_averaged_gradients_of_its_backward(dist2, optimizer):
    # The gradients were all-reduced before the closure ran: each rank stepped on its own (SGD), or LBFGS's
    # second call of the closure failed on a reduction still pending.
    for out in dist2.run(_closures, optimizer):
        for a, b in zip(out["horovod"], out["ddp"]):
            assert torch.equal(a, b)


def test_a_world_of_one_accumulates_and_checks_nothing_as_horovod_at_size_1():
    # Horovod registers no hooks at size 1: zero_grad() between backward and step, or more passes than
    # backward_passes_per_step, are the plain optimizer's business. ddpkit raised its AssertionErrors.
    torch.manual_seed(0)
    model, twin = nn.Linear(3, 2), nn.Linear(3, 2)
    twin.load_state_dict(model.state_dict())
    opt = ddpkit.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    for m, o in ((model, opt), (twin, plain)):
        m(x).sum().backward()
        o.zero_grad()
        m(x).sum().backward()
        m(2 * x).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    opt.synchronize()
    opt.load_state_dict(opt.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a synchronize() before load_state_dict() no longer counts (Horovod's rule)
        opt.step()

"""ddpkit.DistributedDataParallel against torch's DDP and a single process, on real gloo ranks."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
from ddp_models import SparseEmbeddings, batch, make, pair, state, torch_sparse_group, train
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddpkit
from ddpkit.parallel.common.unused import UnusedParametersError

# Tolerance for ddpkit vs torch DDP at world size 2: both pre-scale every
# gradient by 1/2 (exact in binary) and gloo sums two values (commutative, one
# rounding), so the numbers are bitwise identical: exact comparison.
EXACT = {"rtol": 0.0, "atol": 0.0}


def _parity(name: str, momentum: float, steps: int, kwargs: dict, micro: int = 1, never: bool = False) -> list[dict]:
    ours, theirs = pair(name, **kwargs)
    fkw = None
    if name == "branchy":
        def fkw(step: int) -> dict:
            return {"branch": step % 2 == 0 or dist.get_rank() == 0, "never": never}
    train(ours, name, steps, momentum, fkw, micro=micro)
    train(theirs, name, steps, momentum, fkw, micro=micro)
    return [state(ours), state(theirs)]


def _assert_same(results: list, skip_rank1_stats: bool = False, **tol) -> None:
    for rank, (ours, theirs) in enumerate(results):
        assert ours.keys() == theirs.keys(), f"rank {rank}"
        for k in ours:
            if skip_rank1_stats and rank > 0 and "running_" in k:
                continue
            torch.testing.assert_close(ours[k], theirs[k], **(tol or EXACT), msg=lambda m: f"rank {rank} {k}: {m}")


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("name", ["convbn", "embed"])
def test_matches_torch_ddp(dist2, name, momentum):
    _assert_same(dist2.run(_parity, name, momentum, 3, {}))


def test_matches_torch_ddp_one_parameter_buckets(dist2):
    # Tiny cap: every bucket holds one parameter and is reduced in place in .grad.
    _assert_same(dist2.run(_parity, "convbn", 0.9, 3, {"bucket_cap_mb": 1e-6}))
    _assert_same(dist2.run(_parity, "branchy", 0.0, 3, {"bucket_cap_mb": 1e-6, "find_unused_parameters": True}))


def test_matches_torch_ddp_unused_with_flag(dist2):
    # "never" is unused everywhere; "sometimes" is unused on rank 1 every other step.
    results = dist2.run(_parity, "branchy", 0.9, 4, {"find_unused_parameters": True})
    _assert_same(results)
    assert "never.weight.grad" not in results[0][0]
    # Every parameter used on rank 0; rank 1 alone misses "sometimes" every other step.
    _assert_same(dist2.run(_parity, "branchy", 0.9, 4, {"find_unused_parameters": True}, 1, True))


@pytest.mark.parametrize("kwargs", [{}, {"bucket_cap_mb": 1e-3}, {"find_unused_parameters": True}])
def test_matches_torch_ddp_three_ranks(dist3, kwargs):
    # Three addends: gloo sums each element in an order set by where it lies
    # in its bucket, so bitwise equality needs torch's bucket layout exactly.
    _assert_same(dist3.run(_parity, "convbn", 0.9, 3, kwargs))
    _assert_same(dist3.run(_parity, "embed", 0.9, 3, kwargs))


@pytest.mark.parametrize("name", ["convbn", "wide"])
def test_matches_torch_ddp_past_the_logged_iterations(dist2, dist3, name):
    # From the eleventh step on (the buckets rebuilt, torch's logged iterations over) the gradient hooks take
    # their short path; "wide" has a parameter staged the moment it is ready. Accumulation under no_sync too.
    _assert_same(dist2.run(_parity, name, 0.9, 14, {}))
    _assert_same(dist2.run(_parity, name, 0.9, 13, {}, 2))
    _assert_same(dist3.run(_parity, name, 0.9, 13, {"bucket_cap_mb": 1e-3}))


def test_no_sync_matches_torch(dist2):
    # Buffers: like torch, a forward broadcasts them only when the previous
    # forward synchronised, so after gradient accumulation rank 1's BatchNorm
    # statistics are its own until the next step's first forward: compared too.
    _assert_same(dist2.run(_parity, "convbn", 0.9, 2, {}, 3))


def _no_sync_then_unused(steps: int) -> list[dict]:
    # "sometimes" is used in the no_sync micro-batch on rank 0 only, and by
    # nobody in the synchronised one: its accumulated gradient must still be
    # averaged (rank 1 contributes zeros), or the replicas drift apart.
    out = []
    for model in pair("branchy", find_unused_parameters=True):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(steps):
            opt.zero_grad()
            x, y = batch("branchy", 100 * step + dist.get_rank())
            with model.no_sync():
                nn.functional.cross_entropy(model(x, branch=dist.get_rank() == 0), y).backward()
            nn.functional.cross_entropy(model(x, branch=False), y).backward()
            opt.step()
        out.append(state(model))
    return [out]


def test_no_sync_with_find_unused_reduces_what_no_sync_accumulated(dist2):
    results = dist2.run(_no_sync_then_unused, 3)
    _assert_same([r[0] for r in results])
    # And the replicas agree with each other (the divergence this prevents).
    (ours0, _), (ours1, _) = results[0][0], results[1][0]
    for k in ours0:
        torch.testing.assert_close(ours0[k], ours1[k], rtol=0, atol=0)


def test_gradient_as_bucket_view_matches_torch(dist2):
    _assert_same(dist2.run(_parity, "embed", 0.9, 3, {"gradient_as_bucket_view": True}))
    _assert_same(dist2.run(_parity, "convbn", 0.0, 2, {"gradient_as_bucket_view": True}, 2))


def _grads_are_bucket_views() -> bool:
    model = ddpkit.DDP(make("plain"), gradient_as_bucket_view=True)
    x, y = batch("plain", dist.get_rank())
    for _ in range(2):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
    storages = {b.flat.untyped_storage().data_ptr() for b in model.reducer.buckets}
    return all(p.grad.untyped_storage().data_ptr() in storages for p in model.parameters())


def test_gradient_as_bucket_view_shares_memory(dist2):
    assert dist2.run(_grads_are_bucket_views) == [True, True]


def _global_batch(steps: int) -> tuple[dict, dict]:
    world = dist.get_world_size()
    ours = train(ddpkit.DDP(make("plain")), "plain", steps, 0.9)
    ref = make("plain")
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        shards = [batch("plain", 1000 + 100 * step + 10 * r) for r in range(world)]
        x, y = torch.cat([s[0] for s in shards]), torch.cat([s[1] for s in shards])
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    return state(ours), state(ref)


def test_matches_single_process_global_batch(dist2):
    # The global-batch mean sums the per-sample gradients in a different order
    # than two half-batch means averaged across ranks: float32 rounding
    # differences of a few ulps, grown by 3 momentum steps; 1e-5 is ~100 ulps.
    _assert_same(dist2.run(_global_batch, 3), rtol=1e-5, atol=1e-6)


class _WithIgnored(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.a, self.b, self.bn = nn.Linear(4, 4), nn.Linear(4, 2), nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.bn(self.a(x) * self.w))


def _buffer_and_ignore_rules(engine: str, kwargs: dict, ignore: list[str]) -> tuple[list[str], dict]:
    """Rank-local initial weights and statistics; what the construction and three steps leave, and the warnings."""
    import warnings

    from ddpkit._reference import torch_ddp

    torch.manual_seed(dist.get_rank())
    module = _WithIgnored()
    module.bn.running_var.fill_(dist.get_rank() + 2.0)
    cls = ddpkit.DDP if engine == "ddpkit" else TorchDDP
    if ignore:
        cls._set_params_and_buffers_to_ignore_for_model(module, ignore)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ddpkit.DDP(module, **kwargs) if engine == "ddpkit" else torch_ddp(module, **kwargs)
    states = {f"init {k}": v.clone() for k, v in module.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    states.update({k: v.clone() for k, v in module.state_dict().items()})
    states.update({f"{n}.grad": p.grad.clone() for n, p in module.named_parameters()})
    return sorted({type(w.message).__name__ for w in caught if "buffers" in str(w.message)}), states


@pytest.mark.parametrize("kwargs, ignore", [
    ({}, ["a.weight", "bn.running_mean", "w"]),
    ({"broadcast_buffers": False}, []),
    ({"forward_sync_buffers": False}, []),
    ({"broadcast_buffers": True, "forward_sync_buffers": False}, ["b.bias"]),
])
def test_buffer_sync_flags_and_ignored_parameters_follow_torch(dist2, kwargs, ignore):
    # Ignored names are neither broadcast nor reduced (a root parameter is still reduced: torch
    # matches those as ".w"); broadcast_buffers=False keeps buffers out of the construction
    # broadcast too, forward_sync_buffers=False does not; broadcast_buffers warns as deprecated.
    ours = dist2.run(_buffer_and_ignore_rules, "ddpkit", kwargs, ignore)
    theirs = dist2.run(_buffer_and_ignore_rules, "torch", kwargs, ignore)
    for (warned, got), (t_warned, want) in zip(ours, theirs):
        assert warned == t_warned
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
    if "a.weight" in ignore:
        (_, r0), (_, r1) = ours
        assert not torch.equal(r0["a.weight.grad"], r1["a.weight.grad"])  # not reduced
        assert torch.equal(r0["w.grad"], r1["w.grad"])


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict:
        h = self.body(x)
        return {"a": torch.exp(self.a(h)), "b": self.b(h), "n": 7}


def _outputs_through_the_sink(engine: str, kwargs: dict, heads: str, inplace: bool) -> tuple[list, dict]:
    """Steps whose loss uses ``heads`` (an in-place change to head "a" first if ``inplace``): what each did."""
    from ddpkit._reference import torch_ddp

    torch.manual_seed(0)
    module = _TwoHeads()
    model = ddpkit.DDP(module, **kwargs) if engine == "ddpkit" else torch_ddp(module, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    log = []
    for step in range(2 if inplace else 3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        opt.zero_grad()
        out = model(x)
        if inplace:
            out["a"].mul_(2)  # legal only on a copy: exp saved its output for backward
        try:
            sum(out[h].sum() for h in heads).backward()
        except RuntimeError as e:
            log.append(("error", "modified by an inplace operation" in str(e)))
            break
        log.append(("ok", out["n"], sorted(n for n, p in module.named_parameters() if p.grad is None)))
        opt.step()
    return log, {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("kwargs, heads, inplace", [
    ({"find_unused_parameters": True}, "a", False),
    ({"find_unused_parameters": True, "gradient_as_bucket_view": True}, "a", False),
    ({"find_unused_parameters": True}, "a", True),
    ({"static_graph": True}, "ab", True),
])
def test_outputs_pass_through_torchs_sink(dist2, kwargs, heads, inplace):
    # torch's sink: with find_unused_parameters every forward's outputs are copies (in-place changes
    # are legal), with a static graph only the first one's; an output the loss leaves out gets no
    # gradient (None, not zeros: SGD's weight decay then skips its head).
    ours = dist2.run(_outputs_through_the_sink, "ddpkit", kwargs, heads, inplace)
    theirs = dist2.run(_outputs_through_the_sink, "torch", kwargs, heads, inplace)
    for (log, got), (t_log, want) in zip(ours, theirs):
        assert log == t_log
        for k in want:
            assert torch.equal(got[k], want[k]), k


def _sparse_training(engine: str, kwargs: dict, hook: bool, micro: int, skip_bag_on: int = -1) -> list:
    """Three optimizer steps of ``micro`` backwards each (no_sync but the last): gradients (layout, values),
    then the parameters. ``skip_bag_on``: the step at which no rank uses the EmbeddingBag."""
    from ddpkit._reference import torch_ddp

    torch.manual_seed(0)
    module = SparseEmbeddings()
    group = None if engine == "ddpkit" else torch_sparse_group()
    model = ddpkit.DDP(module, **kwargs) if engine == "ddpkit" else torch_ddp(module, process_group=group, **kwargs)
    if hook:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(group, allreduce_hook)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    seen = []
    for step in range(3):
        opt.zero_grad()
        for k in range(micro):
            g = torch.Generator().manual_seed(100 * step + 10 * k + dist.get_rank())
            x, y = torch.randint(0, 50, (4, 5), generator=g), torch.randint(0, 30, (4, 3), generator=g)
            sync = contextlib.nullcontext() if k == micro - 1 else model.no_sync()
            with sync:
                model(x, None if step == skip_bag_on else y).square().sum().backward()
        seen.append([(p.grad is not None and p.grad.is_sparse,
                      None if p.grad is None else p.grad.to_dense().clone()) for p in module.parameters()])
        opt.step()
    return seen + [[p.detach().clone() for p in module.parameters()]]


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("kwargs, hook, micro", [
    ({}, False, 1), ({"find_unused_parameters": True}, False, 1), ({"gradient_as_bucket_view": True}, False, 1),
    ({"static_graph": True}, False, 1), ({}, True, 1), ({}, False, 2), ({"bucket_cap_mb": 0}, False, 1),
])
def test_sparse_embedding_gradients_are_averaged_as_torch_does(dist2, kwargs, hook, micro):
    # nn.Embedding / EmbeddingBag(sparse=True): each such parameter gets a bucket of its own and its
    # sparse gradient is divided, all-reduced and left sparse in .grad, as under torch's DDP.
    ours = dist2.run(_sparse_training, "ddpkit", kwargs, hook, micro)
    theirs = dist2.run(_sparse_training, "torch", kwargs, hook, micro)
    assert _same(ours, theirs)


def _sparse_reductions_in_flight(static_graph: bool, uneven: bool) -> list[int]:
    """For each sparse all-reduce: how many other all-reduces of the group were running when it started, or
    started while it ran."""
    launched: list = []
    counts: list[int] = []
    real = dist.all_reduce

    def watched(tensor, *args, **kwargs):
        running = [(w, sparse) for w, sparse in launched if not w.is_completed()]
        work = real(tensor, *args, **kwargs)
        if tensor.is_sparse or any(sparse for _, sparse in running):
            counts.append(len(running))
        if work is not None:
            launched.append((work, tensor.is_sparse))
        return work

    dist.all_reduce = watched
    try:
        torch.manual_seed(0)
        module = SparseEmbeddings()
        model = ddpkit.DDP(module, static_graph=static_graph)
        steps = 4 + dist.get_rank() if uneven else 4
        with model.join(enable=uneven):  # uneven: join's own all-reduces run beside the buckets'
            for step in range(steps):
                g = torch.Generator().manual_seed(step + dist.get_rank())
                x, y = torch.randint(0, 50, (4, 5), generator=g), torch.randint(0, 30, (4, 3), generator=g)
                model(x, y).square().sum().backward()
    finally:
        dist.all_reduce = real
    return counts


@pytest.mark.parametrize("static_graph, uneven", [(False, False), (True, False), (False, True)])
def test_a_sparse_reduction_runs_alone(dist2, static_graph, uneven):
    # gloo's sparse all-reduce corrupts the heap when another all-reduce of its group runs at the same time
    # (torch 2.13: two asynchronous ones, sparse and sparse or sparse and dense, crash two ranks within seconds;
    # this model's two sparse buckets and its dense one go out back to back, and join adds its own): the
    # reducer waits for what is running before a sparse reduction, and for the sparse one before anything else.
    for counts in dist2.run(_sparse_reductions_in_flight, static_graph, uneven):
        assert len(counts) >= 8 and not any(counts), counts


def test_a_sparse_parameter_unused_everywhere_keeps_its_gradient(dist2):
    # torch's reducer stops with "Expected sparse gradient to be defined"; ddpkit sends an empty sparse
    # gradient and, as for dense parameters unused on every rank, leaves .grad alone.
    for seen in dist2.run(_sparse_training, "ddpkit", {"find_unused_parameters": True}, False, 1, 1):
        assert seen[1][1] == (False, None) and seen[0][1][0] and seen[2][1][0]  # bag.weight: None at step 1


class _DropSecond(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple:
        return g, None  # b's branch gets no gradient: its parameters' hooks run with none


class _NoGradBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DropSecond.apply(self.a(x), self.b(x))


def _hooks_without_gradient(engine: str, kwargs: dict) -> list:
    from ddpkit._reference import torch_ddp

    torch.manual_seed(0)
    module = _NoGradBranch()
    model = ddpkit.DDP(module, **kwargs) if engine == "ddpkit" else torch_ddp(module, **kwargs)
    seen = []
    for step in range(3):
        model(torch.randn(4, 3) + dist.get_rank() + step).sum().backward()
        seen.append([None if p.grad is None else p.grad.clone() for p in module.parameters()])
    return seen


@pytest.mark.parametrize("kwargs", [{}, {"find_unused_parameters": True}, {"static_graph": True}])
def test_a_hook_that_runs_without_a_gradient_counts_as_torch_counts_it(dist2, kwargs):
    # Plain DDP reduces zeros for it (and writes the average back); with a used-map it is ready but unused.
    ours = dist2.run(_hooks_without_gradient, "ddpkit", kwargs)
    theirs = dist2.run(_hooks_without_gradient, "torch", kwargs)
    assert _same(ours, theirs)


def _construction_broadcast() -> list[torch.Tensor]:
    torch.manual_seed(dist.get_rank())  # different initial weights on each rank
    net = make("convbn", seed=dist.get_rank())
    net.bn.running_mean.fill_(float(dist.get_rank()))
    model = ddpkit.DDP(net)
    after_init = [t.clone() for t in net.state_dict().values()]
    net.bn.running_var.fill_(float(dist.get_rank() + 2))
    model.eval()
    with torch.no_grad():
        model(batch("convbn", 0)[0])  # broadcasts buffers first
    quiet = ddpkit.DDP(make("convbn"), broadcast_buffers=False)
    quiet.module.bn.running_var.fill_(float(dist.get_rank() + 2))
    quiet.eval()
    with torch.no_grad():
        quiet(batch("convbn", 0)[0])
    return after_init + [net.bn.running_var.clone(), quiet.module.bn.running_var.clone()]


def test_parameters_and_buffers_broadcast_from_rank0(dist2):
    r0, r1 = dist2.run(_construction_broadcast)
    for a, b in zip(r0[:-1], r1[:-1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert r0[-2].eq(2).all() and r1[-2].eq(2).all()  # forward broadcast rank 0's running_var
    assert r1[-1].eq(3).all()  # broadcast_buffers=False leaves rank 1's alone


def _mismatch() -> str:
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2 + dist.get_rank()))
    try:
        ddpkit.DDP(net)
    except RuntimeError as e:  # torch's type for this mistake (also a ValueError)
        assert isinstance(e, ValueError)
        return str(e)
    return "no error"


def test_parameter_mismatch_raises_on_every_rank(dist2):
    for msg in dist2.run(_mismatch):
        assert "'1.weight'" in msg and "rank 0 has '1.weight' shape [2, 4]" in msg
        assert "rank 1 has '1.weight' shape [3, 4]" in msg


def _strides_differ() -> str:
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1))
    if dist.get_rank() == 1:
        net = net.to(memory_format=torch.channels_last)  # the same shapes, another memory order
    try:
        ddpkit.DDP(net)
    except RuntimeError as e:
        return str(e)
    return "no error"


def _harmless_strides() -> str:
    # A dimension of 1 with another stride, and a frozen parameter in another memory order: no element moves in
    # a bucket (the frozen one is in none), so nothing is refused.
    net = nn.Sequential(nn.Linear(4, 1), nn.Conv2d(3, 4, 3))
    net[1].requires_grad_(False)
    if dist.get_rank() == 1:
        with torch.no_grad():
            net[0].weight = nn.Parameter(torch.empty_strided((1, 4), (1, 1)).copy_(net[0].weight))  # [1, 4]
        net[1].weight = nn.Parameter(net[1].weight.detach().to(memory_format=torch.channels_last),
                                     requires_grad=False)
    ddpkit.DDP(net)
    return str(net[0].weight.stride())


def test_parameters_in_another_memory_order_on_one_rank_are_refused_on_every_rank(dist2):
    # Averaged element by element in each one's memory order, they were silently mixed up. torch's DDP refuses
    # too ("appears not to match strides"), on the rank that differs (the other waits for it until its timeout).
    for msg in dist2.run(_strides_differ):
        assert "first difference at parameter #0 '0.weight'" in msg and "strides [27, 9, 3, 1]" in msg, msg
        assert "rank 1 has '0.weight' shape [4, 3, 3, 3] strides [27, 1, 9, 3]" in msg, msg
    assert dist2.run(_harmless_strides) == ["(4, 1)", "(1, 1)"]


def test_a_static_graph_with_find_unused_parameters_warns_as_torchs_does():
    with pytest.warns(UserWarning, match="find_unused_parameters=True is not needed with a static graph"):
        ddpkit.DDP(nn.Linear(2, 2), static_graph=True, find_unused_parameters=True)
    model = ddpkit.DDP(nn.Linear(2, 2))
    assert model._has_rebuilt_buckets is False  # torch's attribute (its ZeRO overlap hook reads it)
    for _ in range(2):
        model(torch.randn(3, 2)).sum().backward()
    assert model._has_rebuilt_buckets is True


def _seen_by_a_gradient_hook(engine: str, cap: float) -> list[list[float]]:
    from ddpkit._reference import torch_ddp

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model = ddpkit.DDP(module, bucket_cap_mb=cap) if engine == "ddpkit" else torch_ddp(module, bucket_cap_mb=cap)
    seen = []
    for p in module.parameters():  # registered after wrapping, as a user's optimizer-in-backward or logging hook
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.flatten().tolist()))
    for _ in range(2):  # the second backward after the rebuild
        seen.clear()
        model(torch.randn(5, 4) + dist.get_rank()).square().sum().backward()
    return sorted(seen) + [[float(p.grad.sum())] for p in module.parameters()]


def test_a_gradient_hook_sees_the_local_gradient_whatever_the_buckets(dist2):
    # A bucket of one parameter was reduced inside .grad itself: the hook saw it divided by the world size, and
    # the all-reduce could still be writing into it. torch reduces a copy.
    for cap in (1e-6, 25.0):
        assert dist2.run(_seen_by_a_gradient_hook, "ddpkit", cap) == dist2.run(_seen_by_a_gradient_hook, "torch", cap)


class _CheckpointedTail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)

    def tail(self, t: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(t)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.tail, self.a(x), use_reentrant=True)


def _reentrant_tail(engine: str, kwargs: dict) -> list[list[float]]:
    from ddpkit._reference import torch_ddp

    torch.manual_seed(0)
    module = _CheckpointedTail()
    model = ddpkit.DDP(module, **kwargs) if engine == "ddpkit" else torch_ddp(module, **kwargs)
    grads = []
    for step in range(3):
        module.zero_grad()
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * dist.get_rank() + step))).sum().backward()
        grads.append([float(p.grad.sum()) for p in module.parameters()])
    return grads


@pytest.mark.parametrize("kwargs", [{}, {"static_graph": True}, {"gradient_as_bucket_view": True}])
def test_a_reentrant_checkpoint_around_the_last_block_trains_as_under_torch(dist2, kwargs):
    # The first gradients arrive inside the checkpoint's own backward; the parameters in front of it ('a') were
    # reported unused when that inner backward ended.
    assert dist2.run(_reentrant_tail, "ddpkit", kwargs) == dist2.run(_reentrant_tail, "torch", kwargs)


def _builtin_hook_in_a_subgroup(engine: str) -> list[float]:
    from ddpkit._reference import torch_ddp

    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]  # every rank alone
    module = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        module.weight.fill_(1.0)
    model = ddpkit.DDP(module, process_group=alone) if engine == "ddpkit" else torch_ddp(module, process_group=alone)
    model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    model(torch.full((1, 1), 2.0 * (dist.get_rank() + 1))).sum().backward()
    return module.weight.grad.flatten().tolist()


def test_a_builtin_comm_hook_reduces_over_the_models_group(dist2):
    # It reduced over the world whatever the model's group (3.0 on both ranks here, where torch keeps 2.0 and 4.0).
    ours, theirs = dist2.run(_builtin_hook_in_a_subgroup, "ddpkit"), dist2.run(_builtin_hook_in_a_subgroup, "torch")
    assert ours == theirs == [[2.0], [4.0]]


def _unused_without_flag(everywhere: bool) -> str:
    model = ddpkit.DDP(make("branchy"))
    x, y = batch("branchy", dist.get_rank())
    branch = not everywhere and dist.get_rank() == 0
    try:
        nn.functional.cross_entropy(model(x, branch=branch), y).backward()
    except UnusedParametersError as e:
        return str(e)
    return "ok"


def test_unused_parameter_without_flag_raises_naming_it(dist2):
    for msg in dist2.run(_unused_without_flag, True):
        assert "'sometimes.weight'" in msg and "'never.bias'" in msg and "find_unused_parameters=True" in msg
    # "sometimes" used on rank 0 only, "never" nowhere: each rank raises naming
    # what it missed itself (rank 1 also "sometimes"), and nobody hangs.
    r0, r1 = dist2.run(_unused_without_flag, False, timeout=60)
    assert "'never.weight'" in r0 and "'sometimes.weight'" not in r0
    assert "'sometimes.weight'" in r1 and "'never.weight'" in r1


def _unused_everywhere_keeps_grad() -> list:
    model = ddpkit.DDP(make("branchy"), find_unused_parameters=True)
    marker = torch.full_like(model.module.never.weight, 7.0)
    model.module.never.weight.grad = marker.clone()
    x, y = batch("branchy", dist.get_rank())
    nn.functional.cross_entropy(model(x, branch=dist.get_rank() == 0), y).backward()
    return [model.module.never.weight.grad, model.module.never.bias.grad, model.module.sometimes.weight.grad]


def test_unused_everywhere_keeps_grad_untouched(dist2):
    (w0, b0, s0), (w1, b1, s1) = dist2.run(_unused_everywhere_keeps_grad)
    assert w0.eq(7).all() and w1.eq(7).all() and b0 is None and b1 is None
    torch.testing.assert_close(s0, s1, rtol=0, atol=0)  # rank 1 contributed zeros, got the average


class _Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, *, scale=1.0, as_dict=False):
        y = self.lin(x) * scale
        return {"y": y, "pair": (y.sum(), [y])} if as_dict else (y, y.sum())


def _structures() -> list:
    inner = _Structured()
    model = ddpkit.DDP(inner)
    x = torch.ones(2, 3)
    out = model(x, scale=2.0, as_dict=True)
    out["pair"][0].backward()
    y, s = model(x)
    s.backward()
    return [model.module is inner, ddpkit.unwrap(model) is inner, sorted(out), type(out["pair"][1]).__name__]


def test_forward_passes_arguments_and_structures(dist2):
    assert dist2.run(_structures)[0] == [True, True, ["pair", "y"], "list"]


def test_world_size_one_without_process_group():
    net = make("plain")
    ref = make("plain")
    model = ddpkit.DDP(net)
    assert model.world_size == 1
    train(model, "plain", 2, 0.9)
    train(ref, "plain", 2, 0.9)
    for k, v in state(ref).items():
        torch.testing.assert_close(state(model)[k], v, rtol=0, atol=0)


def test_unwrap():
    net = nn.Linear(2, 2)
    assert ddpkit.unwrap(net) is net
    assert ddpkit.unwrap(ddpkit.DDP(net)) is net
    ddpkit.init()  # torch's DDP needs a process group: a world of one
    assert ddpkit.unwrap(TorchDDP(net)) is net
    assert ddpkit.unwrap(torch.compile(net)) is net
    assert ddpkit.unwrap(torch.compile(ddpkit.DDP(net))) is net


def test_rejects_bad_arguments():
    # Each with the exception type torch's DDP raises for the same mistake.
    with pytest.raises(ValueError, match="bucket_cap_mb=-1 must be a number of MiB >= 0"):
        ddpkit.DDP(nn.Linear(2, 2), bucket_cap_mb=-1)
    with pytest.raises(ValueError, match=r"output_device=1\) only works with a single-device GPU module"):
        ddpkit.DDP(nn.Linear(2, 2), output_device=1)
    with pytest.raises(RuntimeError, match="meta device"):
        ddpkit.DDP(nn.Linear(2, 2, device="meta"))
    with pytest.raises(TypeError, match="process_group='world' is not a torch.distributed.ProcessGroup"):
        ddpkit.DDP(nn.Linear(2, 2), process_group="world")
    with pytest.raises(ValueError, match="SyncBatchNorm layers only work with GPU modules"):
        ddpkit.DDP(nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2)))
    with pytest.raises(RuntimeError, match="no parameter that requires grad"):
        ddpkit.DDP(nn.Linear(2, 2).requires_grad_(False))
    with pytest.raises(ValueError, match=r"device_ids=\[0\]\) only works with a GPU module"):
        ddpkit.DDP(nn.Linear(2, 2), device_ids=[0])
    with pytest.raises(RuntimeError, match="uninitialized"):
        ddpkit.DDP(nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"mixed_precision=...\): not supported"):
        ddpkit.DDP(nn.Linear(2, 2), mixed_precision=True)
    with pytest.raises(TypeError, match="device_mesh=True is not a torch.distributed.device_mesh.DeviceMesh"):
        ddpkit.DDP(nn.Linear(2, 2), device_mesh=True)
    with pytest.raises(TypeError, match="dim="):
        ddpkit.DDP(nn.Linear(2, 2), dim="0")


def _on_a_device_mesh(engine: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(dist.get_rank())  # different on each rank: the construction broadcast makes them agree
    model = (ddpkit.DDP if engine == "ddpkit" else TorchDDP)(nn.Linear(4, 2), device_mesh=mesh)
    model(torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))).sum().backward()
    errors = []
    for bad in ({"device_mesh": mesh, "process_group": dist.group.WORLD},
                {"device_mesh": init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("tp", "dp"))}):
        try:
            (ddpkit.DDP if engine == "ddpkit" else TorchDDP)(nn.Linear(4, 2), **bad)
        except RuntimeError as e:
            errors.append(str(e))
    return {"grad": model.module.weight.grad, "weight": model.module.weight.detach(),
            "mesh": model.device_mesh is mesh, "errors": errors}


def test_a_one_dimensional_device_mesh_stands_for_its_group_as_under_torch(dist2):
    for ours, theirs in zip(dist2.run(_on_a_device_mesh, "ddpkit"), dist2.run(_on_a_device_mesh, "torch")):
        assert torch.equal(ours["grad"], theirs["grad"]) and torch.equal(ours["weight"], theirs["weight"])
        assert ours["mesh"] and theirs["mesh"]
        assert "Cannot specify both process_group and device_mesh" in ours["errors"][0]
        assert "Only 1D device mesh is supported" in ours["errors"][1] and "mesh['dp']" in ours["errors"][1]


def test_accepts_what_torch_accepts_and_offers_its_attributes():
    import warnings

    # bucket_cap_mb=0 is a bucket per parameter; device_ids=[] means none; output_device=0 passes (torch's quirk).
    model = ddpkit.DDP(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)), bucket_cap_mb=0, device_ids=[],
                       output_device=0)
    assert model.bucket_bytes_cap == 0 and model.reducer.limits == [0]  # the rebuild: one parameter per bucket
    assert model.device_ids is None and model.output_device is None
    assert (model.device, model.device_type, model.is_multi_device_module) == (torch.device("cpu"), "cpu", False)
    assert [b.shape for b in model.modules_buffers] == [torch.Size([3]), torch.Size([3]), torch.Size([])]
    assert list(model.named_module_buffers) == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert model.will_sync_module_buffers() is True  # torch's reading, whatever the world size
    ddpkit.DDP._set_params_and_buffers_to_ignore_for_model(model.module, ["0.bias"])
    assert [p.shape for p in ddpkit.DDP._get_data_parallel_params(model.module)] == [(3, 2), (3,), (3,)]
    # Other joinables' keywords pass through join_hook, as torch's Join hands them to every joinable.
    assert model.join_hook(divide_by_initial_world_size=False, foo=1).ddp is model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddpkit.DDP(nn.Linear(2, 2), check_reduction=True)
        static = ddpkit.DDP(nn.Linear(2, 2), find_unused_parameters=True)
        static._set_static_graph()
        static._set_static_graph()
    said = [str(w.message) for w in caught]
    assert any("check_reduction" in m for m in said) and any("find_unused_parameters=True is not needed" in m
                                                             for m in said)
    assert any("no need to set it again" in m for m in said)


def _comm_hook_checks() -> list:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from ddpkit._reference import torch_ddp

    def wrong_bucket(state, bucket: int):
        return allreduce_hook(state, bucket)

    def wrong_return(state, bucket) -> int:
        return allreduce_hook(state, bucket)

    def no_bucket(state, b):
        return allreduce_hook(state, b)

    def annotated(state, bucket):
        return allreduce_hook(state, bucket)

    # Real annotations (this file's are strings: from __future__ import annotations).
    annotated.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}

    seen = []
    for engine in ("ddpkit", "torch"):
        got = []
        for hook in (wrong_bucket, wrong_return, no_bucket, annotated, ddpkit.hooks.allreduce_hook):
            model = ddpkit.DDP(nn.Linear(2, 2)) if engine == "ddpkit" else torch_ddp(nn.Linear(2, 2))
            try:
                model.register_comm_hook(None, hook)
                got.append("ok")
            except (KeyError, ValueError) as e:
                got.append(sorted(c.__name__ for c in (KeyError, ValueError) if isinstance(e, c)))
        seen.append(got)
    return seen


def test_comm_hook_signatures_are_checked_as_torch_checks_them(dist2):
    ours, theirs = dist2.run(_comm_hook_checks)[0]
    # ddpkit's own hooks carry real annotations, so torch's DDP takes them (tests/comm/test_hooks.py trains with
    # them on both). ddpkit's check also reads annotations written as strings (a hook in a file with
    # `from __future__ import annotations`), which torch compares unread and refuses: such a hook of a user's runs
    # on ddpkit's DDP and not on torch's (the error then is torch's own).
    assert ours == [["ValueError"], ["ValueError"], ["KeyError", "ValueError"], "ok", "ok"]
    assert theirs == [["ValueError"], ["ValueError"], ["KeyError"], "ok", "ok"]


def _surface(engine: str) -> dict:
    import ddpkit.parallel.common.unused

    ddpkit.parallel.common.unused._warned_nothing_unused = False  # once per process: this worker may have said it
    torch.manual_seed(0)
    model = (ddpkit.DDP if engine == "ddpkit" else TorchDDP)(nn.Linear(3, 2), find_unused_parameters=True)
    x = torch.arange(6.0).view(2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(x)
        out.sum().backward()
    attrs = {k: getattr(model, k) for k in ("broadcast_bucket_size", "use_side_stream_for_tensor_copies",
                                            "mixed_precision", "skip_all_reduce_unused_params", "batched_grad_copy")}
    inputs, kwargs = model.to_kwargs((x,), {"scale": x[:1]}, 0)
    moved = [[t.tolist() for t in args] for args in inputs], [{k: v.tolist() for k, v in kw.items()} for kw in kwargs]
    return {"sink": type(out.grad_fn).__name__, "attrs": attrs, "moved": moved,
            "warned": [str(w.message)[:60] for w in caught if "find_unused_parameters=True" in str(w.message)]}


def test_torchs_helpers_attributes_and_sink_name(dist2):
    ours, theirs = dist2.run(_surface, "ddpkit")[0], dist2.run(_surface, "torch")[0]
    # torch prints its warning from C++ (to stderr); ddpkit says it once per process as a Python warning.
    assert ours.pop("warned") == ["find_unused_parameters=True was specified in DDP constructor"]
    theirs.pop("warned")
    assert ours == theirs and ours["sink"] == "_DDPSinkBackward"


def _done(value: object) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


@pytest.mark.parametrize("result, message", [
    (lambda bucket: None, "returned NoneType for bucket 0; a comm hook must return a torch.futures.Future"),
    (lambda bucket: bucket.buffer(), "returned Tensor for bucket 0"),
    (lambda bucket: _done(None), "future for bucket 0 holds NoneType; it must hold the reduced bucket, a tensor of 8"),
    (lambda bucket: _done(bucket.buffer()[:-1].clone()), "holds a tensor of 7 elements; it must hold the reduced"),
])
def test_a_comm_hook_that_returns_the_wrong_thing_is_a_clear_error(result, message):
    # torch crashes (None), or fails deep inside its reducer; ddpkit names the hook, the bucket and the fix.
    model = ddpkit.DDP(nn.Linear(3, 2))
    model.register_comm_hook(None, lambda state, bucket: result(bucket))
    for _ in range(2):  # and again: nothing is left half-done
        with pytest.raises(RuntimeError, match=message.replace("(", "\\(")):
            model(torch.randn(4, 3)).sum().backward()


def _builtin_hook(engine: str) -> list[torch.Tensor]:
    from ddpkit._reference import torch_ddp

    torch.manual_seed(0)
    module = nn.Linear(4, 3)
    model = ddpkit.DDP(module) if engine == "ddpkit" else torch_ddp(module)
    model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    model(torch.randn(5, 4) + dist.get_rank()).square().sum().backward()
    return [p.grad.clone() for p in module.parameters()]


def test_builtin_comm_hooks_by_type(dist2):
    for ours, theirs in zip(dist2.run(_builtin_hook, "ddpkit"), dist2.run(_builtin_hook, "torch")):
        for g, t in zip(ours, theirs):
            assert torch.equal(g, t)


def _cast_after_wrapping(steps: int = 0, as_view: bool = False) -> str:
    model = ddpkit.DDP(nn.Linear(4, 3), gradient_as_bucket_view=as_view)
    for _ in range(steps):  # past the first steps, the buckets rebuilt
        model(torch.randn(2, 4)).sum().backward()
        model.zero_grad()
    model.double()
    try:
        model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_model_cast_after_wrapping_is_a_clear_error(dist2):
    # torch's DDP silently stops averaging a parameter cast after wrapping.
    for message in dist2.run(_cast_after_wrapping):
        assert "parameter 'weight' is torch.float64 on cpu, but was torch.float32 on cpu" in message
        assert "before wrapping it" in message


@pytest.mark.parametrize("as_view", [False, True], ids=["copied", "bucket-view"])
def test_a_model_cast_after_some_steps_is_the_same_clear_error(dist2, as_view):
    # It averaged the float64 gradients through the float32 buckets (5e-8 off, without a word), or with
    # gradient_as_bucket_view raised torch's "attempting to assign a gradient with dtype 'float'", naming nothing.
    for message in dist2.run(_cast_after_wrapping, 3, as_view):
        assert "parameter 'bias' is torch.float64 on cpu, but was torch.float32 on cpu" in message


def test_accepts_torchs_arguments_in_torchs_order():
    # module, device_ids, output_device, dim, broadcast_buffers, init_sync, process_group, bucket_cap_mb
    model = ddpkit.DDP(nn.Linear(2, 2), None, None, 0, False, True, None, 5.0, False, True, True)
    assert (model.dim, model.broadcast_buffers, model.gradient_as_bucket_view) == (0, False, True)
    assert model.require_backward_grad_sync and model.require_forward_param_sync


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_world_size_one_with_nccl():
    ctx = ddpkit.init(backend="nccl")
    net = make("convbn").to(ctx.device)
    model = ddpkit.DDP(net, device_ids=[ctx.device.index])
    x, y = batch("convbn", 0)
    nn.functional.cross_entropy(model(x), y.to(ctx.device)).backward()
    assert all(p.grad is not None and p.grad.is_cuda for p in net.parameters())


def _reassigned_buffer() -> list[float]:
    model = ddpkit.DDP(make("convbn"))
    # A new tensor object after wrapping (as some models do when they reset
    # statistics): it must be found and broadcast from rank 0 all the same.
    model.module.bn.running_mean = torch.full((4,), float(dist.get_rank() + 1))
    model.eval()
    with torch.no_grad():
        model(batch("convbn", 0)[0])
    return model.module.bn.running_mean.tolist()


def test_buffers_reassigned_after_wrapping_are_broadcast(dist2):
    assert dist2.run(_reassigned_buffer) == [[1.0] * 4, [1.0] * 4]


def _forward_sync_flag() -> list[bool]:
    model = ddpkit.DDP(make("convbn"))
    x = batch("convbn", 0)[0]
    seen = [model.require_forward_param_sync]
    with model.no_sync():
        model(x).sum().backward()
    seen.append(model.require_forward_param_sync)
    model(x).sum().backward()
    seen.append(model.require_forward_param_sync)
    return seen


def test_require_forward_param_sync_follows_torch(dist2):
    # True at first, False after a no_sync forward, True after a synchronised one.
    assert dist2.run(_forward_sync_flag) == [[True, False, True]] * 2


def _no_sync_micro_batch_after_a_synchronised_forward(kwargs: dict) -> list:
    out = []
    for model in pair("convbn", **kwargs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            opt.zero_grad()
            x, y = batch("convbn", 100 * step + dist.get_rank())
            first = model(x)  # a synchronised forward whose backward comes last
            with model.no_sync():  # torch's reducer, armed by that forward, reduces this micro-batch's backward
                nn.functional.cross_entropy(model(x.flip(0)), y).backward()
            nn.functional.cross_entropy(first, y).backward()  # and this one accumulates locally
            opt.step()
        out.append(state(model))
    return [out]


@pytest.mark.parametrize("kwargs", [{}, {"find_unused_parameters": True}, {"bucket_cap_mb": 1e-3}])
def test_a_no_sync_micro_batch_between_a_forward_and_its_backward_is_reduced_as_under_torch(dist2, kwargs):
    # torch's quirk, kept: the replicas then differ (the last backward's gradient stays each rank's own), as they
    # do under torch's DDP
    _assert_same([r[0] for r in dist2.run(_no_sync_micro_batch_after_a_synchronised_forward, kwargs)])


def _two_forwards_then_backward() -> list:
    out = []
    for engine in (ddpkit.DDP, TorchDDP):
        model = engine(make("convbn"))
        tensors = [*model.module.buffers(), *model.module.parameters()]
        versions = [[t._version for t in tensors]]
        x, y = batch("convbn", dist.get_rank())
        for _ in range(2):
            # A second forward before backward re-broadcasts the BatchNorm buffers the first one saved for
            # backward: torch leaves their version counters alone, so backward still runs.
            first = model(x)
            with torch.no_grad():
                target = model(x.flip(0)).softmax(1)
            nn.functional.cross_entropy(first, target).backward()
            (model(x).sum() + model(x[:3]).sum()).backward()
            versions.append([t._version for t in tensors])
        out.append((state(model), versions))
    return out


def test_a_second_forward_before_backward_works_as_under_torch(dist2):
    for (ours, ours_versions), (theirs, theirs_versions) in dist2.run(_two_forwards_then_backward):
        assert ours_versions == theirs_versions
        _assert_same([(ours, theirs)])


def _gradient_penalty(kwargs: dict) -> list:
    # torch.autograd.grad through the model (WGAN-GP, R1), then backward of loss + penalty: only the second
    # pass accumulates parameter gradients, and it is the one that must be averaged.
    out = []
    for engine in (ddpkit.DDP, TorchDDP):
        torch.manual_seed(0)
        model = engine(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), **kwargs)
        for step in range(2):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            x.requires_grad_(True)
            loss = model(x).pow(2).mean()
            gx, = torch.autograd.grad(loss, x, create_graph=True)
            (loss + gx.pow(2).sum()).backward()
        out.append(state(model))
    return out


@pytest.mark.parametrize("kwargs", [{}, {"find_unused_parameters": True}, {"static_graph": True}])
def test_a_gradient_penalty_is_averaged(dist2, kwargs):
    results = dist2.run(_gradient_penalty, kwargs)
    if "static_graph" in kwargs:
        # torch's static graph counts the autograd.grad pass as the first backward and never averages
        # after it (the replicas drift apart); ddpkit averages, so both ranks agree.
        _assert_same([(results[0][0], results[1][0])])
        assert any(not torch.equal(results[0][1][k], results[1][1][k]) for k in results[0][1])
    else:
        _assert_same(results)


def _wrapped_again() -> list[dict]:
    import gc
    import weakref

    out = []
    for engine in (ddpkit.DDP, TorchDDP):
        net = make("convbn")
        first = engine(net)
        train(first, "convbn", 1, 0.9)
        reducer = weakref.ref(first.reducer) if engine is ddpkit.DDP else None
        del first
        gc.collect()
        if reducer is not None:
            # Neither the old reducer (and its buckets) nor its hooks outlive the wrapper, as in torch.
            assert reducer() is None
            assert all(len(p._post_accumulate_grad_hooks or {}) == 0 for p in net.parameters())
        second = engine(net)
        out.append(state(train(second, "convbn", 2, 0.9)))
        if reducer is not None:
            assert all(len(p._post_accumulate_grad_hooks) == 1 for p in net.parameters())
    return out


def test_a_dropped_wrapper_leaves_nothing_behind(dist2):
    # A module wrapped again after its first wrapper is dropped trains as under torch.
    _assert_same(dist2.run(_wrapped_again))


def _pickled_round_trip() -> list[dict]:
    import io

    model = ddpkit.DDP(make("convbn"))
    model.register_comm_hook(None, ddpkit.hooks.allreduce_hook)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.reducer is not model.reducer and loaded.reducer.comm_hook is None  # the hook is dropped
    return [state(train(m, "convbn", 2, 0.9)) for m in (model, loaded)]


def test_pickled_model_loads_and_trains_the_same(dist2):
    # Loaded in the same job, the copy rebuilds its reducer on the default group
    # and trains to the same numbers as the original (the hook only changed
    # where the division happens, not its result: both exact at world 2).
    for original, loaded in dist2.run(_pickled_round_trip):
        for k in original:
            torch.testing.assert_close(loaded[k], original[k], rtol=0, atol=0, msg=k)


def test_unpickling_without_a_process_group_is_a_clear_error():
    import pickle

    ddpkit.init()
    data = pickle.dumps(ddpkit.DDP(nn.Linear(2, 2)))
    ddpkit.shutdown()
    with pytest.raises(RuntimeError, match="call ddpkit.init\\(\\) before loading it"):
        pickle.loads(data)
    with pytest.raises(ValueError):  # torch's type
        pickle.loads(data)


@pytest.mark.slow("Accelerate's own test script, launched")
def test_accelerates_own_test_sync_passes_with_ddpkit_ddp():
    # Accelerate's test_sync.py (shipped in its wheel) with ddpkit's DDP in
    # place of torch's: no_sync, trigger_sync_in_backward (which sets
    # require_forward_param_sync and calls reducer.prepare_for_backward([])),
    # gradient accumulation with a scheduler, on two gloo ranks.
    pytest.importorskip("accelerate.test_utils.scripts.test_sync")
    from procs import launch, script

    done = launch("--nproc-per-node", "2", "--standalone", script("accelerate_sync.py"))
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: accelerate test_sync passed with ddpkit's DDP" in done.stdout
    assert "Test Distributed `no_sync` context manager with multiple forwards" in done.stdout

"""The reducer: bucket assignment, launch order, rebuild in arrival order, overlap."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.parallel.common.buckets import assign_buckets, initial_buckets
from ddpkit.parallel.common.deferred import DeferredReducer
from ddpkit.parallel.common.observer import BucketEvent, Observer
from ddpkit.parallel.common.reducer import ASSIGNMENT_MOVES, MOVES, Assignment, Phase, Reducer

MIB = 1024 * 1024


def _t(numel: int, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype)


def _random_case(seed: int) -> tuple[list[torch.Tensor], list[int], list[int]]:
    r = random.Random(seed)
    dtypes = r.sample([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64], r.randint(1, 4))
    params = [_t(r.choice([1, 7, 100, 1000, 5000, 30000]), r.choice(dtypes)) for _ in range(r.randint(1, 30))]
    limits = [r.choice([100, 4000, 20000, 100000, 10**9]) for _ in range(r.randint(1, 3))]
    order = list(range(len(params)))
    r.shuffle(order)
    return params, order, limits


def test_assign_buckets_is_torchs_assignment():
    # torch's own function is the oracle: arrival order (the rebuild), mixed
    # dtypes, one to three limits, parameters larger than a limit.
    for seed in range(400):
        params, order, limits = _random_case(seed)
        sparse = _random_sparse(seed, len(params))
        theirs, _ = dist._compute_bucket_assignment_by_size([params[i] for i in order], limits, sparse, order)
        assert assign_buckets(params, order, limits, sparse) == theirs, seed


def test_initial_buckets_are_torchs_registration_order_assignment_reversed():
    for seed in range(400):
        params, _, limits = _random_case(seed)
        sparse = _random_sparse(seed, len(params))
        theirs, _ = dist._compute_bucket_assignment_by_size(params, limits, sparse)
        assert initial_buckets(params, limits, sparse) == theirs[::-1], seed


def _random_sparse(seed: int, n: int) -> list[bool]:
    """No sparse parameter in half the cases; in the others, each parameter sparse with probability 1/4."""
    r = random.Random(seed + 10_000)
    return [False] * n if seed % 2 else [r.random() < 0.25 for _ in range(n)]


def test_a_bucket_closes_after_the_parameter_that_fills_it():
    params = [_t(10), _t(4 * MIB), _t(10), _t(10)]  # a 16 MiB parameter between small ones
    assert assign_buckets(params, [3, 2, 1, 0], [MIB]) == [[3, 2, 1], [0]]


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(300, 300), nn.Linear(300, 300)
        self.c, self.d = nn.Linear(300, 10), nn.Linear(300, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, nhead=4, dim_feedforward=512, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


_LAYOUTS = {
    "default": (_Encoder, {}),
    "cap": (_Encoder, {"bucket_cap_mb": 0.2}),
    "cap-list": (_Encoder, {"bucket_cap_mb_list": [0.05, 0.3, 0.1]}),
    "unused": (_Encoder, {"find_unused_parameters": True}),
    "unused-cap": (_Encoder, {"find_unused_parameters": True, "bucket_cap_mb": 0.2}),
    "static": (_Encoder, {"static_graph": True}),
    "branchy": (_Branchy, {"find_unused_parameters": True, "bucket_cap_mb": 0.3}),
    "last-small": (_Encoder, {"bucket_cap_mb": 0.2}),
    "last-small-cap-list": (_Encoder, {"bucket_cap_mb_list": [0.05, 0.3, 0.1]}),
}
_ENV = {"last-small": {"DDP_SET_LAST_BUCKET_CAP": "1"}, "last-small-cap-list": {"DDP_SET_LAST_BUCKET_CAP": "1"}}
"""Environment a case runs under (read by both engines at the rebuild)."""


def _bucket_layouts(engine: str, case: str) -> list:
    """For each of four backwards, each bucket a comm hook sees: index, parameters (as indices), size."""
    from ddpkit._reference import torch_ddp

    make, kwargs = _LAYOUTS[case]
    torch.manual_seed(0)
    module = make()
    index = {p.data_ptr(): i for i, p in enumerate(module.parameters())}
    model = ddpkit.DDP(module, **kwargs) if engine == "ddpkit" else torch_ddp(module, **kwargs)
    seen: list = []

    def record(state, bucket):
        seen[-1].append((bucket.index(), [index[p.data_ptr()] for p in bucket.parameters()],
                         bucket.buffer().numel(), bucket.is_last()))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model.register_comm_hook(None, record)
    x = torch.randn(2, 8, 64) if make is _Encoder else torch.randn(2, 300)
    env = _ENV.get(case, {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for _ in range(4):
            seen.append([])
            model(x).sum().backward()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    return seen


@pytest.mark.parametrize("case", sorted(_LAYOUTS))
def test_buckets_are_laid_out_as_torchs(dist2, case):
    # What a comm hook sees, backward by backward: before the rebuild, after it
    # (a static graph's comes a backward later; none with find_unused_parameters).
    ours = dist2.run(_bucket_layouts, "ddpkit", case)
    theirs = dist2.run(_bucket_layouts, "torch", case)
    assert ours == theirs


def _rebuild_under_no_sync(engine: str) -> tuple[bool, bool, list[torch.Tensor]]:
    """Whether the gradients moved into new buckets at a no_sync() forward, and at the next synced one."""
    from ddpkit._reference import torch_ddp

    torch.manual_seed(0)
    module = _Encoder()
    wrap = ddpkit.DDP if engine == "ddpkit" else torch_ddp
    model = wrap(module, gradient_as_bucket_view=True, bucket_cap_mb=0.2)
    x = torch.randn(2, 8, 64) + dist.get_rank()

    def where() -> list[int]:
        return [p.grad.data_ptr() for p in module.parameters()]

    model(x).sum().backward()
    before = where()
    with model.no_sync():
        out = model(x)
        at_no_sync = where() != before
        out.sum().backward()
    before = where()
    model(x).sum().backward()
    return at_no_sync, where() != before, [p.grad.clone() for p in module.parameters()]


def test_the_rebuild_comes_at_the_next_forward_with_grad_even_under_no_sync(dist2):
    # torch rebuilds at any forward with grad enabled: with gradient_as_bucket_view the
    # gradients move into the new buckets at the no_sync() forward, not at the next synced one.
    ours = dist2.run(_rebuild_under_no_sync, "ddpkit")
    theirs = dist2.run(_rebuild_under_no_sync, "torch")
    for (moved, later, grads), (t_moved, t_later, t_grads) in zip(ours, theirs):
        assert (moved, later) == (t_moved, t_later) == (True, False)
        for g, t in zip(grads, t_grads):
            assert torch.equal(g, t)


def _channels_last(engine: str, as_view: bool, hook: bool) -> tuple[list, list, list]:
    """A channels_last ConvNet: what a comm hook sees, the gradients' strides and values after two steps."""
    from ddpkit._reference import torch_ddp

    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(144, 5))
    module = module.to(memory_format=torch.channels_last)
    wrap = ddpkit.DDP if engine == "ddpkit" else torch_ddp
    model = wrap(module, gradient_as_bucket_view=as_view, bucket_cap_mb=0.001)
    seen: list = []
    if hook:
        def record(state, bucket):
            seen.append((bucket.buffer().clone(), [(g.shape, g.stride()) for g in bucket.gradients()]))
            return _allreduce_mean(bucket.buffer())

        model.register_comm_hook(None, record)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        opt.zero_grad()
        model(x.to(memory_format=torch.channels_last)).square().sum().backward()
        opt.step()
    return seen, [p.grad.stride() for p in module.parameters()], [p.grad.clone() for p in module.parameters()]


def _allreduce_mean(buffer: torch.Tensor) -> torch.futures.Future:
    return dist.all_reduce(buffer.div_(dist.get_world_size()), async_op=True).get_future().then(
        lambda f: f.value()[0])


@pytest.mark.parametrize("as_view", [False, True])
@pytest.mark.parametrize("hook", [False, True])
def test_channels_last_parameters_are_bucketed_in_memory_order_as_torch_does(dist2, as_view, hook):
    # torch's bucket views take the parameter's strides: the bucket holds a channels_last
    # gradient in memory order, and under gradient_as_bucket_view .grad keeps the layout.
    ours = dist2.run(_channels_last, "ddpkit", as_view, hook)
    theirs = dist2.run(_channels_last, "torch", as_view, hook)
    for (seen, strides, grads), (t_seen, t_strides, t_grads) in zip(ours, theirs):
        assert strides == t_strides
        assert len(seen) == len(t_seen)
        for (buf, layout), (t_buf, t_layout) in zip(seen, t_seen):
            assert layout == t_layout
            assert torch.equal(buf, t_buf)
        for g, t in zip(grads, t_grads):
            assert torch.equal(g, t)


def test_ddp_exposes_torchs_bucket_attributes():
    ddpkit.init()
    model = ddpkit.DDP(nn.Linear(2, 2))
    assert (model.bucket_bytes_cap, model.bucket_bytes_cap_default, model.bucket_bytes_cap_list) == (25 * MIB, True, [])
    model = ddpkit.DDP(nn.Linear(2, 2), bucket_cap_mb=4)
    assert (model.bucket_bytes_cap, model.bucket_bytes_cap_default) == (4 * MIB, False)
    model = ddpkit.DDP(nn.Linear(2, 2), bucket_cap_mb_list=[1, 8])
    assert (model.bucket_bytes_cap, model.bucket_bytes_cap_list) == (8 * MIB, [MIB, 8 * MIB])
    with pytest.raises(ValueError, match=r"bucket_cap_mb_list\[1\]=-2 must be a number of MiB >= 0"):
        ddpkit.DDP(nn.Linear(2, 2), bucket_cap_mb_list=[1, -2])


class _Crossed(nn.Module):
    """Registration order a, b, c; the forward order depends on the rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        layers = [self.a, self.b, self.c] if dist.get_rank() == 0 else [self.c, self.b, self.a]
        for layer in layers:
            x = torch.tanh(layer(x))
        return x.sum()


def _rebuild() -> list:
    torch.manual_seed(0)
    model = ddpkit.DDP(_Crossed(), bucket_cap_mb=1e-6)  # one parameter per bucket
    names = [n for n, _ in model.module.named_parameters()]
    before = model.reducer.layout.set.indices()
    timeline = _Timeline()
    model.register_observer(timeline)
    model.register_comm_hook(None, ddpkit.hooks.allreduce_hook)
    for _ in range(3):
        model(torch.ones(2, 4)).backward()
    after = [names[b[0]] for b in model.reducer.layout.set.indices()]
    return [[[names[i] for i in b] for b in before], after, timeline.seen[-12:]]


class _Timeline(Observer):
    """The engine's bucket events in the order they came."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def on_bucket_ready(self, event: BucketEvent) -> None:
        self.seen.append(("ready", event.bucket))

    def on_launch(self, event: BucketEvent) -> None:
        self.seen.append(("launch", event.bucket))


def test_rebuild_follows_rank0_arrival_order_and_overlaps(dist2):
    (before0, after0, launched0), (before1, after1, launched1) = dist2.run(_rebuild)
    # Before any gradient is seen, torch's DDP (and so ddpkit's) has one bucket in registration order.
    assert before0 == before1 == [["a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias"]]
    # Rank 0 runs a, b, c forward, so backward produces c's gradients first.
    assert after0 == after1 and after0[:2] in (["c.weight", "c.bias"], ["c.bias", "c.weight"])
    # After the rebuild on rank 0, bucket k is launched the moment its gradient
    # is ready, before the next one is: communication starts during backward.
    assert launched0 == [(kind, k) for k in range(6) for kind in ("ready", "launch")]


class _TwiceThroughCheckpoint(nn.Module):
    """One Linear used inside a reentrant checkpoint and outside it: its gradient arrives twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.lin, x, use_reentrant=True) + self.lin(x)


def test_a_gradient_twice_in_one_backward_is_an_error():
    ddpkit.init()
    model = ddpkit.DDP(_TwiceThroughCheckpoint())
    with pytest.raises(RuntimeError, match="received a gradient twice in one synchronised backward"):
        model(torch.randn(2, 3, requires_grad=True)).sum().backward()


class _TwiceWhenAsked(nn.Module):
    """A Linear whose gradient arrives twice (through a reentrant checkpoint and outside it) once ``twice`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.twice = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.lin, x, use_reentrant=True) + self.lin(x) if self.twice else self.lin(x)


def test_a_gradient_twice_is_an_error_once_the_buckets_are_final_too():
    # Once the buckets are rebuilt and the logged iterations are over (torch's first ten), the gradient hooks
    # take their short path (nothing but the buckets to count): it must refuse a second gradient as the first
    # backward's path does.
    ddpkit.init()
    inner = _TwiceWhenAsked()
    model = ddpkit.DDP(inner)
    for _ in range(12):
        model(torch.randn(2, 3)).sum().backward()
    assert model.reducer.layout.final and model.reducer.ready_order is None
    inner.twice = True
    with pytest.raises(RuntimeError, match="parameter 'lin.(weight|bias)' received a gradient twice"):
        model(torch.randn(2, 3, requires_grad=True)).sum().backward()


class _SparseByHand(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(x, self.table, sparse=True)


def test_a_sparse_gradient_from_elsewhere_than_a_sparse_embedding_is_an_error_naming_the_parameter():
    # torch's rule: only nn.Embedding / nn.EmbeddingBag(sparse=True) parameters may have sparse gradients
    # (those are reduced sparse, see test_ddp.py).
    ddpkit.init()
    model = ddpkit.DDP(_SparseByHand())
    with pytest.raises(RuntimeError, match="parameter 'table' has a sparse gradient, but DDP expects"):
        model(torch.tensor([1, 2])).sum().backward()


def _lone_reducer(**options) -> Reducer:
    """A reducer of one linear layer on no process group (a world of one)."""
    layer = nn.Linear(3, 2)
    return Reducer(list(layer.named_parameters()), process_group=None, **options)


@pytest.mark.parametrize("start, to", [(start, to) for start in Phase for to in Phase if to not in MOVES[start]],
                         ids=lambda p: p.name)
def test_a_move_the_phases_do_not_allow_raises(start: Phase, to: Phase) -> None:
    reducer = _lone_reducer()
    reducer.phase = start  # the state alone, to try one move from it
    with pytest.raises(RuntimeError, match=f"DDP: the gradient reducer has no move from {start.value} to {to.value}"):
        reducer._become(to)
    assert reducer.phase is start


@pytest.mark.parametrize("start, to", [(start, to) for start in Assignment for to in Assignment
                                       if to not in ASSIGNMENT_MOVES[start]], ids=lambda a: a.name)
def test_a_move_the_bucket_assignment_does_not_allow_raises(start: Assignment, to: Assignment) -> None:
    reducer = _lone_reducer()
    reducer.assignment = start
    with pytest.raises(RuntimeError, match=f"DDP: the bucket assignment has no move from {start.value} to {to.value}"):
        reducer._assign(to)
    assert reducer.assignment is start


def _phases(static_graph: bool) -> dict[str, list[str]]:
    """The reducer's phase at each point of the call sequences users write, as ddpkit's DDP drives it."""
    torch.manual_seed(0)
    model = ddpkit.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)),
                                           static_graph=static_graph)
    reducer = model.reducer
    seen: dict[str, list[str]] = {}

    def note(name: str) -> None:
        seen.setdefault(name, []).append(reducer.phase.value)

    first = model.module[0].weight  # its gradient comes last: the others' hooks have run by then
    first.register_hook(lambda g: note("during backward") or g)
    x = torch.randn(5, 4) + dist.get_rank()
    for _ in range(3):
        out = model(x)
        note("after forward")
        torch.autograd.grad(out.sum(), list(model.parameters()))  # through the model: not the synchronised backward
        note("after autograd.grad")
        out = model(x)
        out.sum().backward()
        note("after backward")
        seen.setdefault("assignment after backward", []).append(reducer.assignment.value)
        with model.no_sync():
            model(x).sum().backward()
        note("after a no_sync backward")
        with torch.no_grad():
            model(x)
        note("after a no_grad forward")
    return seen


@pytest.mark.parametrize("static_graph", [False, True], ids=["dynamic", "static graph"])
def test_the_phases_of_the_call_sequences_users_write(dist2, static_graph: bool) -> None:
    seen = dist2.run(_phases, static_graph)[0]
    assert seen["after forward"] == ["armed"] * 3
    assert seen["after autograd.grad"] == ["armed"] * 3  # no hook ran: still armed for the real backward
    # Per step: autograd.grad (no gradient hook runs; DDP's output sink, or its anchor on the output's nodes, queued
    # the callback, which finds no hook ran and leaves the reducer armed), the backward (queued; a static graph's
    # later backwards seed its unused parameters), the no_sync() backward.
    later = "seeded" if static_graph else "queued"
    assert seen["during backward"] == ["queued", "queued", "idle"] + ["queued", later, "idle"] * 2
    assert seen["after backward"] == seen["after a no_sync backward"] == ["idle"] * 3
    assert seen["after a no_grad forward"] == ["idle"] * 3
    # The rebuild is due after the first synchronised backward (a static graph's second), done at the next forward.
    rebuild = ["first", "due", "rebuilt"] if static_graph else ["due", "rebuilt", "rebuilt"]
    assert seen["assignment after backward"] == rebuild


def test_deferred_completion_is_in_flight_between_backward_and_collection() -> None:
    layer = nn.Linear(3, 2)
    reducer = DeferredReducer(list(layer.named_parameters()), process_group=None, reduce_missing=True,
                              owner="DistributedOptimizer")  # as DistributedOptimizer makes it
    reducer.prepare_for_backward()
    layer(torch.ones(1, 3)).sum().backward()
    assert reducer.phase is Phase.IN_FLIGHT and reducer.in_flight
    with pytest.raises(RuntimeError, match="received a gradient while the previous backward's reduction"):
        layer(torch.ones(1, 3)).sum().backward()
    reducer.complete()
    assert reducer.phase is Phase.IDLE
    reducer.launch_now()  # nothing armed it: armed, then launched at once
    assert reducer.phase is Phase.IN_FLIGHT
    reducer.complete()
    assert reducer.phase is Phase.IDLE and reducer.step == 2


def test_a_reducer_let_go_removes_its_gradient_hooks_at_once() -> None:
    # Its paths are the class's functions, not bound methods kept on it: no reference cycle, so the last reference's
    # end frees it (and its buckets) and removes its hooks, with the garbage collector off.
    import gc

    layer = nn.Linear(3, 2)
    gc.disable()
    try:
        for arm in (False, True):
            reducer = Reducer(list(layer.named_parameters()), process_group=None)
            if arm:
                reducer.prepare_for_backward()
            assert all(len(p._post_accumulate_grad_hooks) == 1 for p in layer.parameters())
            del reducer
            assert all(not p._post_accumulate_grad_hooks for p in layer.parameters()), arm
    finally:
        gc.enable()


def _restored(restore: bool, as_view: bool) -> tuple[list, list, list, list[list[int]]]:
    """The buckets a run rebuilt to, given to a fresh wrapper before its first backward: what its hook sees in the
    first steps (bucket by bucket), its gradients, and its buckets after them."""
    torch.manual_seed(0)
    first = ddpkit.DDP(_Encoder(), bucket_cap_mb=0.2, gradient_as_bucket_view=as_view)
    x = torch.randn(2, 8, 64) + dist.get_rank()
    finals = [first.buckets_final]
    for _ in range(2):
        first(x).sum().backward()
        finals.append(first.buckets_final)
    assert finals == [False, False, True]  # the rebuild comes at the second forward
    saved = first.bucket_indices()
    torch.manual_seed(0)
    module = _Encoder()
    model = ddpkit.DDP(module, bucket_cap_mb=0.2, gradient_as_bucket_view=as_view)
    if restore:
        model.restore_buckets(saved)
    seen: list = []

    def record(state, bucket):
        seen.append([bucket.index(), *(tuple(p.shape) for p in bucket.parameters())])
        return _allreduce_mean(bucket.buffer())

    model.register_comm_hook(None, record)
    for _ in range(2):
        model(x).sum().backward()
    return saved, seen, [p.grad.clone() for p in module.parameters()], model.bucket_indices()


def test_buckets_restored_before_the_first_backward_are_the_rebuilt_ones_from_it(dist2):
    # A resumed run reduces in the buckets of the run that saved them from its first step (a comm hook that
    # keeps state per bucket needs them); without, its first step reduces in the first assignment's.
    for as_view in (False, True):
        for (saved, seen, grads, after), (_, plain_seen, plain_grads, plain_after) in zip(
                dist2.run(_restored, True, as_view), dist2.run(_restored, False, as_view)):
            assert after == plain_after == saved and len(saved) > 1
            assert seen[: len(saved)] == seen[len(saved):] == plain_seen[len(plain_seen) - len(saved):]
            assert plain_seen[: len(plain_seen) - len(saved)] != seen[: len(saved)]  # the first step differs
            assert all(torch.equal(g, t) for g, t in zip(grads, plain_grads))


def _refusals() -> list[str]:
    model = ddpkit.DDP(_Encoder())
    n, said = len(list(model.parameters())), []
    for bad in ([[0, 1]], [[*range(n), 0]], [[], list(range(n))]):  # missing, twice, an empty bucket
        with pytest.raises(ValueError, match="do not hold each of the") as e:
            model.restore_buckets(bad)
        said.append(str(e.value))
    mixed = _Encoder()
    next(mixed.children()).double()  # its first layer in float64: a bucket per dtype
    with pytest.raises(ValueError, match="mixes dtypes or devices"):
        ddpkit.DDP(mixed).restore_buckets([list(range(n))])
    model(torch.randn(2, 8, 64)).sum().backward()
    with pytest.raises(RuntimeError, match="before the first backward"):
        model.restore_buckets(model.bucket_indices())
    searching = ddpkit.DDP(_Encoder(), find_unused_parameters=True)  # final from the start: only checked
    searching.restore_buckets(searching.bucket_indices())
    assert not searching.reducer.rebuilt
    with pytest.raises(ValueError, match="final from the start"):
        searching.restore_buckets([list(range(n))[::-1]])
    return said


def test_restoring_buckets_of_another_model_or_after_a_backward_is_refused(dist2):
    assert all(dist2.run(_refusals))

"""ZeRO stage 3's parameters as torch's tools see them: true shapes, whole state dicts of any submodule, loads with
and without ``assign``, models built on the meta device, and what a sharded model refuses (with the fix)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.models import TransformerClassifier
from ddpkit.parallel.zero.stage3 import BACKWARD_MOVES, Backward, ShardedParameters
from ddpkit.parallel.zero.placement import local_of
from ddpkit.parallel.zero.units import RESIDENCY_MOVES, Residency, Unit

ce = nn.functional.cross_entropy


class Blocks(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.emb = nn.Linear(8, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.LayerNorm(width)) for _ in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Temperature(Blocks):
    """A parameter of the root module itself, which has no ``reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + 10 * step + dist.get_rank())
    return torch.randn(6, 8, generator=g), torch.randint(0, 5, (6,), generator=g)


def _adamw_steps(model: nn.Module, steps: int, lr: float) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        ce(model(x), y).backward()
        opt.step()
    return opt


def _reset_all(model: nn.Module) -> None:
    """What the materialisation runs, on a whole model: each module's own initialisation, children first."""
    def reset(m: nn.Module) -> None:
        fn = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
        if callable(fn):
            fn()
    model.apply(reset)


def _init_scale(m: nn.Module) -> None:
    if isinstance(m, Temperature):
        nn.init.constant_(m.scale, 2.0)
    elif hasattr(m, "reset_parameters"):
        m.reset_parameters()


MAKERS = {"blocks": Blocks, "transformer": lambda: TransformerClassifier(d_model=32, layers=2),
          "temperature": Temperature}


def _meta(name: str) -> dict:
    make = MAKERS[name]
    init = _init_scale if name == "temperature" else None
    # The reference: the whole model made from the meta one, initialised as the materialisation does, then wrapped.
    torch.manual_seed(7)
    with torch.device("meta"):
        whole = make()
    whole.to_empty(device="cpu")
    with torch.no_grad():
        (whole.apply(init) if init else _reset_all(whole))
    after_whole = torch.rand(4)
    reference = _whole(ddpkit.DDP(whole, zero_stage=3))
    torch.manual_seed(7)
    with torch.device("meta"):
        meta = make()
    model = ddpkit.DDP(meta, zero_stage=3, zero_init=init)
    after = torch.rand(4)
    built = _whole(model)
    # And it trains: one step, the gradients reach the shards.
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(4, 5, 32) if name == "transformer" else torch.randn(4, 8)
    ce(model(x), torch.zeros(4, dtype=torch.long)).backward()
    opt.step()
    return {"equal": list(reference) == list(built) and all(torch.equal(reference[k], built[k]) for k in built),
            "rng": torch.equal(after, after_whole), "device": {str(local_of(p).device) for p in model.parameters()},
            "local": sum(local_of(p).numel() for p in model.parameters()),
            # Each rank's rows: at most ceil(rows / W) of each parameter (torch.chunk's cut, FSDP2's).
            "bound": sum(math.ceil(p.shape[0] / dist.get_world_size()) * p[0].numel() if p.dim() else 1
                         for p in model.parameters())}


def _whole(model: nn.Module) -> dict:
    return {k.removeprefix("module."): v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", list(MAKERS))
def test_a_meta_model_is_materialised_shard_by_shard_bit_for_bit(dist2, dist3, name):
    for pool in (dist2, dist3):
        for r in pool.run(_meta, name):
            assert r["equal"] and r["rng"] and r["device"] == {"cpu"}
            assert r["local"] <= r["bound"]  # each rank made only its rows


def _meta_equals_construction() -> bool:
    # A model whose modules initialise themselves when built (a stack of blocks, as most are) is the same built
    # on the meta device: the same draws in the same order.
    torch.manual_seed(3)
    built = _whole(ddpkit.DDP(Blocks(), zero_stage=3))
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = Blocks()
    return all(torch.equal(a, b) for a, b in zip(built.values(), _whole(ddpkit.DDP(meta, zero_stage=3)).values()))


def test_a_meta_model_equals_the_model_built_whole(dist2):
    assert dist2.run(_meta_equals_construction) == [True, True]


def _refused_meta() -> str:
    with torch.device("meta"):
        model = Temperature()
    try:
        ddpkit.DDP(model, zero_stage=3)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_a_meta_module_without_an_initialiser_is_named(dist2):
    said = dist2.run(_refused_meta)[0]
    assert "module '(the model)' (Temperature)" in said and "zero_init=fn" in said


def _state_dicts() -> dict:
    torch.manual_seed(0)
    base = Blocks()
    ddp, z3 = ddpkit.DDP(copy.deepcopy(base)), ddpkit.DDP(copy.deepcopy(base), zero_stage=3)
    for model in (ddp, z3):
        _adamw_steps(model, 2, 0.05)
    out: dict = {}
    # Any submodule's state dict is whole, as under DDP.
    for name in ("blocks.1", "blocks.1.0", "head", ""):
        ours = (z3.module.get_submodule(name) if name else z3).state_dict()
        theirs = (ddp.module.get_submodule(name) if name else ddp).state_dict()
        out[name] = list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    out["types"] = {type(v).__name__ for v in z3.module.blocks[0].state_dict().values()}
    # load_state_dict, into the whole model and into a submodule, with and without assign.
    torch.manual_seed(1)
    fresh = Blocks()
    x, _ = _batch(9)
    with torch.no_grad():
        expected = fresh(x)
    for assign in (False, True):
        target = ddpkit.DDP(copy.deepcopy(base), zero_stage=3)
        target.module.load_state_dict(fresh.state_dict(), assign=assign)
        with torch.no_grad():
            out[f"whole assign={assign}"] = torch.equal(target(x), expected)
        target = ddpkit.DDP(copy.deepcopy(base), zero_stage=3)
        target.module.blocks[2].load_state_dict(fresh.blocks[2].state_dict(), assign=assign)
        with torch.no_grad():
            out[f"submodule assign={assign}"] = torch.equal(target.module.blocks[2].state_dict()["0.weight"],
                                                            fresh.blocks[2][0].weight)
        # After an assign the optimizer is built over the parameters the model holds, and trains them.
        opt = torch.optim.SGD(target.parameters(), lr=0.1)
        before = target.module.blocks[2].state_dict()["0.weight"]
        ce(target(x), torch.zeros(6, dtype=torch.long)).backward()
        opt.step()
        out[f"trains after assign={assign}"] = not torch.equal(target.module.blocks[2].state_dict()["0.weight"], before)
    # A state dict of another shape is refused as torch refuses it, naming the parameter.
    try:
        ddpkit.DDP(copy.deepcopy(base), zero_stage=3).module.load_state_dict(Blocks(width=12).state_dict())
    except RuntimeError as e:
        out["mismatch"] = str(e)
    return out


def test_every_submodules_state_dict_is_whole_and_loads_with_or_without_assign(dist2):
    for r in dist2.run(_state_dicts):
        assert r["blocks.1"] and r["blocks.1.0"] and r["head"] and r[""]
        assert r["types"] == {"Tensor"}
        for assign in (False, True):
            assert r[f"whole assign={assign}"] and r[f"submodule assign={assign}"] and r[f"trains after assign={assign}"]
        assert "size mismatch for emb.weight" in r["mismatch"]


def _shapes_and_initialisers() -> dict:
    torch.manual_seed(0)
    model = ddpkit.DDP(Blocks(), zero_stage=3)
    plain = Blocks()
    # nanoGPT's grouping: decay what has two dimensions or more.
    decay = [n for n, p in model.module.named_parameters() if p.dim() >= 2]
    # Initialisers that read fan-in from the shape run on the sharded parameters.
    for p in model.parameters():
        if p.dim() >= 2:
            nn.init.kaiming_uniform_(p, a=math.sqrt(5))
        else:
            nn.init.zeros_(p)
    whole = _whole(model)
    bound = 1 / math.sqrt(8)  # emb's fan-in
    return {"decay": decay, "expected": [n for n, p in plain.named_parameters() if p.dim() >= 2],
            "shapes": [tuple(p.shape) for p in model.parameters()] == [tuple(p.shape) for p in plain.parameters()],
            "within": bool(whole["emb.weight"].abs().max() <= bound), "zeros": bool(whole["head.bias"].eq(0).all()),
            "numel": sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())}


def test_parameters_report_their_true_shape_to_code_that_reads_it(dist2):
    for r in dist2.run(_shapes_and_initialisers):
        assert r["decay"] == r["expected"] and r["shapes"] and r["numel"]
        assert r["within"] and r["zeros"]


def _refusals() -> list[str]:
    said = []
    model = Blocks()
    stale = torch.optim.SGD(model.parameters(), lr=0.1)  # built before wrapping: it holds the replaced tensors
    wrapped = ddpkit.DDP(model, zero_stage=3)
    x, y = _batch(0)
    ce(wrapped(x), y).backward()
    for act in (lambda: stale.step(), lambda: ddpkit.DDP(model, zero_stage=3), lambda: ddpkit.DDP(model),
                lambda: (wrapped.module.head.double(), wrapped(x))):
        try:
            act()
        except (RuntimeError, ValueError) as e:
            said.append(str(e))
        else:
            said.append("accepted")
    return said


def test_what_a_sharded_model_cannot_do_is_named_with_the_fix(dist2):
    stale, twice, under_ddp, cast = dist2.run(_refusals)[0]
    assert "build the optimizer after wrapping" in stale
    assert "sharded already (it was wrapped with zero_stage=3 before)" in twice
    assert "sharded already (it was wrapped with zero_stage=3 before)" in under_ddp
    assert "'head.weight'" in cast and "torch.float64" in cast and "after wrapping" in cast


class Skipping(Blocks):
    def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        x = self.emb(x)
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = block(x)
        return self.head(x)


def _held_late_in_backward(case: str) -> dict:
    """What is gathered, and which units still hold whole gradients, when backward reaches the first module (the
    embedding, in the root unit: the last gradient of the backward)."""
    torch.manual_seed(0)
    base = Skipping(depth=4)
    if case == "frozen backbone":
        base.blocks.requires_grad_(False)
    model = ddpkit.DDP(base, zero_stage=3, find_unused_parameters=case == "unused unit")
    engine = model.reducer
    seen: dict = {}

    def late(module: nn.Module, grad_in: tuple, grad_out: tuple) -> None:
        seen["gathered"] = [u.residency.value for u in engine.units]
        seen["whole grads"] = [any(q.leaf is not None and q.leaf.grad is not None for q in u.params)
                               for u in engine.units]

    model.module.emb.register_full_backward_hook(late)
    x, y = _batch(0)
    x.requires_grad_()  # so that the embedding's backward runs (and the hook with it)
    ce(model(x, skip=2 if case == "unused unit" else None), y).backward()
    seen["units"] = [u.name for u in engine.units]
    seen["grads"] = [p.grad is None for p in model.parameters()]
    return seen


@pytest.mark.parametrize("case", ["trained", "frozen backbone", "unused unit"])
def test_units_are_freed_and_reduced_as_soon_as_backward_is_done_with_them(dist2, case):
    for r in dist2.run(_held_late_in_backward, case):
        assert r["units"] == ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
        # Every block's backward is over: none is gathered, a frozen one included (FSDP2's post-backward).
        assert r["gathered"][1:] == ["freed"] * 4
        if case == "trained":
            # Each block's gradient went out as soon as it was in: none is held whole.
            assert r["whole grads"][1:] == [False] * 4
        elif case == "unused unit":
            # Block 2 is unused: the block after it in the reduction order (3) went out during backward; those
            # behind it (1, 0) keep their gradients to the end, where the used-parameter map is agreed on.
            assert r["whole grads"][1:] == [True, True, False, False]
            assert r["grads"][10:14] == [True] * 4 and not any(r["grads"][:10])  # block 2's parameters: used by no rank, .grad left None
        else:
            assert r["whole grads"][1:] == [False] * 4


def _dropped() -> list[bool]:
    import gc
    import weakref

    freed = []
    for case in ("no_grad forward", "trained"):
        torch.manual_seed(0)
        model = ddpkit.DDP(Blocks(), zero_stage=3)
        x, y = _batch(0)
        if case == "trained":
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            ce(model(x), y).backward()
            opt.step()
            del opt
        else:
            with torch.no_grad():
                model(x)
        engine, module = weakref.ref(model.reducer), weakref.ref(model.module)
        del model
        gc.collect()
        freed.append(engine() is None and module() is None)
    return freed


def test_a_dropped_stage3_model_leaves_nothing_behind(dist2):
    # Autograd holds a tensor's hooks from C++, where Python's collector cannot follow a cycle: a leaf's hook that
    # held its unit kept every dropped model (its shards, its gathered buffers) alive.
    assert dist2.run(_dropped) == [[True, True]] * 2


def _train_state_checkpoint(directory: str) -> dict:
    from ddpkit.train.state import TrainState

    torch.manual_seed(0)
    model = ddpkit.DDP(Blocks(), zero_stage=3)
    state = TrainState(model=model, optimizer=_adamw_steps(model, 2, 0.01))
    payload = state.payload(2)
    out = {"payload": None if payload["model"] is None else (
        {v.device.type for v in payload["model"].values()},
        {v.device.type for s in payload["optimizer"]["state"].values() for v in s.values() if torch.is_tensor(v)},
        [tuple(v.shape) for v in payload["model"].values()] == [tuple(p.shape) for p in Blocks().state_dict().values()])}
    state.save(directory, 2)
    expected = _whole(model)
    # A new job: another model, restored from the checkpoint, each rank keeping only its rows.
    torch.manual_seed(5)
    again = ddpkit.DDP(Blocks(), zero_stage=3)
    opt2 = torch.optim.AdamW(again.parameters(), lr=0.01)
    restored = TrainState(model=again, optimizer=opt2)
    out["step"] = restored.restore(directory)
    out["equal"] = all(torch.equal(a, b) for a, b in zip(expected.values(), _whole(again).values()))
    moments = [v for s in opt2.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    out["moments"] = (len(moments), all(hasattr(v, "to_local") for v in moments),
                      # its own memory, the size of its rows: not a view of a whole tensor
                      all(local_of(v).untyped_storage().nbytes() == local_of(v).numel() * 4 for v in moments))
    return out


def test_a_train_state_of_a_sharded_model_is_written_from_one_ranks_cpu_and_restored_as_shards(dist2, tmp_path):
    r0, r1 = dist2.run(_train_state_checkpoint, str(tmp_path))
    assert r0["payload"] == ({"cpu"}, {"cpu"}, True) and r1["payload"] is None  # rank 1 holds none of it
    for r in (r0, r1):
        assert r["step"] == 2 and r["equal"]
        assert r["moments"] == (2 * 16, True, True)  # two moments of each of the 16 parameters


def _zero_grad_inside_no_sync() -> bool:
    torch.manual_seed(0)
    base = Blocks()
    results = []
    for model in (ddpkit.DDP(copy.deepcopy(base)), ddpkit.DDP(copy.deepcopy(base), zero_stage=3)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _batch(0)
        with model.no_sync():
            ce(model(x[:3]), y[:3]).backward()
        model.zero_grad()  # a skipped micro-batch: its local sum goes
        ce(model(x[3:]), y[3:]).backward()
        opt.step()
        results.append(_whole(model))
    return all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_zero_grad_drops_a_no_sync_accumulation_as_under_ddp(dist2):
    assert dist2.run(_zero_grad_inside_no_sync) == [True, True]


@pytest.mark.parametrize("start, to", [(s, t) for s in Residency for t in Residency if t not in RESIDENCY_MOVES[s]],
                         ids=lambda r: r.name)
def test_a_move_a_units_residency_does_not_allow_raises(start: Residency, to: Residency) -> None:
    unit = Unit(3, "blocks.1", nn.Linear(2, 2), [], 1, torch.empty(0), residency=start)
    with pytest.raises(RuntimeError, match=f"zero-3 unit 3 \\(blocks.1\\) has no move from {start.value} to {to.value}"):
        unit.become(to)
    assert unit.residency is start


@pytest.mark.parametrize("start, to", [(s, t) for s in Backward for t in Backward if t not in BACKWARD_MOVES[s]],
                         ids=lambda b: b.name)
def test_a_move_the_stage3_backward_does_not_allow_raises(start: Backward, to: Backward) -> None:
    engine = ShardedParameters.__new__(ShardedParameters)  # its state alone: no model, no group
    engine.owner, engine.backward = "DistributedDataParallel", start
    with pytest.raises(RuntimeError, match=f"the backward has no move from {start.value} to {to.value}"):
        engine._enter(to)
    assert engine.backward is start


def _states_of_a_call_sequence() -> dict:
    """The engine's backward and the units' residency at each point of a gradient penalty's call sequence (a
    backward that gives no gradient, then one that does), and of a no_sync() backward."""
    torch.manual_seed(0)
    model = ddpkit.DDP(Blocks(depth=2), zero_stage=3)
    engine = model.reducer
    seen: dict[str, list] = {}

    def note(name: str) -> None:
        seen.setdefault(name, []).append(
            (engine.backward.value, [u.residency.value for u in engine.units]))

    model.module.head.register_full_backward_hook(lambda *_: note("head's backward"))
    model.module.emb.register_full_backward_hook(lambda *_: note("embedding's backward"))
    x, y = _batch(0)
    x.requires_grad_()
    loss = ce(model(x), y)
    note("after forward")
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)  # no parameter gets a gradient: the units are held
    note("after a backward with no gradient")
    (loss + gx.pow(2).sum()).backward()
    note("after the backward")
    with model.no_sync():
        ce(model(x), y).backward()
    note("after a no_sync() backward")
    seen["units"] = [u.name for u in engine.units]
    return seen


def test_the_backward_and_the_units_states_through_a_gradient_penalty(dist2) -> None:
    for seen in dist2.run(_states_of_a_call_sequence):
        assert seen["units"] == ["", "blocks.0", "blocks.1"]
        # The last unit of the forward is kept for the backward; the root unit is whole for both.
        assert seen["after forward"] == [("idle", ["gathered", "freed", "gathered"])]
        # autograd.grad: the head's backward runs before any parameter has its gradient; no gradient at its end.
        assert seen["head's backward"][0] == ("begun", ["gathered", "freed", "gathered"])
        assert seen["after a backward with no gradient"] == [("held", ["gathered"] * 3)]
        # The penalty's backward (held: every unit stays gathered to its end), then the no_sync() one, which frees
        # each block once backward is done with it.
        assert seen["head's backward"][1:] == [("accumulating, held", ["gathered"] * 3),
                                                  ("accumulating", ["gathered", "freed", "gathered"])]
        assert seen["embedding's backward"][1:] == [("accumulating, held", ["gathered"] * 3),
                                                 ("accumulating", ["gathered", "freed", "freed"])]
        assert seen["after the backward"] == seen["after a no_sync() backward"] == [("idle", ["freed"] * 3)]

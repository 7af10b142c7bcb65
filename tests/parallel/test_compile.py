"""torch.compile over ddpkit's DDP: graph breaks and graphs counted by Dynamo, against torch's DDP, on gloo ranks.

Under torch's DDP, Dynamo breaks the graph three times in the wrapper's own
forward and compiles the module as a frame of its own. ddpkit's wrapper runs
eagerly without a break, and the module is compiled into the same graphs.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from ddp_models import batch, make, state, train
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddpkit


def _compiled_counts(engine: str, name: str, no_sync: bool, kwargs: dict) -> dict:
    """Graph breaks and graphs (their node counts) of three compiled forward/backward steps of ``name``."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    wrap = ddpkit.DDP if engine == "ddpkit" else TorchDDP
    model = wrap(make(name), **kwargs)
    graphs: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    compiled = torch.compile(model, backend=backend)
    for step in range(3):
        x, _ = batch(name, 10 * step + dist.get_rank())
        with model.no_sync() if no_sync else contextlib.nullcontext():
            compiled(x).sum().backward()
    breaks = {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()}
    explained = torch._dynamo.explain(wrap(make(name), **kwargs))(batch(name, 0)[0])
    return {"breaks": sum(breaks.values()), "reasons": breaks, "graphs": graphs,
            "explain": (explained.graph_count, explained.graph_break_count)}


@pytest.mark.parametrize("no_sync", [False, True])
@pytest.mark.parametrize("name", ["plain", "convbn"])  # without and with buffers (BatchNorm)
def test_compiled_forward_has_no_graph_break_from_ddpkit(dist2, name, no_sync):
    for ours, theirs in dist2.run(_both_counts, name, no_sync, {}):
        assert ours["breaks"] == 0, f"graph breaks in ddpkit's DDP: {ours['reasons']}"
        assert ours["breaks"] <= theirs["breaks"], (ours, theirs)
        assert ours["graphs"] == theirs["graphs"], (ours, theirs)
        assert ours["explain"] == theirs["explain"], (ours, theirs)


def test_compiled_forward_other_modes_have_no_graph_break(dist2):
    # The sink of find_unused_parameters and the static graph's first forwards run eagerly too.
    for kwargs in ({"find_unused_parameters": True}, {"static_graph": True}):
        for ours in dist2.run(_compiled_counts, "ddpkit", "convbn", False, kwargs):
            assert ours["breaks"] == 0, (kwargs, ours["reasons"])
            assert len(ours["graphs"]) == 1, (kwargs, ours)


def _both_counts(name: str, no_sync: bool, kwargs: dict) -> tuple[dict, dict]:
    return _compiled_counts("ddpkit", name, no_sync, kwargs), _compiled_counts("torch", name, no_sync, kwargs)


def _compiled_training(name: str, kwargs: dict, micro: int) -> tuple[dict, dict]:
    torch._dynamo.reset()
    base = make(name)
    results = []
    for wrap in (ddpkit.DDP, TorchDDP):
        model = wrap(copy.deepcopy(base), **kwargs)
        compiled = torch.compile(model, backend="aot_eager")  # AOT autograd: the backward is a compiled graph
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            opt.zero_grad()
            for m in range(micro):
                x, y = batch(name, 1000 + 100 * step + 10 * dist.get_rank() + m)
                with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    nn.functional.cross_entropy(compiled(x), y).backward()
            opt.step()
        results.append(state(model))
    return results[0], results[1]


@pytest.mark.parametrize("kwargs,micro", [({}, 1), ({}, 2), ({"find_unused_parameters": True}, 1),
                                          ({"static_graph": True}, 1)])
def test_compiled_training_matches_torch_ddp_bitwise(dist2, kwargs, micro):
    for rank, (ours, theirs) in enumerate(dist2.run(_compiled_training, "convbn", kwargs, micro)):
        assert ours.keys() == theirs.keys()
        for key in ours:
            torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=lambda m: f"rank {rank} {key}: {m}")


def _eager_matches_after_compile(name: str) -> bool:
    # The wrapper is the same object compiled or not: eager steps after compiled ones keep training it.
    model = ddpkit.DDP(make(name))
    compiled = torch.compile(model, backend="aot_eager")
    train(compiled, name, 1, 0.0)
    train(model, name, 1, 0.0)
    mine = state(model)
    gathered = [None, None]
    dist.all_gather_object(gathered, {k: v for k, v in mine.items() if "running_" not in k})
    return all(torch.equal(gathered[0][k], gathered[1][k]) for k in gathered[0])


def test_compiled_then_eager_replicas_agree(dist2):
    assert all(dist2.run(_eager_matches_after_compile, "convbn"))

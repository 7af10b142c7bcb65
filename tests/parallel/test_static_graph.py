"""``static_graph=True``: activation checkpointing (reentrant and not) against torch's DDP, on gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from ddp_models import state
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import ddpkit

EXACT = {"rtol": 0.0, "atol": 0.0}


class Checkpointed(nn.Module):
    """Two blocks under checkpointing, one of them used twice, and a head."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.unused = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_() if self.reentrant else x
        h = checkpoint(self.a, x, use_reentrant=self.reentrant)
        h = checkpoint(self.b, h, use_reentrant=self.reentrant)
        h = checkpoint(self.b, h, use_reentrant=self.reentrant)  # b twice: ready twice per backward
        return self.head(h)


def _train(reentrant: bool, steps: int, change_graph: bool = False) -> list:
    torch.manual_seed(0)
    base = Checkpointed(reentrant)
    out = []
    for wrap in (ddpkit.DDP, TorchDDP):
        model = wrap(copy.deepcopy(base), static_graph=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        try:
            for step in range(steps):
                g = torch.Generator().manual_seed(100 * step + dist.get_rank())
                x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
                logits = model(x)
                if change_graph and step == 2:
                    logits = logits + model.module.unused(x)[:, :3]
                nn.functional.cross_entropy(logits, y).backward()
                opt.step()
                opt.zero_grad()
            out.append(state(model))
        except RuntimeError as exc:
            out.append(str(exc))
    return out


@pytest.mark.parametrize("reentrant", [True, False])
def test_static_graph_checkpointing_matches_torch(dist2, reentrant):
    for rank, (ours, theirs) in enumerate(dist2.run(_train, reentrant, 4)):
        assert ours.keys() == theirs.keys()
        for k in ours:
            torch.testing.assert_close(ours[k], theirs[k], **EXACT, msg=lambda m: f"rank {rank} {k}: {m}")


def test_static_graph_that_changes_raises(dist2):
    for ours, _ in dist2.run(_train, False, 4, True):
        assert isinstance(ours, str) and "training graph has changed" in ours


def _without_static_graph() -> str:
    net = Checkpointed(True)
    del net.unused
    model = ddpkit.DDP(net)
    try:
        for _ in range(2):
            nn.functional.cross_entropy(model(torch.randn(6, 8)), torch.zeros(6, dtype=torch.long)).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_gradient_twice_without_static_graph_names_the_fix(dist2):
    for msg in dist2.run(_without_static_graph):
        assert "twice" in msg and "static_graph=True" in msg


def _changed_on_one_rank() -> list:
    # From step 2 rank 1 alone uses a branch the first backward did not: it must raise there, and rank 0,
    # whose graph is unchanged, must not be left waiting in an all-reduce (torch raises on both ranks).
    torch.manual_seed(0)
    net = Checkpointed(False)
    model = ddpkit.DDP(net, static_graph=True)
    seen = []
    for step in range(3):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        out = model(x)
        if step == 2 and dist.get_rank() == 1:
            out = out + net.unused(x)[:, :3]
        try:
            out.sum().backward()
            seen.append("ok")
        except RuntimeError as exc:
            seen.append(str(exc)[:200])
        dist.barrier()  # reached by both ranks: nothing is left hanging
    return seen


def test_a_graph_that_changes_on_one_rank_raises_there_without_a_hang(dist2):
    ours = dist2.run(_changed_on_one_rank)
    assert ours[0] == ["ok"] * 3
    assert ours[1][:2] == ["ok", "ok"] and "parameter 'unused." in ours[1][2] and "got gradient #1" in ours[1][2]


def _frozen_after_wrapping() -> tuple:
    torch.manual_seed(0)
    net = Checkpointed(False)
    del net.unused
    model = ddpkit.DDP(net, static_graph=True)
    for step in range(3):
        if step == 2:
            net.a[0].weight.requires_grad_(False)  # fewer gradients than in the first backward
        model.zero_grad(set_to_none=True)
        try:
            model(torch.randn(6, 8)).sum().backward()
        except RuntimeError as exc:
            return str(exc)[:200], net.a[0].weight.grad
    return "no error", None


def test_a_parameter_frozen_after_wrapping_keeps_no_gradient(dist2):
    # The backward raises; the frozen weight is not handed the zeros it sent (momentum would move it).
    for message, grad in dist2.run(_frozen_after_wrapping):
        assert "fewer gradients than in the first backward for 'a.0.weight'" in message and grad is None

"""``model.join()``: ranks with 3, 5 and 7 batches against torch's DDP + join, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ddp_models import SparseEmbeddings, batch, pair, state, torch_sparse_group
from torch import nn

import ddpkit

THREE_RANKS = {"rtol": 1e-6, "atol": 1e-7}  # three addends: gloo's order may differ by bucket layout
BATCHES = (3, 5, 7)


def _train_uneven(model: nn.Module, name: str, join_kw: dict, hook: bool, no_sync_every: int, fkw=None,
                  no_sync_at: tuple = ()) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rank = dist.get_rank()
    if hook:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(None, allreduce_hook)
    with model.join(**join_kw):
        for step in range(BATCHES[rank]):
            x, y = batch(name, 1000 + 100 * step + 10 * rank)
            kw = fkw(step) if fkw else {}
            if (no_sync_every and step % no_sync_every == 0) or step in no_sync_at:
                with model.no_sync():
                    nn.functional.cross_entropy(model(x, **kw), y).backward()
                continue
            nn.functional.cross_entropy(model(x, **kw), y).backward()
            opt.step()
            opt.zero_grad()
    return model


def _uneven(name: str, kwargs: dict, join_kw: dict, hook: bool = False, no_sync_every: int = 0,
            no_sync_at: tuple = ()) -> list[dict]:
    fkw = None
    if name == "branchy":
        def fkw(step: int) -> dict:
            return {"branch": step % 2 == 0 and dist.get_rank() != 1}
    return [state(_train_uneven(m, name, join_kw, hook, no_sync_every, fkw, no_sync_at)) for m in pair(name, **kwargs)]


def _check(results: list, exact: bool = False, identical: bool = True) -> None:
    tol = {"rtol": 0.0, "atol": 0.0} if exact else THREE_RANKS
    for rank, (ours, theirs) in enumerate(results):
        assert ours.keys() == theirs.keys()
        for k in ours:
            torch.testing.assert_close(ours[k], theirs[k], **tol, msg=lambda m: f"rank {rank} {k}: {m}")
    if not identical:
        return
    # The replicas end identical (the last joiner's model), gradients aside.
    first = results[0][0]
    for rank, (ours, _) in enumerate(results[1:], 1):
        for k in first:
            if not k.endswith(".grad"):
                torch.testing.assert_close(ours[k], first[k], rtol=0, atol=0, msg=lambda m: f"rank {rank} {k}: {m}")


@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_join_matches_torch_with_3_5_7_batches(dist3, divide_by_initial):
    _check(dist3.run(_uneven, "convbn", {}, {"divide_by_initial_world_size": divide_by_initial}))


def test_join_with_comm_hook_and_gradient_accumulation(dist3):
    _check(dist3.run(_uneven, "convbn", {"gradient_as_bucket_view": True}, {}, hook=True, no_sync_every=3))


def test_join_when_the_rebuild_comes_at_a_no_sync_forward(dist3):
    # The first synchronised step is step 2, so the rebuild is due at step 3, a no_sync() forward
    # after rank 0 (3 batches) has joined: the joined rank must rebuild with the others.
    _check(dist3.run(_uneven, "convbn", {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.01}, {},
                     no_sync_at=(0, 1, 3)))


def test_join_with_find_unused_parameters(dist3):
    _check(dist3.run(_uneven, "branchy", {"find_unused_parameters": True}, {}))


def test_join_buffers_come_from_a_rank_still_training(dist3):
    # BatchNorm statistics: once rank 0 has joined, its buffers are stale, so
    # the broadcast before each forward must come from a rank still training.
    _check(dist3.run(_uneven, "convbn", {"broadcast_buffers": True}, {}))


def _early_termination() -> list[str]:
    out = []
    for model in pair("plain"):
        try:
            _train_uneven(model, "plain", {"throw_on_early_termination": True}, False, 0)
            out.append("no error")
        except RuntimeError as exc:
            out.append(str(exc))
    return out


def test_throw_on_early_termination_raises_on_every_rank_like_torch(dist3):
    results = dist3.run(_early_termination)
    assert results[0] == ["Rank 0 exhausted all inputs."] * 2
    for rank in (1, 2):
        ours, theirs = results[rank]
        assert ours == theirs and "exhausted inputs" in ours


def _disabled() -> list[dict]:
    # enable=False with even inputs: plain DDP, no extra collectives.
    out = []
    for model in pair("convbn"):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join(enable=False):
            for step in range(3):
                x, y = batch("convbn", step + 10 * dist.get_rank())
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        out.append(state(model))
    return out


def test_join_disabled_is_plain_ddp(dist2):
    # No final sync without join: BatchNorm statistics stay per rank, as in torch.
    _check(dist2.run(_disabled), exact=True, identical=False)


def _under_torch_join() -> dict:
    # ddpkit's DDP is a joinable for torch's own Join context too.
    from torch.distributed.algorithms.join import Join as TorchJoin

    model = ddpkit.DDP(pair("plain")[0].module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with TorchJoin([model]):
        for step in range(1 + dist.get_rank()):
            x, y = batch("plain", step + 10 * dist.get_rank())
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return state(model)


def test_ddpkit_ddp_works_under_torchs_join(dist2):
    a, b = dist2.run(_under_torch_join)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def _sparse_uneven(engine: str) -> list[torch.Tensor]:
    from ddpkit._reference import torch_ddp

    torch.manual_seed(0)
    module = SparseEmbeddings()
    model = ddpkit.DDP(module) if engine == "ddpkit" else torch_ddp(module, process_group=torch_sparse_group())
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    rank = dist.get_rank()
    with model.join():
        for step in range(BATCHES[rank]):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randint(0, 50, (4, 5), generator=g), torch.randint(0, 30, (4, 3), generator=g)
            opt.zero_grad()
            model(x, y).square().sum().backward()
            opt.step()
    return [p.detach().clone() for p in module.parameters()]


def test_join_with_sparse_embedding_gradients(dist2):
    # A joined rank shadows a sparse bucket's all-reduce with an empty sparse gradient.
    for ours, theirs in zip(dist2.run(_sparse_uneven, "ddpkit"), dist2.run(_sparse_uneven, "torch")):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))

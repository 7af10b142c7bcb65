"""ddpkit.hooks.powersgd_hook on ddpkit's DDP against torch's powerSGD_hook on torch's DDP (gloo ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddpkit
from ddpkit.hooks import PowerSGDState, powersgd_hook


class Net(nn.Module):
    """Matrices worth compressing (the linears, the conv), and tensors that are not (biases, the head)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)
        h = torch.relu(self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(h))))))
        return self.head(h)


def _torch_hook_one_bucket_at_a_time(state, bucket):
    # torch's hook with several buckets in flight hangs on gloo (its callbacks issue
    # collectives in a different order on each rank): finish each bucket before the next.
    fut = torch_powersgd.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def _train(settings: dict, steps: int, cap: float, reference: str = "torch") -> list[dict]:
    torch.manual_seed(0)
    base = Net()
    results = []
    for engine in ("ddpkit", reference):
        model = copy.deepcopy(base)
        if engine == "ddpkit":
            ddp = ddpkit.DDP(model, bucket_cap_mb=cap)
            state = PowerSGDState(None, **settings)
            ddp.register_comm_hook(state, powersgd_hook)
        elif engine == "serial-torch-hook":
            ddp = ddpkit.DDP(model, bucket_cap_mb=cap)
            state = torch_powersgd.PowerSGDState(None, **settings)
            ddp.register_comm_hook(state, _torch_hook_one_bucket_at_a_time)
        else:
            ddp = TorchDDP(model, bucket_cap_mb=cap)
            state = torch_powersgd.PowerSGDState(None, **settings)
            ddp.register_comm_hook(state, torch_powersgd.powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        grads = []
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + dist.get_rank())
            x, y = torch.randn(5, 2, 6, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
        results.append({"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
                        "grads": grads, "iter": state.iter, "stats": state.compression_stats(),
                        "errors": sorted(state.error_dict)})
    return results


SETTINGS = [
    {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2},
    {"matrix_approximation_rank": 4, "start_powerSGD_iter": 3},  # r > 2: the QR path
    {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2, "warm_start": False, "use_error_feedback": False,
     "min_compression_rate": 1, "orthogonalization_epsilon": 1e-8, "random_seed": 7},
    {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2, "batch_tensors_with_same_shape": True},
]


def _assert_same(results: list) -> None:
    for ours, theirs in results:
        assert ours["iter"] == theirs["iter"] == len(ours["grads"])
        assert ours["stats"] == theirs["stats"]
        assert ours["errors"] == theirs["errors"]
        for step, (a, b) in enumerate(zip(ours["grads"], theirs["grads"])):
            for n in a:
                torch.testing.assert_close(a[n], b[n], rtol=0, atol=0, msg=lambda m: f"step {step} {n}: {m}")
        for n in ours["weights"]:
            assert torch.equal(ours["weights"][n], theirs["weights"][n]), n


@pytest.mark.parametrize("settings", SETTINGS, ids=["rank1", "rank4-qr", "cold-no-feedback", "batched"])
def test_matches_torch_powersgd(dist2, settings):
    # One bucket per step: the setting where torch's DDP with its hook runs on gloo.
    _assert_same(dist2.run(_train, settings, 6, 25.0))


@pytest.mark.parametrize("settings", SETTINGS[:2], ids=["rank1", "rank4-qr"])
def test_several_buckets_match_torch_hook(dist2, settings):
    # Six buckets in flight: ddpkit's hook against torch's run one bucket at a time.
    _assert_same(dist2.run(_train, settings, 5, 0.002, "serial-torch-hook"))


def _torch_hook_in_several_buckets(wrapped: bool) -> str:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = ddpkit.DDP(Net(), bucket_cap_mb=0.002)
    hook = torch_powersgd.powerSGD_hook
    ddp.register_comm_hook(torch_powersgd.PowerSGDState(None, 1, start_powerSGD_iter=2),
                           default_hooks.fp16_compress_wrapper(hook) if wrapped else hook)
    try:
        for _ in range(3):  # the first backward has one bucket (torch's rule); the rebuilt ones several
            ddp(torch.randn(5, 2, 6, 6)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "fp16-wrapped"])
def test_torchs_hook_in_several_buckets_on_gloo_is_refused_instead_of_hanging(dist2, wrapped):
    # It waits for each all-reduce inside gloo's callback of the one before: with several buckets it hung
    # forever on ddpkit's DDP (torch's DDP aborts the process on a collective mismatch).
    for message in dist2.run(_torch_hook_in_several_buckets, wrapped, timeout=60):
        assert "torch's powerSGD_hook deadlocks on gloo (tensors on cpu) with more than one bucket" in message
        assert "ddpkit.hooks.powersgd_hook" in message


def _chained(hook):
    def chain(state, bucket):
        return hook(state, bucket).then(lambda f: f.value())

    return chain


def _wrapped(wrapper: str) -> list[list[torch.Tensor]]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    wrap = default_hooks.fp16_compress_wrapper if wrapper == "fp16" else _chained
    torch.manual_seed(0)
    base = Net()
    out = []
    for ours in (True, False):
        model = copy.deepcopy(base)
        ddp = ddpkit.DDP(model) if ours else TorchDDP(model)
        state = (PowerSGDState if ours else torch_powersgd.PowerSGDState)(None, 1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, wrap(powersgd_hook if ours else torch_powersgd.powerSGD_hook))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(4):
            g = torch.Generator().manual_seed(100 * step + dist.get_rank())
            opt.zero_grad()
            x, y = torch.randn(5, 2, 6, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("wrapper", ["fp16", "then"])
def test_ddpkits_hook_under_torchs_fp16_wrapper_or_a_then_chain_trains_as_torchs(dist2, wrapper):
    # fp16_compress_wrapper hands the hook a half-precision buffer: bucket.gradients() gave float32 views of the
    # old one ("expected scalar type Float but found Half"); a .then() on the hook's future hung (its work ran only
    # when that future itself was waited for).
    for ours, theirs in dist2.run(_wrapped, wrapper, timeout=60):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)


def test_matches_torch_powersgd_one_bucket_world3(dist3):
    # Default buckets (the whole model in the first): gloo's three-way sums agree too.
    for ours, theirs in dist3.run(_train, SETTINGS[0], 4, 25.0):
        for n in ours["weights"]:
            torch.testing.assert_close(ours["weights"][n], theirs["weights"][n], rtol=1e-6, atol=1e-7)


def _compresses() -> tuple:
    torch.manual_seed(0)
    model = Net()
    ddp = ddpkit.DDP(model)
    state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powersgd_hook)
    for step in range(4):
        x = torch.randn(4, 2, 6, 6)
        ddp(x).sum().backward()
    return state.compression_stats()


def test_compression_rate(dist2):
    rate, before, after = dist2.run(_compresses)[0]
    assert rate > 10 and before == 2 * sum(p.numel() for p in Net().parameters())  # two compressed steps


def test_bad_settings():
    with pytest.raises(ValueError, match="start_powerSGD_iter=1: expect"):
        PowerSGDState(None, start_powerSGD_iter=1)
    with pytest.raises(ValueError, match="matrix_approximation_rank=0"):
        PowerSGDState(None, matrix_approximation_rank=0)
    PowerSGDState(None, start_powerSGD_iter=0, use_error_feedback=False, warm_start=False)  # allowed, as in torch


def test_state_pickles_without_its_process_group():
    import pickle

    state = PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=5)
    state.iter = 7
    copy_ = pickle.loads(pickle.dumps(state))
    assert copy_.process_group is None and copy_.iter == 7 and copy_.matrix_approximation_rank == 3
    assert copy_.rng.randint(1000) == state.rng.randint(1000)  # the same random stream continues


def _resumed(resume_at: int | None, steps: int = 8) -> torch.Tensor:
    """PowerSGD (rank 1, compressing from its third step) on a model of several buckets; with ``resume_at``, saved
    there as ddpkit train saves (each rank's state, the buckets once they are final) and continued in a new model,
    state and optimizer. The weights."""
    def fresh(weights: dict | None) -> tuple[nn.Module, nn.Module, PowerSGDState, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        if weights is not None:
            net.load_state_dict(weights)
        model = ddpkit.DDP(net, bucket_cap_mb=0.01)
        state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        model.register_comm_hook(state, powersgd_hook)
        return net, model, state, torch.optim.SGD(model.parameters(), lr=0.1)

    net, model, state, opt = fresh(None)
    for step in range(steps):
        if step == resume_at:
            buckets = model.bucket_indices() if model.buckets_final else None
            saved = copy.deepcopy(state.state_dict())
            net, model, state, opt = fresh(copy.deepcopy(net.state_dict()))
            if buckets is not None:
                model.restore_buckets(buckets)
            state.load_state_dict(saved)
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def test_a_state_saved_at_any_step_goes_on_in_the_same_bits(dist2):
    # Before the buckets' rebuild (step 1: none kept), at the first compressed step, and later; each rank's error.
    straight = dist2.run(_resumed, None)
    for at in (1, 2, 3, 6):
        assert all(torch.equal(a, b) for a, b in zip(dist2.run(_resumed, at), straight)), at

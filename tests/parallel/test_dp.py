"""ddpkit.DataParallel on CPU replicas in threads, against the plain module on the whole batch."""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections import namedtuple

import pytest
import torch
from torch import nn

import ddpkit

CPU3 = ["cpu", "cpu", "cpu"]
# Each replica computes its rows exactly as the whole-batch module would (the
# same kernels on fewer rows), but weight gradients are sums over rows split
# into per-replica partial sums: float32 reassociation, a few ulps.
TOL = {"rtol": 1e-5, "atol": 1e-6}
Pair = namedtuple("Pair", "a b")


class Nested(nn.Module):
    """Nested inputs and outputs, a kwarg, a non-tensor argument, and the thread it ran in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.threads: list[str] = []

    def forward(self, batch: dict, scale: float, *, extra: torch.Tensor) -> dict:
        self.threads.append(threading.current_thread().name)
        h = self.bn(self.lin(batch["x"])) * scale + extra
        return {"out": h, "pair": Pair(h.sum(1), [batch["ids"] * 2])}


def _run(model: nn.Module, x: torch.Tensor, ids: torch.Tensor, extra: torch.Tensor) -> tuple[dict, dict]:
    out = model({"x": x, "ids": ids}, 0.5, extra=extra)
    (out["out"].pow(2).sum() + out["pair"].a.sum()).backward()
    grads = {k: p.grad.clone() for k, p in ddpkit.unwrap(model).named_parameters()}
    return out, grads


@pytest.mark.parametrize("batch", [9, 8, 4])  # 4 rows make 2 chunks of 2: two replicas, not three
def test_matches_the_plain_module_on_the_whole_batch(batch):
    torch.manual_seed(0)
    net = Nested()
    ref = copy.deepcopy(net)
    x, ids, extra = torch.randn(batch, 4), torch.arange(batch), torch.randn(batch, 3)
    dp = ddpkit.DataParallel(net, device_ids=CPU3)
    assert ddpkit.unwrap(dp) is net
    out, grads = _run(dp, x, ids, extra)
    # BatchNorm normalises per replica: the reference runs the same chunks.
    ref_parts = [ref({"x": c, "ids": i}, 0.5, extra=e) for c, i, e in
                 zip(x.chunk(3), ids.chunk(3), extra.chunk(3))]
    ref_out = torch.cat([p["out"] for p in ref_parts])
    (ref_out.pow(2).sum() + torch.cat([p["pair"].a for p in ref_parts]).sum()).backward()
    torch.testing.assert_close(out["out"], ref_out, **TOL)
    assert isinstance(out["pair"], Pair) and out["pair"].b[0].tolist() == (ids * 2).tolist()
    for k, g in grads.items():
        torch.testing.assert_close(g, dict(ref.named_parameters())[k].grad, **TOL, msg=k)
    replicas = len(x.chunk(3))
    assert len(set(net.threads)) == replicas and all(t.startswith("ddpkit-dp-replica") for t in net.threads)


@pytest.mark.parametrize("rows", [8, 7, 1])  # even, odd, and fewer rows than replicas
def test_dim_1_and_plain_linear_equal_the_whole_batch(rows):
    torch.manual_seed(0)
    net = nn.Linear(5, 2)
    ref = copy.deepcopy(net)
    x = torch.randn(3, rows, 5)  # split along dim 1
    out = ddpkit.DataParallel(net, device_ids=["cpu", "cpu"], dim=1)(x)
    out.sum().backward()
    ref(x).sum().backward()
    # Exact against the reference run on the same chunks: the whole batch at once may take another kernel (a
    # matrix of 8 rows is blocked differently from two of 4 on some CPUs), within rounding.
    chunks = torch.cat([ref(c) for c in x.chunk(2, dim=1)], dim=1)
    torch.testing.assert_close(out, chunks, rtol=0, atol=0)
    torch.testing.assert_close(out, ref(x), **TOL)
    torch.testing.assert_close(net.weight.grad, ref.weight.grad, **TOL)


def test_first_replica_keeps_buffer_updates():
    bn = nn.BatchNorm1d(2)
    x = torch.randn(6, 2)
    ddpkit.DataParallel(bn, device_ids=["cpu", "cpu"])(x)
    ref = nn.BatchNorm1d(2)
    ref(x[:3])  # only the first replica's chunk reaches the module's own statistics
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=0, atol=0)
    assert int(bn.num_batches_tracked) == 1


def test_no_devices_runs_the_module_and_bad_input_is_named():
    net = nn.Linear(2, 2)
    if not torch.cuda.is_available():
        plain = ddpkit.DataParallel(net)  # no GPU: unwrapped, as torch does
        torch.testing.assert_close(plain(torch.ones(1, 2)), net(torch.ones(1, 2)))
        for ids in ([0, 1], ["cuda:0"]):  # GPU ids on a machine without GPUs: ignored, as torch ignores them
            ignored = ddpkit.DataParallel(net, device_ids=ids, output_device=0)
            assert ignored.device_ids == [] and ignored.output_device is None
            torch.testing.assert_close(ignored(torch.ones(3, 2)), net(torch.ones(3, 2)), rtol=0, atol=0)
    dp = ddpkit.DataParallel(net, device_ids=["cpu", "cpu"])
    with pytest.raises(ValueError, match="nothing to split"):
        dp(torch.ones(0, 2))
    with pytest.raises(ValueError, match="no input holds a tensor"):
        dp([1, 2])
    with pytest.raises(ValueError, match="is on cpu, but device_ids\\[0\\] is meta"):
        ddpkit.DataParallel(net, device_ids=["meta"])


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    note: str | None = None


class _Returns(nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.lin, self.what = nn.Linear(2, 3), what

    def forward(self, x: torch.Tensor):  # noqa: ANN201 - what the case returns
        h = self.lin(x)
        return {"dataclass": lambda: _Output(h), "int": lambda: x.shape[0], "loss": lambda: h.sum()}[self.what]()


def test_outputs_join_across_replicas_or_are_refused_by_name():
    # A dataclass came back as replica 0's alone (half the batch, without a word), an int as replica 0's count;
    # torch's gather raises on both (or builds them from a map object). A scalar per replica is stacked, with
    # torch's warning.
    torch.manual_seed(0)
    x = torch.randn(4, 2)
    whole = _Returns("dataclass")
    out = ddpkit.DataParallel(whole, device_ids=["cpu", "cpu"])(x)
    assert isinstance(out, _Output) and out.note is None
    torch.testing.assert_close(out.logits, whole.lin(x), rtol=0, atol=0)
    with pytest.raises(TypeError, match="replicas returned int values"):
        ddpkit.DataParallel(_Returns("int"), device_ids=["cpu", "cpu"])(x)
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        losses = ddpkit.DataParallel(_Returns("loss"), device_ids=["cpu", "cpu"])(x)
    assert losses.shape == (2,)


def test_a_replica_error_names_the_replica():
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x[0, 0] > 100:
                raise KeyError("bad row")
            return self.lin(x)

    x = torch.zeros(4, 2)
    x[2, 0] = 1000  # lands in the second replica's chunk
    with pytest.raises(KeyError, match="replica 1 on cpu"):
        ddpkit.DataParallel(Fails(), device_ids=["cpu", "cpu"])(x)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_replicas_match_the_plain_module():
    torch.manual_seed(0)
    net = nn.Linear(4, 3).cuda()
    ref = copy.deepcopy(net)
    x = torch.randn(8, 4, device="cuda")
    out = ddpkit.DataParallel(net)(x)
    out.sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(out, ref(x), **TOL)
    torch.testing.assert_close(net.weight.grad, ref.weight.grad, **TOL)

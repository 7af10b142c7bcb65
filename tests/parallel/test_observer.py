"""The engine's observers and the announcements of collectives, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.parallel.common.observer import BucketEvent, Observer, WaitEvent
from ddpkit.runtime import events


class _Everything(Observer):
    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int, int]] = []

    def on_bucket_ready(self, event: BucketEvent) -> None:
        self.seen.append(("ready", event.bucket, event.nbytes, event.step))

    def on_launch(self, event: BucketEvent) -> None:
        self.seen.append(("launch", event.bucket, event.nbytes, event.step))

    def on_done(self, event: BucketEvent) -> None:
        self.seen.append(("done", event.bucket, event.nbytes, event.step))

    def on_wait(self, event: WaitEvent) -> None:
        assert event.end >= event.start
        self.seen.append(("wait", -1, 0, event.step))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _events_of_three_steps() -> dict:
    model = ddpkit.DDP(_model(), bucket_cap_mb=0)  # after the rebuild: one parameter per bucket
    everything = _Everything()
    handle = model.register_observer(everything)
    for _ in range(3):
        model(torch.randn(2, 8)).sum().backward()
    sizes = [b.flat.numel() * b.flat.element_size() for b in model.reducer.buckets]
    handle.remove()
    model(torch.randn(2, 8)).sum().backward()  # detached: nothing more is seen
    return {"seen": everything.seen, "sizes": sizes}


def test_every_bucket_is_ready_launched_and_done_before_the_wait(dist2):
    for result in dist2.run(_events_of_three_steps):
        seen, sizes = result["seen"], result["sizes"]
        assert sum(1 for e in seen if e[0] == "wait") == 3 and [e[3] for e in seen if e[0] == "wait"] == [0, 1, 2]
        last_step = [e for e in seen if e[3] == 2]
        for kind in ("ready", "launch", "done"):
            assert sorted(e[1] for e in last_step if e[0] == kind) == list(range(len(sizes)))
            # The bytes are the bucket's: what an all-reduce without a comm hook sends.
            assert sorted((e[1], e[2]) for e in last_step if e[0] == kind) == list(enumerate(sizes))
        order = [e[0] for e in last_step]
        assert order[-1] == "wait"  # every on_done came before the wait's event
        launches = [e[1] for e in last_step if e[0] == "launch"]
        assert launches == sorted(launches)  # buckets launch in index order
        for b in range(len(sizes)):
            assert order.index("ready") <= [i for i, e in enumerate(last_step) if e[:2] == ("launch", b)][0]


class _OnlyWaits(Observer):
    def __init__(self) -> None:
        self.waits = 0

    def on_wait(self, event: WaitEvent) -> None:
        self.waits += 1


def _only_what_is_observed() -> tuple[int, int, int]:
    model = ddpkit.DDP(_model())
    waits = _OnlyWaits()
    model.register_observer(waits)
    for _ in range(12):  # past the iterations the logging data samples (1 to 10, then 1 in 100)
        model(torch.randn(2, 8)).sum().backward()
    model(torch.randn(2, 8))
    observers = model.reducer.observers
    # An observer of waits alone costs no event of the buckets, and no callback on their futures.
    return waits.waits, len(observers.launch) + len(observers.ready), len(observers.done)


def test_the_engine_does_the_work_of_observed_events_only(dist2):
    assert dist2.run(_only_what_is_observed) == [(12, 0, 0), (12, 0, 0)]


def test_an_observer_must_be_one():
    model = ddpkit.DDP(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="is not a ddpkit.parallel.common.observer.Observer"):
        model.register_observer(lambda event: None)


def _announced() -> dict:
    model = ddpkit.DDP(_model(), bucket_cap_mb=0)
    model(torch.randn(2, 8)).sum().backward()  # the first backward: one bucket, then the rebuild
    model(torch.randn(2, 8)).sum().backward()
    names: list[str] = []
    counter = events.ByteCounter()
    with events.observe(lambda e: names.append(e.name)), counter.counting():
        model(torch.randn(2, 8)).sum().backward()
        ddpkit.barrier()
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"names": names, "bytes": counter.total, "grads": grads, "count": counter.count}


def test_collectives_announce_themselves_with_their_payload(dist2):
    first, second = dist2.run(_announced)
    assert first == second
    # One announcement per bucket, then the barrier; the bytes are the gradients' (the barrier carries none).
    assert first["names"][-1] == "barrier" and len(first["names"]) == first["count"] == 5
    assert all(n.startswith("DDP bucket ") and n.endswith(" all-reduce") for n in first["names"][:-1])
    assert first["bytes"] == first["grads"]


def _hook_bytes() -> int:
    model = ddpkit.DDP(_model())
    model.register_comm_hook(None, ddpkit.hooks.fp16_compress_hook)
    counter = events.ByteCounter()
    with counter.counting():
        model(torch.randn(2, 8)).sum().backward()
    return counter.total


def test_a_compressing_hook_counts_what_it_sends(dist2):
    params = sum(p.numel() for p in _model().parameters())
    assert dist2.run(_hook_bytes) == [2 * params, 2 * params]  # float16: two bytes a gradient

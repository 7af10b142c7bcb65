"""The job's values in the store, sealed with its secret (``ddpkit.runtime.sealed_store``): what a process without
the secret writes, or moves from another key, scope or job, is refused by name; the job's own values go through."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ddpkit.runtime.sealed_store import ForgedValue, SealedStore, marked, seal

SECRET = "a" * 32
SCOPE = "ddpkit/0123/0/"


def _sealed(inner: dist.Store, token: str = SECRET, scope: str = SCOPE) -> dist.Store:
    store = seal(inner, token, scope)
    assert isinstance(store, SealedStore)
    return store


def test_the_jobs_values_go_through_and_counters_stay_plain() -> None:
    raw = dist.HashStore()
    store = _sealed(raw)
    store.set("address", "127.0.0.1:1234")
    assert store.get("address") == b"127.0.0.1:1234"
    assert raw.get("address") != b"127.0.0.1:1234"  # sealed on the wire
    store.multi_set(["a", "b"], [b"1", "two"])
    assert store.multi_get(["a", "b"]) == [b"1", b"two"]
    assert store.compare_set("fresh", "", "first") == b"first"  # "" expected: the key was absent
    assert store.compare_set("fresh", "first", "second") == b"second"
    assert store.compare_set("fresh", "wrong", "third") == b"second"
    assert store.add("count", 2) == 2 and raw.add("count", 0) == 2  # counters: plain integers
    assert store.check(["a", "count"]) and not store.check(["missing"])
    store.wait(["a"])
    store.wait(["a"], timedelta(seconds=1))
    assert store.delete_key("a") and not store.check(["a"])
    with pytest.raises(NotImplementedError, match="use set"):
        store.append("b", "x")


def test_a_job_without_a_secret_has_its_store_as_it_is() -> None:
    raw = dist.HashStore()
    assert seal(raw, None, SCOPE) is raw and seal(raw, "", SCOPE) is raw


@pytest.mark.parametrize("forger", ["unsealed", "another key", "another scope", "another secret", "short"])
def test_a_value_the_secret_did_not_seal_for_its_place_is_refused_naming_the_key(forger: str) -> None:
    raw = dist.HashStore()
    store = _sealed(raw)
    store.set("elsewhere", "10.0.0.9:4000")
    if forger == "unsealed":  # a process without the secret writes its own address
        raw.set("rank/1", "10.0.0.66:4000")
    elif forger == "another key":  # a genuine sealed value, moved
        raw.set("rank/1", raw.get("elsewhere"))
    elif forger == "another scope":  # sealed by the job, for another attempt or generation
        _sealed(raw, scope="ddpkit/0123/1/").set("rank/1", "10.0.0.9:4000")
    elif forger == "another secret":
        _sealed(raw, token="b" * 32).set("rank/1", "10.0.0.9:4000")
    else:
        raw.set("rank/1", "x")
    for read in (lambda: store.get("rank/1"), lambda: store.multi_get(["elsewhere", "rank/1"])):
        with pytest.raises(ForgedValue, match="'rank/1' was not written by a process holding the job's secret"):
            read()


def test_gloo_meets_through_the_seal_and_a_forged_value_under_its_prefix_is_refused() -> None:
    # A group of one meets through the sealed store (gloo's own keys, sealed); a forged address under a peer's key
    # fails the reader, where it would have connected to the forger.
    raw = dist.HashStore()
    sealed = _sealed(raw)  # (kept while the group lives: torch holds a Python store by its C++ part alone)
    group = dist.ProcessGroupGloo(dist.PrefixStore("g/", sealed), 0, 1, timedelta(seconds=10))
    t = torch.ones(2)
    group.allreduce([t]).wait()
    assert t.tolist() == [1.0, 1.0]
    raw.set("g//0", b"forged")
    with pytest.raises(ForgedValue):
        dist.PrefixStore("g/", sealed).get("0")


def test_a_mark_is_one_the_secret_sealed_and_a_forged_one_is_none() -> None:
    raw = dist.HashStore()
    store = _sealed(raw)
    assert not marked(store, "done/0/1")
    raw.set("done/0/1", "ok")  # a store client's: the key exists, its value opens under no secret
    assert store.check(["done/0/1"]) and not marked(store, "done/0/1")
    store.set("done/0/1", "ok")  # the launcher whose mark it is writes its own over it
    assert marked(store, "done/0/1")
    assert marked(raw, "done/0/1")  # a job without a secret: its keys as they are

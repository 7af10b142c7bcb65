"""The job's keys in a store that anyone who reaches it may read and write: each value sealed with the job's secret.

torch's ``TCPStore`` checks no one: any process that reaches its port may read every key (torch 2.13 lists them
all: ``list_keys()``), write any value and delete any key. A job's keys live under a prefix derived from its secret
(:func:`~ddpkit.runtime.rendezvous.job_keys`), but the prefix shows in the listing, so it hides nothing.

What a process trusts from the store is therefore sealed: :class:`SealedStore` stores each value after a MAC of
its place (the prefix the store was given as ``scope``, the key) and the value, under a key derived from the job's
secret, and checks it on every read. A value written without the secret, or moved from another key or scope (an
attempt, a generation of the membership), is refused (:class:`ForgedValue`) instead of believed: a process without
the secret cannot put its address among the ranks' (gloo's rendezvous reads them through this store), a seat among
the council's, or a value into the census. It can still read what the ranks publish (addresses, never the secret
or the training state) and stop the job by writing or deleting keys. What this does not cover: a value sealed in
another run under the same secret (give each run its own), counters (``add``: plain integers, which a MAC cannot
cover; one bumped makes the census pass a rank short or fail, and the job then fails at gloo's rendezvous) and
which keys exist (``check``, ``wait``: a forged one ends a wait early, and the read that follows fails; a mark that
would be believed for existing is read through :func:`marked`, which opens it), a key deleted or given back a value
the job sealed in it earlier (a seal binds a value to its place, not to its moment), and gloo's
own connections, which are not authenticated: a job across machines belongs on a network its owner trusts (as
torch's documentation says of c10d).
"""

from __future__ import annotations

import functools
import hmac
from datetime import timedelta

import torch.distributed as dist

from ddpkit.runtime.discovery import job_key

__all__ = ["ForgedValue", "SealedStore", "marked", "peek", "seal"]

_MAC_BYTES = 32


class ForgedValue(RuntimeError):
    """A value in the job's store that the job's secret did not seal (see the module notes)."""


@functools.cache
def _seal_key(token: str) -> bytes:
    return hmac.new(job_key(token), b"ddpkit seal", "sha256").digest()


class SealedStore(dist.Store):
    """``inner``'s keys, each value sealed under ``key`` for its place (``scope`` and the key itself).

    Its owner keeps a reference for as long as torch uses it (a process group made on it): torch holds a store
    subclassed in Python by its C++ part only, and once Python let go of the object, torch's calls into it fail
    ("Not implemented", "pure virtual function").
    """

    def __init__(self, inner: dist.Store, key: bytes, scope: str) -> None:
        super().__init__()
        self._inner, self._key, self._scope = inner, key, scope.encode()
        self._clones: list[SealedStore] = []
        """The stores :meth:`clone` made (torch's group splits hold them in C++ alone), kept as long as this one."""

    def _mac(self, key: str, value: bytes) -> bytes:
        place = b"%d:%s%d:%s" % (len(self._scope), self._scope, len(key.encode()), key.encode())
        return hmac.new(self._key, place + value, "sha256").digest()

    def _sealed(self, key: str, value: str | bytes) -> bytes:
        data = value.encode() if isinstance(value, str) else bytes(value)
        return self._mac(key, data) + data

    def _opened(self, key: str, raw: bytes) -> bytes:
        mac, data = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
        if len(raw) < _MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, data)):
            raise ForgedValue(
                f"the value under the job's key {key!r} was not written by a process holding the job's secret: "
                "something without it reached the job's store (torch's TCPStore admits any client) and wrote "
                "there; keep the job's ports on a network you trust"
            )
        return data

    def set(self, key: str, value: str | bytes) -> None:
        self._inner.set(key, self._sealed(key, value))

    def get(self, key: str) -> bytes:
        return self._opened(key, self._inner.get(key))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._inner.multi_set(keys, [self._sealed(k, v) for k, v in zip(keys, values, strict=True)])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self._opened(k, raw) for k, raw in zip(keys, self._inner.multi_get(keys), strict=True)]

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        # An empty ``expected`` means "the key is absent" to torch's store: it stays empty.
        raw = self._inner.compare_set(key, self._sealed(key, expected) if expected else expected,
                                      self._sealed(key, desired))
        return self._opened(key, raw) if raw else raw

    def append(self, key: str, value: str | bytes) -> None:
        raise NotImplementedError("append to a sealed store: each value carries one seal; use set")

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout

    def clone(self) -> SealedStore:
        twin = SealedStore(self._inner.clone(), self._key, self._scope.decode())
        self._clones.append(twin)
        return twin

    # The names torch's C++ side calls these by, through a store that wraps this one (a PrefixStore).
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815


def seal(store: dist.Store, token: str | None, scope: str) -> dist.Store:
    """``store`` with its values sealed by the job's secret ``token`` for ``scope`` (the prefix of the job's keys
    it holds); ``store`` itself where the job has no secret (a job started without ddpkit's launcher). The caller
    keeps the result while torch uses it (see :class:`SealedStore`)."""
    if not token:
        return store
    return SealedStore(store, _seal_key(token), scope)


def marked(store: dist.Store, key: str) -> bool:
    """Whether ``key`` holds a mark the job wrote: a value that opens under the job's secret (``store`` sealed, or
    a wrapper of a sealed one). One that a process without the secret wrote counts as none: its key exists, which
    ``check`` alone would believe (a forged "done" would have a launcher take a dead node for a finished one, or a
    member end without the run's final files), and the one whose mark it is writes its own over it.

    One look, which never waits (:func:`peek`)."""
    try:
        return peek(store, key) is not None
    except ForgedValue:
        return False


def peek(store: dist.Store, key: str) -> bytes | None:
    """``key``'s value (opened, where ``store`` is sealed), or None where it has none, in one look that never waits:
    a compare-and-set that sets nothing (``get`` after ``check`` would wait out the store's timeout for a key
    deleted in between).

    Raises:
        ForgedValue: the value was not sealed by the job's secret.
    """
    value = store.compare_set(key, _NO_MARK, _NO_MARK)
    return None if value == _NO_MARK else value


_NO_MARK = b"\0ddpkit: no mark here\0"
"""What :func:`marked`'s look returns for an absent key (a value no mark holds)."""

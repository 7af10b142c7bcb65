"""How the members of a fault-tolerant job agree before they go on: at the start and after every change of
membership each says how many steps it applied and what it runs (its *configuration*: the virtual shards, the
batch, the seed, the shuffling, the dataset's length, the model's layout, the comm hook); a member that runs
another configuration than the one whose state the job takes is refused by name, and whoever is behind receives
the state of the lowest rank that is furthest, in chunks of :data:`CHUNK_BYTES`.

The collectives are the caller's to wait for (``wait``: the membership's wait, which ends when a newer view comes).
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CHUNK_BYTES", "Comparison", "compare", "configuration", "difference", "root", "transfer"]

CHUNK_BYTES = 25 << 20
"""State transfers go in chunks of this size (a *chunk*; gradients go in buckets)."""

Wait = Callable[[Any], None]
"""Waits for a collective's work in the current view."""


def configuration(model: torch.nn.Module, *, virtual_shards: int, batch_size: int, seed: int, shuffle: bool,
                  drop_last: bool, samples: int, deterministic: bool, hook_name: str,
                  overlap: bool = True, accumulation: int = 1) -> dict[str, int]:
    """What every member must share to train the same samples into the same model and issue the same
    collectives, as numbers an int64 tensor carries (the model's layout and the hook's name as digests)."""
    return {"virtual_shards": int(virtual_shards), "batch_size": int(batch_size), "seed": int(seed),
            "shuffle": int(shuffle), "drop_last": int(drop_last), "samples": int(samples),
            "deterministic": int(deterministic), "overlap": int(overlap),
            "accumulation": int(accumulation),
            "parameters": _layout_hash((n, p) for n, p in model.named_parameters()),
            "buffers": _layout_hash(model.named_buffers()),
            "comm_hook": _name_hash(hook_name)}


def difference(name: str, there: int, here: int, hook_name: str) -> str:
    """One entry of a :func:`configuration` that differs, in words (``there``: the other side's value;
    ``hook_name``: this member's comm hook)."""
    if name in ("parameters", "buffers"):
        return f"the model's {name} (names, shapes, dtypes)"
    if name == "comm_hook":
        return f"the comm hook ({hook_name or 'none'} here)"
    return f"{name} {here} here, {there} there"


@dataclass
class Comparison:
    """What the members said of themselves (:func:`compare`)."""

    source: int
    """The lowest rank of those that applied the most steps: whose state the job takes."""
    transfer: bool
    """Whether its state goes to all (a member is behind, or one asked for it)."""
    differ: list[tuple[str, int, int]]
    """This member's configuration entries that differ from the source's: (name, here, there)."""


def compare(group: dist.ProcessGroup, wait: Wait, world_size: int, committed: int, force: bool,
            mine: Mapping[str, int]) -> Comparison:
    """Every member's applied steps and configuration (``mine`` here), compared; ``force``: a transfer even
    when every member applied as many steps (a start, where rank 0's state is everyone's)."""
    said = torch.tensor([committed, int(force), *mine.values()], dtype=torch.int64)
    gathered = [torch.empty_like(said) for _ in range(world_size)]
    wait(group.allgather([gathered], [said]))
    steps = [int(t[0]) for t in gathered]
    source = steps.index(max(steps))
    theirs = gathered[source][2:].tolist()
    differ = [(name, a, b) for (name, a), b in zip(mine.items(), theirs) if a != b]
    due = any(int(t[1]) for t in gathered) or len(set(steps)) > 1
    return Comparison(source, due, differ)


def transfer(group: dist.ProcessGroup, wait: Wait, rank: int, source: int,
             state: Callable[[], Mapping[str, Any]], device: torch.device) -> tuple[Mapping[str, Any] | None, int]:
    """The state of rank ``source`` (``state()`` there) to every rank, in chunks: on the others, the state and
    the bytes received; on the source, ``(None, 0)``."""
    if rank == source:
        buffer = io.BytesIO()
        torch.save(state(), buffer)
        payload = torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)  # (no copy: one holds Python's lock)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    wait(group.broadcast([size], root(source)))
    if rank != source:
        payload = torch.empty(int(size), dtype=torch.uint8)
    for start in range(0, int(size), CHUNK_BYTES):
        wait(group.broadcast([payload[start : start + CHUNK_BYTES]], root(source)))
    if rank == source:
        return None, 0
    received = torch.load(_Reader(memoryview(payload.numpy())), weights_only=True, map_location=device)
    return received, int(size)


class _Reader(io.RawIOBase):
    """A file over bytes already in memory, read in place: ``io.BytesIO`` would copy them whole first (a state of
    gigabytes: twice its memory, and Python's lock held long enough to look like a stalled worker)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._at = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, into: Any) -> int:
        n = max(0, min(len(into), len(self._view) - self._at))
        into[:n] = self._view[self._at : self._at + n]
        self._at += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        bases = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}
        if whence not in bases or bases[whence] + offset < 0:
            raise ValueError(f"seek({offset}, {whence}): not a position in the bytes")
        self._at = bases[whence] + offset
        return self._at

    def tell(self) -> int:
        return self._at


def root(rank: int) -> dist.BroadcastOptions:
    """A broadcast's options from ``rank``."""
    options = dist.BroadcastOptions()
    options.rootRank = rank
    return options


def _name_hash(name: str) -> int:
    """A name as a number the members can compare in an int64 tensor (0 for none)."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:15], 16) if name else 0


def _layout_hash(named: Any) -> int:
    """A 63-bit digest of named tensors' names, shapes and dtypes (the model's layout, not its values)."""
    text = json.dumps([(name, list(t.shape), str(t.dtype)) for name, t in named])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

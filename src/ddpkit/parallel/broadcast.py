"""Coalesced broadcasts of model state: parameters and buffers from one rank to all.

Used by :class:`ddpkit.parallel.ddp.DistributedDataParallel` at construction
(parameters and buffers), before forwards (buffers) and at the end of
``join()`` (the last joiner's model).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ddpkit.runtime import stall

_BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024
"""Largest message of a coalesced broadcast."""


class PackedBroadcast:
    """Broadcast rank 0's values of a fixed list of tensors, one message per device.

    Tensors of every dtype travel together as raw bytes at aligned offsets of
    a persistent buffer, so BatchNorm's float statistics and integer counters
    cost one collective, and a repeated broadcast (buffers, every forward)
    allocates nothing: rank 0 only packs, the others only unpack.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, what: str) -> None:
        self.group = group
        self.what = what
        """What is broadcast, as the stall inspector names it."""
        self.rank = dist.get_rank(group)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
        self.packs: list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        for device, members in by_device.items():
            offsets, size = [], 0
            for t in members:
                offsets.append(size)
                size += -(-_nbytes(t) // _ALIGN) * _ALIGN
            packed = torch.empty(size, dtype=torch.uint8, device=device)
            pairs = [(t, packed[o : o + _nbytes(t)].view(t.dtype).view(t.shape)) for t, o in zip(members, offsets)]
            self.packs.append((packed, pairs))

    def __call__(self, src: int = 0) -> None:
        """Broadcast from group rank ``src``."""
        # Same devices, tensors and sizes in the same order on every rank (the
        # parameters were verified identical), so the broadcasts match up.
        is_src = self.rank == src
        with torch.no_grad():
            for packed, pairs in self.packs:
                if is_src:
                    for t, view in pairs:
                        view.copy_(t)
                stall.enter("DDP broadcast {} from group rank {}", self.what, src)
                dist.broadcast(packed, src=dist.get_global_rank(self.group, src), group=self.group)
                if not is_src:
                    for t, view in pairs:
                        t.copy_(view)


_ALIGN = 16
"""Byte alignment of each tensor in a packed broadcast (any dtype can be viewed there)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def broadcast_once(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, what: str, src: int = 0) -> None:
    """Overwrite ``tensors`` with group rank ``src``'s values in messages of at most 250 MB."""
    chunk: list[torch.Tensor] = []
    size = 0
    for t in list(tensors) + [None]:  # type: ignore[list-item]
        if t is not None and (not chunk or size + _nbytes(t) <= _BROADCAST_CHUNK_BYTES):
            chunk.append(t)
            size += _nbytes(t)
            continue
        if chunk:
            PackedBroadcast(chunk, group, what)(src)
        if t is not None:
            chunk, size = [t], _nbytes(t)

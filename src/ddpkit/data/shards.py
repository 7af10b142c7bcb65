"""Virtual shards: every step's samples cut into a fixed number of shards, whoever trains them.

A :class:`DistributedSampler` ties samples to ranks, so a job that loses a
rank loses that rank's share. Here the unit is the *virtual shard*: the
global batch of step ``s`` is cut into ``V`` shards, fixed by the step alone,
and rank ``r`` of ``n`` trains shards ``r, r + n, r + 2n, ...`` of it (the
deterministic mode of fault tolerance deals contiguous runs of shards
instead, the runs of its tree of additions: ``ddpkit.parallel.fault_tolerance.shard_tree``). A
membership change moves shards between ranks, never samples between steps,
so every sample of an epoch is trained exactly once at any world size, and
the sampler's whole state is the step number.

The epoch's order is torch's sampler rule, ``randperm(len)`` seeded with
``seed + epoch`` (``0..len-1`` without shuffle); step ``k`` of the epoch is
positions ``k*B .. k*B+B-1`` of that order, and shard ``j`` of it every
``V``-th of those from the ``j``-th (torch's sampler deals samples to ranks
the same way, so at ``V`` = the world size a step trains exactly the batches
a ``DistributedSampler`` job does). The last step of an epoch is short
unless ``drop_last``; its shards differ in size by at most one (some may be
empty when it has fewer samples than shards).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["VirtualShards"]


class VirtualShards:
    """Which samples each step and each of its ``virtual_shards`` shards holds.

    Args:
        num_samples: the dataset's length.
        batch_size: the global batch of a step (all ranks together).
        virtual_shards: shards per step (at least the largest world size the job will have).
        shuffle: shuffle each epoch's order (torch's sampler rule, seeded with ``seed + epoch``).
        seed: the shuffle's seed.
        drop_last: leave out an epoch's last, short step.

    Raises:
        ValueError: a batch or shard count below 1, a batch that the shards do not divide, or a dataset too
            small for one step.
    """

    def __init__(self, num_samples: int, batch_size: int, virtual_shards: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        if batch_size < 1 or virtual_shards < 1:
            raise ValueError(f"batch_size {batch_size} and virtual_shards {virtual_shards} must be at least 1")
        if batch_size % virtual_shards:
            fit = math.ceil(batch_size / virtual_shards) * virtual_shards
            raise ValueError(f"batch_size {batch_size} is not a multiple of virtual_shards {virtual_shards}: every "
                             "shard of a full step must hold as many samples; choose a batch size that "
                             f"{virtual_shards} divides (e.g. {fit})")
        if num_samples < (batch_size if drop_last else 1):
            raise ValueError(f"{num_samples} samples make no step of {batch_size} with drop_last" if drop_last
                             else "the dataset is empty: 0 samples make no step")
        self.num_samples, self.batch_size, self.virtual_shards = num_samples, batch_size, virtual_shards
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.steps_per_epoch = num_samples // batch_size if drop_last else math.ceil(num_samples / batch_size)
        self._order: tuple[int, list[int]] | None = None

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def order(self, epoch: int) -> list[int]:
        """The epoch's order of sample indices."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                self._order = (epoch, torch.randperm(self.num_samples, generator=g).tolist())
            else:
                self._order = (epoch, list(range(self.num_samples)))
        return self._order[1]

    def step(self, step: int) -> list[int]:
        """The global batch of ``step`` (counted from the first step of epoch 0)."""
        k = step % self.steps_per_epoch
        return self.order(self.epoch_of(step))[k * self.batch_size : (k + 1) * self.batch_size]

    def shard(self, step: int, index: int) -> list[int]:
        """Shard ``index`` of ``step``'s batch: its positions ``index, index + V, ...`` (strided, as torch's
        sampler deals samples to ranks, so that at ``V`` = the world size shard ``r`` is the batch rank ``r`` of
        a :class:`DistributedSampler` job trains)."""
        return self.step(step)[index :: self.virtual_shards]

    def samples(self, step: int, shards: Sequence[int]) -> list[int]:
        """The samples of ``shards`` of ``step``, in the step's order: for rank ``r``'s shards at ``V = k n``
        (``r, r + n, ...``), the positions ``r, r + n, ...`` of the step, the batch rank ``r`` of a
        :class:`DistributedSampler` job of ``n`` trains."""
        if len(shards) == 1:
            return self.shard(step, shards[0])
        chosen = set(shards)
        return [i for p, i in enumerate(self.step(step)) if p % self.virtual_shards in chosen]

    def shards_of(self, rank: int, world_size: int) -> range:
        """The shard indices rank ``rank`` of ``world_size`` trains in every step."""
        return range(rank, self.virtual_shards, world_size)

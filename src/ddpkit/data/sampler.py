"""``DistributedSampler``: each rank's disjoint shard of a dataset, resumable mid-epoch.

For the same arguments it yields exactly the indices of
torch's own ``DistributedSampler`` (the test suite checks every
combination of length, world size, rank, shuffle, seed, drop_last and epoch),
and adds three things:

* ``state_dict()`` / ``load_state_dict()``: the epoch and how far into it this
  rank has got, so a job restarted mid-epoch continues with the next sample
  instead of repeating or skipping any.
* ``pad=False``, the evaluation mode: no sample is repeated to even out the
  shards, so summing per-rank counts over all ranks counts every sample exactly
  once. Shards then differ in length by at most one.
* A one-time ``UserWarning`` when a shuffling sampler starts a second pass over
  the same epoch, the classic forgotten ``set_epoch`` that makes every epoch
  see the same order.

How the shards are formed (torch's rule): the epoch's order is
``randperm(len(dataset))`` seeded with ``seed + epoch`` (or ``0..n-1`` without
shuffle). With ``drop_last=False`` the order is padded by repeating its head
until it divides evenly by ``num_replicas``; with ``drop_last=True`` the tail
is cut instead. Rank ``r`` takes positions ``r, r + R, r + 2R, ...``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ddpkit.runtime import group

__all__ = ["DistributedSampler"]

_STATE_VERSION = 1


class DistributedSampler(Sampler[int]):
    """Yield this rank's share of the dataset's indices, as torch's sampler does.

    Args:
        dataset: Anything with ``len()``.
        num_replicas: Number of ranks sharing the data. Default: the world size
            of the initialised process group, else of the launcher environment.
        rank: This rank, ``0 <= rank < num_replicas``. Default: the process's rank.
        shuffle: Shuffle with a generator seeded by ``seed + epoch`` (default True).
        seed: Same on every rank (default 0).
        drop_last: Cut the tail so shards are even instead of padding (default False).
        pad: Keyword only. True (default, training): pad the shards to equal
            length by repeating samples, as torch does. False (evaluation): no
            padding, every sample belongs to exactly one rank; shard lengths
            differ by at most one, so do not run a collective per batch.

    Raises:
        ValueError: ``rank`` outside ``0..num_replicas-1``, ``num_replicas < 1``,
            or ``pad=False`` with ``drop_last=True`` (which would drop samples
            the evaluation mode promises to count).

    Warning:
        Call :meth:`set_epoch` before each epoch when shuffling; otherwise
        every epoch sees the same order (warned once).

    Example::

        sampler = ddpkit.DistributedSampler(train_set, shuffle=True, seed=0)
        loader = DataLoader(train_set, batch_size=64, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader: ...
        eval_sampler = ddpkit.DistributedSampler(test_set, shuffle=False, pad=False)
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        pad: bool = True,
    ) -> None:
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_initialized() else group.world_size()
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else group.rank()
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas} must be at least 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank={rank} is out of range for num_replicas={num_replicas}: "
                f"use 0..{num_replicas - 1}"
            )
        if drop_last and not pad:
            raise ValueError(
                "drop_last=True with pad=False: the evaluation mode counts every sample "
                "once, so it cannot drop any; use drop_last=False"
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad = pad
        self.epoch = 0
        # Positions of the epoch's order used before this shard began: non-zero
        # only after a mid-epoch state saved at another world size was loaded,
        # whose rest of the epoch is then re-sharded over this world.
        self._offset = 0
        self._size()
        # Progress through the current pass, and where the next pass starts
        # (non-zero only after load_state_dict restored a mid-epoch state).
        self._consumed = 0
        self._start = 0
        self._passes_at_epoch: int | None = None
        self._warned = False

    def _size(self) -> None:
        """``num_samples`` (this rank's) and ``total_size`` of the epoch's rest from the offset (torch's rule)."""
        self._built_for = len(self.dataset)
        n, replicas = max(0, self._built_for - self._offset), self.num_replicas
        if self.drop_last and n % replicas != 0:
            self.num_samples = math.ceil((n - replicas) / replicas)
        else:
            self.num_samples = math.ceil(n / replicas)
        self.total_size = self.num_samples * replicas
        if not self.pad:
            self.num_samples = len(range(self.rank, n, replicas))

    def _epoch_indices(self) -> list[int]:
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        # The rest of the epoch from the offset, padded from the head of the
        # whole order as torch pads: at the world size that saved the offset
        # this is exactly the continuation of the original shards.
        indices = order[self._offset :]
        if not self.pad:
            return indices[self.rank :: self.num_replicas]
        if self.drop_last:
            indices = indices[: self.total_size]
        else:
            padding = self.total_size - len(indices)
            if padding > 0:
                indices += (order * math.ceil(padding / n))[:padding]
        if len(indices) != self.total_size:
            # torch's sampler fails here too (an AssertionError): the shards were sized at construction.
            raise AssertionError(
                f"the dataset has {n} samples now, but this DistributedSampler was built for {self._built_for}: "
                "build a new sampler after the dataset changes size"
            )
        return indices[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        if self.shuffle and self._start == 0:
            if self._passes_at_epoch == self.epoch and not self._warned:
                self._warned = True
                warnings.warn(
                    f"DistributedSampler(shuffle=True) is starting a second pass over epoch "
                    f"{self.epoch} in the same order: call sampler.set_epoch(epoch) before "
                    "each epoch, or every epoch sees the same shuffle",
                    UserWarning,
                    stacklevel=2,
                )
            self._passes_at_epoch = self.epoch
        indices = self._epoch_indices()[self._start :]
        self._consumed = self._start
        self._start = 0
        return self._count(indices)

    def _count(self, indices: list[int]) -> Iterator[int]:
        for i in indices:
            # Counted before the yield: once the consumer holds index i, the
            # state must say i is consumed, or a resume would repeat it.
            self._consumed += 1
            yield i

    def __len__(self) -> int:
        return self.num_samples - self._start

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch: it seeds the shuffle and resets the mid-epoch position."""
        self.epoch = epoch
        self._consumed = 0
        self._start = 0
        if self._offset:
            self._offset = 0
            self._size()

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The sampler's position: epoch and samples of this epoch already used by this rank.

        Args:
            consumed: Samples of the current epoch this rank has processed.
                Default: the number of indices the current iterator handed
                out. Pass it explicitly when a ``DataLoader`` with worker
                processes prefetches ahead of the training loop (e.g.
                ``batches_done * batch_size``).

        Returns:
            Plain data (ints, bools), safe for :func:`ddpkit.save_checkpoint`.
        """
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "consumed": self._consumed if consumed is None else int(consumed),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "pad": self.pad,
            "num_replicas": self.num_replicas,
            "dataset_len": len(self.dataset),
            "offset": self._offset,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`: the next pass starts where it left off.

        The state is resumed into a sampler over the same dataset and
        shuffle settings. At the same ``num_replicas`` the epoch continues
        exactly. At another one (an elastic job that lost or gained ranks),
        what was left of the epoch is re-sharded: every rank consumed the same
        number of samples (the padded shards are equal), so the first
        ``consumed x num_replicas`` positions of the epoch's order are done,
        and the rest is split over the new ranks by torch's rule (padded from
        the head of the order). No sample is skipped; at most
        ``num_replicas - 1`` padding samples repeat, as in any padded epoch.
        The evaluation mode (``pad=False``), whose shards differ in length,
        cannot be re-sharded mid-epoch.

        Raises:
            ValueError: the state does not match this sampler's dataset or settings.
        """
        for key in ("seed", "shuffle", "drop_last", "pad"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}: build the sampler with the saved settings"
                )
        if state["dataset_len"] != len(self.dataset):
            raise ValueError(
                f"sampler state is for a dataset of {state['dataset_len']} samples, this one "
                f"has {len(self.dataset)}: resume with the same dataset"
            )
        consumed = int(state["consumed"])
        self.epoch = int(state["epoch"])
        self._offset = int(state.get("offset", 0))
        if state["num_replicas"] != self.num_replicas:
            if consumed and not self.pad:
                raise ValueError(
                    f"sampler state was saved mid-epoch with num_replicas={state['num_replicas']} and pad=False, "
                    f"this sampler has num_replicas={self.num_replicas}: uneven evaluation shards cannot be "
                    "re-sharded; resume with the same world size, or from an epoch boundary"
                )
            self._offset = min(len(self.dataset), self._offset + consumed * int(state["num_replicas"]))
            consumed = 0
        self._size()
        if not 0 <= consumed <= self.num_samples:
            raise ValueError(
                f"sampler state has consumed={consumed}, outside 0..{self.num_samples} "
                "for this rank's shard"
            )
        self._start = consumed
        self._consumed = consumed
        # A resumed epoch is the continuation of a pass, not a second one.
        self._passes_at_epoch = None

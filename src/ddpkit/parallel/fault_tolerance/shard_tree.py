"""The fixed tree along which the deterministic mode of fault tolerance adds the shards' gradients.

The gradient of a step is the sum of its ``V`` shards' gradients. Floating-point addition is not associative, so
the bits depend on the order of the additions; the deterministic mode fixes that order once, as a binary tree
over the shards ``0..V-1`` (each node ``[lo, hi)`` is the sum of its halves ``[lo, mid)`` and ``[mid, hi)``,
``mid = (lo + hi) // 2``), so that whoever trains which shard, every rank at every world size gets the same
bits.

Rank ``r`` of ``n`` trains a contiguous run of shards, ``[r V // n, (r + 1) V // n)``. It adds, on its own, the
largest nodes of the tree that lie inside its run (a segment tree's cover of it: at most two per level) and
sends only those partial sums; the owner of each block of the gradient finishes the tree from the partial sums
of all ranks. Where ``n`` and ``V`` are powers of two, a rank's run is one node: it sends one gradient whatever
the number of shards it trains, where the shard-by-shard order sent ``V/n``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

__all__ = ["ShardTree"]

Node = tuple[int, int]
"""A node of the tree: the shards ``[lo, hi)``."""


class ShardTree:
    """The tree over ``virtual_shards`` shards, as trained by ``world_size`` ranks.

    Raises:
        ValueError: fewer shards than ranks (a rank would train none).
    """

    def __init__(self, virtual_shards: int, world_size: int) -> None:
        if not 1 <= world_size <= virtual_shards:
            raise ValueError(f"{virtual_shards} shards cannot be trained by {world_size} ranks: each trains at "
                             "least one")
        self.virtual_shards, self.world_size = virtual_shards, world_size
        self.runs = [range(r * virtual_shards // world_size, (r + 1) * virtual_shards // world_size)
                     for r in range(world_size)]
        """Each rank's shards."""
        self.covers: list[list[Node]] = [self._cover((0, virtual_shards), run.start, run.stop) for run in self.runs]
        """Each rank's partial sums: the largest nodes inside its run, in shard order."""
        self.sent: dict[Node, tuple[int, int]] = {node: (rank, j) for rank, cover in enumerate(self.covers)
                                                  for j, node in enumerate(cover)}
        """Where each partial sum travels: its rank and its row among that rank's."""
        self.rows = max(len(cover) for cover in self.covers)
        """Partial sums per rank in the exchange (the most any rank sends)."""

    @staticmethod
    def _halves(node: Node) -> tuple[Node, Node]:
        lo, hi = node
        mid = (lo + hi) // 2
        return (lo, mid), (mid, hi)

    def _cover(self, node: Node, start: int, stop: int) -> list[Node]:
        lo, hi = node
        if hi <= start or stop <= lo:
            return []
        if start <= lo and hi <= stop:
            return [node]
        left, right = self._halves(node)
        return self._cover(left, start, stop) + self._cover(right, start, stop)

    def schedule(self, rank: int) -> list[tuple[int, bool]]:
        """How ``rank`` adds its run's shards as they come, one at a time (:class:`~.ordered_sum.OrderedSum`):
        for each shard of the run in order, how many of the tree's additions it completes (each adds the two
        newest sums, left plus right: the nodes of the run's cover in post-order), and whether it completes a
        node of :attr:`covers` (a partial sum to send). A stack of sums then never holds more than one sum per
        level of the tree, plus one."""
        plan: list[tuple[int, bool]] = []

        def visit(node: Node) -> None:
            if node[1] - node[0] == 1:
                plan.append((0, False))
                return
            left, right = self._halves(node)
            visit(left)
            visit(right)
            merges, done = plan[-1]
            plan[-1] = (merges + 1, done)

        for node in self.covers[rank]:
            visit(node)
            plan[-1] = (plan[-1][0], True)
        return plan

    def owner(self, shard: int) -> tuple[int, int]:
        """The rank that trains ``shard`` and its place among that rank's shards."""
        rank = next(r for r, run in enumerate(self.runs) if shard in run)
        return rank, shard - self.runs[rank].start

    def add(self, node: Node, known: Mapping[Node, torch.Tensor], leaf: Callable[[int], torch.Tensor],
            out: torch.Tensor | None = None, scratch: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The sum of ``node``'s shards along the tree: a node in ``known`` is its value, a single shard
        ``leaf(shard)``, any other the sum of its halves.

        Without ``out``: a new tensor (or the known value or leaf itself). With ``out``: written there, the
        right halves' sums in ``scratch`` (tensors like ``out``, one per level below the node, appended when
        missing: keep the list from call to call and no memory is allocated again). The bits are the same
        either way: each node is one addition of its halves' values."""
        if node in known or node[1] - node[0] == 1:
            value = known[node] if node in known else leaf(node[0])
            return value if out is None else out.copy_(value)
        left, right = self._halves(node)
        if out is None:
            return torch.add(self.add(left, known, leaf), self.add(right, known, leaf))
        return self._into(node, known, leaf, out, scratch if scratch is not None else [], 0)

    def _into(self, node: Node, known: Mapping[Node, torch.Tensor], leaf: Callable[[int], torch.Tensor],
              out: torch.Tensor, scratch: list[torch.Tensor], level: int) -> torch.Tensor:
        if node in known or node[1] - node[0] == 1:
            return out.copy_(known[node] if node in known else leaf(node[0]))
        left, right = self._halves(node)
        self._into(left, known, leaf, out, scratch, level + 1)
        if right in known or right[1] - right[0] == 1:
            return out.add_(known[right] if right in known else leaf(right[0]))
        if len(scratch) <= level:
            scratch.extend(torch.empty_like(out) for _ in range(level + 1 - len(scratch)))
        if scratch[level].shape != out.shape or scratch[level].dtype != out.dtype:
            scratch[level] = torch.empty_like(out)
        return out.add_(self._into(right, known, leaf, scratch[level], scratch, level + 1))

    def total(self, known: Mapping[Node, torch.Tensor], leaf: Callable[[int], torch.Tensor],
              out: torch.Tensor | None = None, scratch: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The sum of every shard (the root) along the tree (into ``out`` when given: see :meth:`add`)."""
        return self.add((0, self.virtual_shards), known, leaf, out, scratch)

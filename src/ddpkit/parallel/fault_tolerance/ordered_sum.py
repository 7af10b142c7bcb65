"""The deterministic mode's reduction: the shards' gradients added along the fixed tree of :mod:`.shard_tree`,
whichever rank trained which, so that every rank at every world size gets the same bits.

A reduce-scatter and an all-gather, both as all-to-alls (gloo's all-to-all moves bytes about four times faster
than its all-gather): each rank adds the tree's nodes inside its run of shards; the gradient is cut into one block
per rank, and each rank receives every rank's partial sums of its own block, adds them along the tree, and sends
its block's sum to all. Each rank receives as many gradients' worth of blocks as a rank sends partial sums (one
where ``n`` and ``V`` are powers of two), and one gradient.

Under a comm hook that only changes the dtype (:data:`.hook_reduction.DTYPE_HOOKS`) the rows are scaled by
:func:`wire_scale` and rounded to its dtype once, and the tree adds and sends in it; the result is unscaled in
float32 (both exact).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.parallel.fault_tolerance.shard_tree import ShardTree

__all__ = ["Collective", "OrderedSum", "wire_scale"]

Collective = Callable[[str, torch.Tensor, Callable[[], Any]], None]
"""How the reduction runs one of the step's collectives: ``collective(what, payload, start)`` tells the observers
(``what``, the bytes of ``payload``), calls ``start()`` for the work and waits for it (the caller's wait, which
ends when the membership changes)."""


def wire_scale(virtual_shards: int) -> float:
    """What a dtype hook's rows are multiplied by before they are rounded to its dtype: the power of two nearest
    ``V``, so that a shard's share of the gradient (about ``1 / V`` of it) is about the size of the gradient
    itself, and half precision underflows no sooner than under DDP's hook (whose parts are ``1 / n`` of it); the
    tree's sums reach about ``V`` times the gradient, so it overflows that much sooner. It depends on ``V``
    alone: the same bits at any world size, whoever holds which shard."""
    return 2.0 ** round(math.log2(virtual_shards))


class OrderedSum:
    """The deterministic mode's reduction of one step at a time (see the module notes).

    A step begins with :meth:`start`; each shard of this rank's run is written into :meth:`leaf` (its weighted
    gradient, float32) and taken in with :meth:`push`, which does at once the tree's additions it completes
    (:meth:`ShardTree.schedule`), so that the shards' gradients are never all held: a stack holds at most one
    sum per level of the tree, plus one; :meth:`finish` exchanges the partial sums and returns the total.
    Where every rank sends one partial sum (``tree.rows == 1``: ``n`` and ``V`` powers of two), the stack's bottom
    is the send buffer itself.

    Its room (the stack, the exchange: the send and receive layouts, the block sums sent to all (in the send
    buffer where every rank sends one sum), and two results in turn; with a dtype hook a float32 leaf) is kept
    between steps, since fresh buffers would be new pages every
    step. ``.grad`` views the result, so a gradient kept from one step stays intact through the next step's
    reduction and is overwritten by the one after. :meth:`drop` lets it all go (after a membership change an
    abandoned operation may still write it).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._exchange: list[torch.Tensor] = []
        """send, receive, the block sums sent to all (a view of send where it is one row), and two results in
        turn."""
        self._slots: list[torch.Tensor] = []
        """The stack's room, in the wire dtype (slot 0 a view of the send buffer where every rank sends one sum)."""
        self._staged: torch.Tensor | None = None
        """Under a dtype hook: the float32 leaf, scaled and rounded into the stack by :meth:`push`."""
        self._scratch: list[torch.Tensor] = []
        """Room for the tree's sums of halves of a block (:meth:`ShardTree.total`)."""
        self._tree: ShardTree | None = None
        self._rank = 0
        self._numel = 0
        self._wire = torch.float32
        self._plan: list[tuple[int, bool]] = []
        self._stack: list[int] = []
        """The slots holding sums, bottom first."""
        self._next = 0
        """The next shard of the run to be taken in (a shard without samples is taken in as zeros)."""
        self._cover = 0
        """Partial sums of this step completed so far."""
        self._total: torch.Tensor | None = None
        """A world of one: the slot holding the tree's total."""
        self._turns: list[torch.Tensor] = []
        """Two float32 results in turn, where the result is not one of the exchange's (:meth:`_result`)."""

    def drop(self) -> None:
        self._exchange, self._slots, self._staged, self._scratch, self._turns = [], [], None, [], []
        self._stack, self._total = [], None

    def start(self, tree: ShardTree, rank: int, numel: int, exchange: bool,
              wire: torch.dtype = torch.float32) -> None:
        """A new step: this rank's run of ``tree``, gradients of ``numel`` elements, added and sent in ``wire``;
        ``exchange``: with other ranks (else a world of one, or no group)."""
        self._tree, self._rank, self._numel, self._wire = tree, rank, numel, wire
        self._plan = tree.schedule(rank)
        self._stack, self._next, self._cover, self._total = [], tree.runs[rank].start, 0, None
        if exchange:
            n = tree.world_size
            shape = (n, tree.rows, -(-numel // n))  # the block of rank b: elements [b * width, (b + 1) * width)
            if not self._exchange or self._exchange[0].shape != shape or self._exchange[0].dtype != wire:
                send, received = (torch.zeros(shape, dtype=wire, device=self.device) for _ in range(2))
                # The block sums sent to all: in the send buffer itself where it is one row (free again once the
                # partial sums arrived), else room of their own; then two results in turn.
                blocks = send.view(n, shape[2]) if tree.rows == 1 else torch.empty(n, shape[2], dtype=wire,
                                                                                    device=self.device)
                self._exchange = [send, received, blocks] + [
                    torch.empty(n, shape[2], dtype=wire, device=self.device) for _ in range(2)]
                self._scratch = []
                self._slots = []
        elif self._exchange:
            self._exchange, self._scratch, self._slots = [], [], []
        if self._slots and (self._slots[0].numel() != numel or self._slots[0].dtype != wire):
            self._slots = []
        if wire != torch.float32 and (self._staged is None or self._staged.numel() != numel):
            self._staged = torch.empty(numel, dtype=torch.float32, device=self.device)

    def leaf(self, shard: int) -> torch.Tensor:
        """Where ``shard``'s weighted gradient goes (float32, every element written before :meth:`push`); the
        shards of the run before it that came without samples are taken in as zeros first."""
        assert self._tree is not None and self._next <= shard < self._tree.runs[self._rank].stop, shard
        while self._next < shard:
            self._slot(len(self._stack)).zero_()
            self._take()
        return self._staged if self._wire != torch.float32 else self._slot(len(self._stack))  # type: ignore

    def push(self) -> None:
        """Take in the shard written into :meth:`leaf`."""
        if self._wire != torch.float32:  # scaled in float32, then rounded once
            assert self._tree is not None and self._staged is not None
            torch.mul(self._staged, wire_scale(self._tree.virtual_shards), out=self._slot(len(self._stack)))
        self._take()

    def finish(self, group: dist.ProcessGroup | None, collective: Collective) -> torch.Tensor:
        """The step's sum over every rank along the tree (float32), as a tensor that the next step's reduction
        leaves intact; the run's shards not taken in count as zeros."""
        tree = self._tree
        assert tree is not None
        for _ in range(self._next, tree.runs[self._rank].stop):
            self._slot(len(self._stack)).zero_()
            self._take()
        g, wire = self._numel, self._wire
        if not self._exchange:
            assert self._total is not None
            return self._result(self._total)
        send, received, blocks, *totals = self._exchange
        collective("ordered reduction: the partial sums' blocks to their ranks", send,
                   lambda: group.alltoall_base(received, send, [], []))  # type: ignore[union-attr]
        block = blocks[0]
        tree.total({node: received[r, j] for node, (r, j) in tree.sent.items()},
                   lambda shard: torch.zeros(0), out=block, scratch=self._scratch)  # every shard is in a partial
        blocks[1:] = block
        totals.reverse()  # two in turn: ``.grad`` views the last step's while this one's arrives
        self._exchange[3:] = totals
        total = totals[0]
        collective("ordered reduction: each block's sum to all", blocks,
                   lambda: group.alltoall_base(total, blocks, [], []))  # type: ignore[union-attr]
        if blocks.data_ptr() == send.data_ptr():
            send.view(-1)[g:].zero_()  # the tail past the gradient, which the block sums wrote, is zero again
        summed = total.view(-1)[:g]
        return summed if wire == torch.float32 else self._result(summed)

    def _slot(self, depth: int) -> torch.Tensor:
        """The stack's room at ``depth`` (at the bottom the send buffer's row itself where every rank sends one sum)."""
        while len(self._slots) <= depth:
            if not self._slots and self._exchange and self._exchange[0].shape[1] == 1:
                self._slots.append(self._exchange[0].view(-1)[: self._numel])  # the tail stays zero
            else:
                self._slots.append(torch.empty(self._numel, dtype=self._wire, device=self.device))
        return self._slots[depth]

    def _take(self) -> None:
        """The leaf just written at the stack's top is in: the additions it completes, a partial sum sent."""
        assert self._tree is not None
        merges, done = self._plan[self._next - self._tree.runs[self._rank].start]
        self._next += 1
        self._stack.append(len(self._stack))
        for _ in range(merges):  # the newest two are a node's halves: left plus right, in place in the left
            right = self._stack.pop()
            self._slots[self._stack[-1]].add_(self._slots[right])
        if not done:
            return
        assert len(self._stack) == 1, self._stack
        partial = self._slots[self._stack.pop()]
        if not self._exchange:
            self._total = partial  # a world of one: the root
            return
        send, n, g = self._exchange[0], self._tree.world_size, self._numel
        if send.shape[1] > 1:  # cut into the blocks (with one partial sum every rank, the bottom slot is the send row)
            width = send.shape[2]
            for b in range(n):
                lo, hi = min(b * width, g), min((b + 1) * width, g)  # a tiny gradient leaves the last blocks empty
                send[b, self._cover, : hi - lo] = partial[lo:hi]
        self._cover += 1

    def _result(self, total: torch.Tensor) -> torch.Tensor:
        """The tree's ``total`` as float32 in one of two results that take turns (the last step's ``.grad`` views
        the other), unscaled under a dtype hook (the copy and the division both exact)."""
        if not self._turns or self._turns[0].numel() != self._numel:
            self._turns = [torch.empty(self._numel, dtype=torch.float32, device=self.device) for _ in range(2)]
        self._turns.reverse()
        result = self._turns[0].copy_(total)
        if self._wire == torch.float32:
            return result
        assert self._tree is not None
        return result.div_(wire_scale(self._tree.virtual_shards))

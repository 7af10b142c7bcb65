"""The all-reduce algorithms of :mod:`ddpkit.comm.allreduce`, from point-to-point messages.

Each takes the flat tensor to reduce in place, the group ranks taking part
(``members``, in order), this rank's group rank (``me``) and the op. Messages
are exchanged with ``batch_isend_irecv`` (a send and a receive at once, so a
ring never deadlocks); empty messages are skipped on both sides. The
reductions combine in a fixed order on every run (rank order for ``naive``,
the tree's and the ring's order otherwise), so repeated runs agree bitwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ddpkit.runtime.devices import comm_device

__all__ = ["COMBINE", "exchange", "hierarchical_all_reduce", "naive_all_reduce", "ring_all_gather",
           "ring_all_reduce", "ring_reduce_scatter", "tree_broadcast", "tree_reduce"]

COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "sum": lambda a, b: a.add_(b), "avg": lambda a, b: a.add_(b), "prod": lambda a, b: a.mul_(b),
    "min": lambda a, b: torch.minimum(a, b, out=a), "max": lambda a, b: torch.maximum(a, b, out=a),
    "band": lambda a, b: a.bitwise_and_(b), "bor": lambda a, b: a.bitwise_or_(b),
    "bxor": lambda a, b: a.bitwise_xor_(b),
}
"""How each op combines a received tensor into this rank's, in place."""


PIECE_ELEMENTS = 1 << 18
"""Elements of the pieces a large message travels in through the CPU (gloo, MPI; 1 MiB of float32, 512 KiB of a
16-bit dtype): posted together, a send and a receive between the same two ranks then flow both ways at once.
Measured across two testbed nodes at 1 Gbit/s, 8 MB each way between two ranks: 137 ms as one message each way (one
way alone: 49 ms), 71 ms in 1 MiB pieces, gloo's own all-reduce of the same 72 ms
(``scripts/algorithms_across_nodes.py`` measures the algorithms)."""


def exchange(send: torch.Tensor | None, to: int, recv: torch.Tensor | None, frm: int,
              group: dist.ProcessGroup) -> None:
    """Send and receive at once (group ranks); empty messages are skipped on both sides.

    Through the CPU a message of more than :data:`PIECE_ELEMENTS` goes in pieces of that many elements, all posted
    at once (both sides cut it alike: a message's sender and receiver hold the same number of elements); NCCL's
    messages go whole.

    gloo's point-to-point messages take CPU tensors only (handed a CUDA
    tensor it writes from a device address and fails, "Bad address", or
    aborts): CUDA tensors on such a group go through the CPU.
    """
    ops = []
    send = send if send is not None and send.numel() else None
    recv = recv if recv is not None and recv.numel() else None
    device = comm_device(group, like=send if send is not None else recv)
    staged = torch.empty_like(recv, device=device) if recv is not None and recv.device != device else recv
    whole = max(1, send.numel() if send is not None else 0, staged.numel() if staged is not None else 0)
    piece = PIECE_ELEMENTS if device.type == "cpu" else whole
    flat = send.to(device).reshape(-1) if send is not None else None
    sends = [flat[i : i + piece] for i in range(0, flat.numel(), piece)] if flat is not None else []
    recvs = [staged.view(-1)[i : i + piece] for i in range(0, staged.numel(), piece)] if staged is not None else []
    for k in range(max(len(sends), len(recvs))):
        if k < len(sends):
            ops.append(dist.P2POp(dist.isend, sends[k], dist.get_global_rank(group, to), group))
        if k < len(recvs):
            ops.append(dist.P2POp(dist.irecv, recvs[k], dist.get_global_rank(group, frm), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if staged is not recv:
        recv.copy_(staged)  # type: ignore[union-attr]


def tree_reduce(flat: torch.Tensor, members: list[int], me: int, op: str, group: dist.ProcessGroup) -> None:
    """Binomial tree: the result ends on members[0]."""
    i, n = members.index(me), len(members)
    scratch = torch.empty_like(flat)
    mask = 1
    while mask < n:
        if i & mask:
            exchange(flat, members[i - mask], None, 0, group)
            return
        if i + mask < n:
            exchange(None, 0, scratch, members[i + mask], group)
            COMBINE[op](flat, scratch)
        mask <<= 1


def tree_broadcast(flat: torch.Tensor, members: list[int], me: int, group: dist.ProcessGroup) -> None:
    """Binomial tree from members[0] to all."""
    i, n = members.index(me), len(members)
    mask = 1
    while mask < n:
        mask <<= 1
    mask >>= 1
    while mask:
        if i % (2 * mask) == 0 and i + mask < n:
            exchange(flat, members[i + mask], None, 0, group)
        elif i % (2 * mask) == mask:
            exchange(None, 0, flat, members[i - mask], group)
        mask >>= 1


def ring_reduce_scatter(chunks: list[torch.Tensor], members: list[int], me: int, op: str,
                         group: dist.ProcessGroup) -> int:
    """After it, this member holds the full reduction of chunk ``(i + 1) % n``; returns that index."""
    i, n = members.index(me), len(members)
    right, left = members[(i + 1) % n], members[(i - 1) % n]
    for s in range(n - 1):
        send_k, recv_k = (i - s) % n, (i - s - 1) % n
        incoming = torch.empty_like(chunks[recv_k])
        exchange(chunks[send_k], right, incoming, left, group)
        COMBINE[op](chunks[recv_k], incoming)
    return (i + 1) % n


def ring_all_gather(chunks: list[torch.Tensor], members: list[int], me: int, group: dist.ProcessGroup,
                     owned: int) -> None:
    """Member ``i`` starts owning chunk ``owned``; afterwards everyone has every chunk."""
    i, n = members.index(me), len(members)
    right, left = members[(i + 1) % n], members[(i - 1) % n]
    offset = owned - i
    for s in range(n - 1):
        send_k, recv_k = (i + offset - s) % n, (i + offset - s - 1) % n
        exchange(chunks[send_k], right, chunks[recv_k], left, group)


def ring_all_reduce(flat: torch.Tensor, members: list[int], me: int, op: str, group: dist.ProcessGroup) -> None:
    chunks = list(flat.tensor_split(len(members)))
    owned = ring_reduce_scatter(chunks, members, me, op, group)
    ring_all_gather(chunks, members, me, group, owned)


def naive_all_reduce(flat: torch.Tensor, members: list[int], me: int, op: str, group: dist.ProcessGroup) -> None:
    root = members[0]
    if me == root:
        scratch = torch.empty_like(flat)
        for m in members[1:]:  # rank order: the same result on every run
            exchange(None, 0, scratch, m, group)
            COMBINE[op](flat, scratch)
        for m in members[1:]:
            exchange(flat, m, None, 0, group)
    else:
        exchange(flat, root, None, 0, group)
        exchange(None, 0, flat, root, group)


def hierarchical_all_reduce(flat: torch.Tensor, members: list[int], me: int, op: str,
                             group: dist.ProcessGroup, local_size: int) -> None:
    if local_size < 1:
        raise ValueError(f"local_size={local_size} must be at least 1 (ranks per node)")
    i = members.index(me)
    node = [m for k, m in enumerate(members) if k // local_size == i // local_size]
    leaders = members[::local_size]
    tree_reduce(flat, node, me, op, group)
    if me in leaders:
        ring_all_reduce(flat, leaders, me, op, group)
    tree_broadcast(flat, node, me, group)

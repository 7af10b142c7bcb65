"""A worker's way to the parameter servers: the channel it joins once, and each key range's live head.

Every request about key range ``k`` goes to the first server of its chain
not known dead (:meth:`Routes.head`). A server is known dead when a send or
receive with it fails as a lost peer, or, under ``ddpkit launch
--on-failure continue``, when the launcher says so (every wait watches its
word: Gloo does not always fail an operation whose peer died in the middle
of a message, see :func:`ddpkit.parallel.ps.channel.wait_for`). A request
whose head died is sent again to the next server of the chain; the servers
answer a step they applied already without applying it twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ddpkit.parallel.ps.channel import (
    HEADER,
    TAG_HEADER,
    TAG_TO_SERVER,
    TAG_TO_WORKER,
    Op,
    PSPlace,
    connect,
    lost_peer,
    ps_place,
    request,
    to_bytes,
    wait_for,
    workers_lost,
)
from ddpkit.runtime import events, membership

__all__ = ["Routes", "join"]

T = TypeVar("T")

_channel: tuple[PSPlace, dist.ProcessGroup, membership.Membership | None] | None = None


def join() -> tuple[PSPlace, dist.ProcessGroup, membership.Membership | None]:
    """This process's channel to the servers (joined once per process), and the launcher's word on deaths
    (None outside ``--on-failure continue``, or before ``ddpkit.init()``)."""
    global _channel
    if _channel is None:
        try:
            place = ps_place()
        except ValueError as e:
            raise ValueError(f"ParameterServerOptimizer: {e}") from None
        if place is None:
            raise RuntimeError(
                "ParameterServerOptimizer: this job has no parameter servers (DDPKIT_NUM_SERVERS is unset): start it "
                "with ddpkit launch --num-servers K ..., or ddpkit train --strategy ps-sync|ps-async"
            )
        if place.role != "worker":
            raise RuntimeError("ParameterServerOptimizer runs in the workers; this process is a parameter server")
        try:
            watch = membership.current()
        except RuntimeError:  # ddpkit.init() did not run: nobody tells this process of a death
            watch = None
        gone = None if watch is None else (
            lambda: workers_lost(watch.left(range(place.workers)), watch.servers_lost(place.servers)))
        _channel = (place, connect(place, gone=gone), watch)
    return _channel


class Routes:
    """The requests of one :class:`~ddpkit.parallel.ps.optimizer.ParameterServerOptimizer` (see the module notes).

    Args:
        dtype: the parameters' dtype (what a reply with parameters holds).
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.place, self.pg, self._watch = join()
        self.dtype = dtype
        self.numels: list[int] = [0] * self.place.servers
        """The elements of each key range (the optimizer's partition sets them)."""
        self.dead: set[int] = set()
        """Servers found gone (their key ranges go to the next server of each chain)."""

    def head(self, k: int) -> int:
        """The first live server of key range ``k``'s chain.

        Raises:
            RuntimeError: every server of the chain died.
        """
        for s in self.place.chain(k):
            if s not in self.dead:
                return s
        raise RuntimeError(
            f"ParameterServerOptimizer: key range {k} is lost: its server(s) {self.place.chain(k)} died "
            f"(replication {self.place.replication}); start the job with a larger --ps-replication to survive "
            "that many servers' deaths"
        )

    def wait(self, work: Any, server: int) -> None:
        """Wait for ``work`` with server ``server`` (stopped once the launcher says it died)."""
        watch = self._watch
        wait_for(work, (lambda: watch.server_gone(server)) if watch is not None else None,
                 f"parameter server {server}")

    def send_blob(self, server: int, k: int, op: int, obj: Any) -> None:
        """A request about key range ``k`` with a ``torch.save`` payload (None: empty) to server ``server``."""
        data = to_bytes(obj) if obj is not None else torch.zeros(0, dtype=torch.uint8)
        dst = self.place.server_rank(server)
        self.wait(self.pg.send([request(op, k, data.numel())], dst, TAG_HEADER), server)
        if data.numel():
            self.wait(self.pg.send([data], dst, TAG_TO_SERVER), server)

    def on_head(self, k: int, fn: Callable[[int], T]) -> T:
        """``fn(server)`` with key range ``k``'s head, again with the next one while a head is found dead."""
        while True:
            s = self.head(k)
            try:
                return fn(s)
            except RuntimeError as e:
                if not lost_peer(e):
                    raise
                self.dead.add(s)

    def exchange(self, requests: dict[int, list[torch.Tensor]], settings: Any, parameters: bool = True,
                 ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Send each key range's head its request (header first), then receive each one's header (and, with
        ``parameters``, the range's parameters). A head found dead is replaced by the next server of its chain,
        which gets the request again, after ``settings`` (the groups' current ones, which the dead head may not
        have handed on)."""
        replies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        pending, moved = dict(requests), set()
        while pending:
            posted: dict[int, tuple[int, list[Any], torch.Tensor, torch.Tensor]] = {}
            for k, tensors in pending.items():
                s = self.head(k)
                dst = self.place.server_rank(s)
                head = torch.zeros(HEADER, dtype=torch.int64)
                flat = torch.empty(self.numels[k] if parameters else 0, dtype=self.dtype)
                works: list[Any] = []
                try:
                    if k in moved:
                        self.send_blob(s, k, Op.SETTINGS, settings)
                    works.append(self.pg.send([tensors[0]], dst, TAG_HEADER))
                    works += [self.pg.send([t], dst, TAG_TO_SERVER) for t in tensors[1:] if t.numel()]
                    works.append(self.pg.recv([head], dst, TAG_TO_WORKER))
                    if flat.numel():
                        works.append(self.pg.recv([flat], dst, TAG_TO_WORKER))
                except RuntimeError as e:
                    if not lost_peer(e):
                        raise
                    works.append(None)  # found dead while sending
                posted[k] = (s, works, head, flat)
            failed = {}
            for k, (s, works, head, flat) in posted.items():
                try:
                    for w in works:
                        if w is None:
                            raise RuntimeError("connection closed")
                        self.wait(w, s)
                    replies[k] = (head, flat)
                except RuntimeError as e:
                    if not lost_peer(e):
                        raise
                    self.dead.add(s)
                    failed[k] = pending[k]
            for s in {posted[k][0] for k in failed}:
                events.collective(f"parameter servers: server {s} is gone, its key ranges go to the next server of "
                                  "their chains", nbytes=0)
            pending, moved = failed, moved | set(failed)
        return dict(sorted(replies.items()))

    def stop(self) -> None:
        """STOP to every server not known dead (a dead one found now is skipped)."""
        for s in range(self.place.servers):
            if s in self.dead:
                continue
            try:
                self.wait(self.pg.send([request(Op.STOP, 0)], self.place.server_rank(s), TAG_HEADER), s)
            except RuntimeError as e:
                if not lost_peer(e):
                    raise
                self.dead.add(s)

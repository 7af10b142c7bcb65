"""A parameter server: the key ranges it holds, served to the workers and handed down their chains.

A server knows nothing of the model until worker 0 sends it its key ranges
(for each: the parameters' indices, shapes and values, the optimizer class,
its groups' settings and, when resuming, their state): servers are generic
processes, started by ``ddpkit train`` or ``ddpkit launch --num-servers K``
as ``python -m ddpkit.parallel.ps.server``. One thread per worker receives
its requests (:class:`ddpkit.parallel.ps.channel.Op`), and with replication
one thread per key range it holds behind another server receives what that
server hands down (:mod:`ddpkit.parallel.ps.keyrange` has the ranges, the
chains and the consistency modes).

Deaths: a worker whose connection closes (it exited, or was killed) is done;
its request, if it had not arrived whole, is dropped, never half applied. A
server that dies takes no update with it that a worker was answered for:
the workers send their requests for its ranges to the next server of each
chain, and the server before it in a chain hands its updates to the one
after it. Under ``--on-failure continue`` a server beats to its launcher as a
worker does (:class:`~ddpkit.runtime.membership.Membership`), which kills one
that stops beating (paused): its death is then survived as any other.

Every reply to a push carries the version of the parameters sent, the
gradient's staleness (versions applied between the parameters it was
computed on and itself), the worker's lead over the slowest worker, and the
microseconds the reply waited for the bound.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.parallel.ps.channel import (
    HEADER,
    TAG_HEADER,
    TAG_TO_SERVER,
    TAG_TO_WORKER,
    Op,
    PSPlace,
    ack_tag,
    connect,
    forward_tag,
    from_bytes,
    header,
    lost_peer,
    ps_place,
    to_bytes,
    wait_for,
    workers_lost,
)
from ddpkit.parallel.ps.keyrange import KeyRange, Update, optimizer_class
from ddpkit.runtime.membership import FD_ENV, REPLY_FD_ENV, Membership, keep_alive_of
from ddpkit.runtime.process import exit_now, set_process_name

__all__ = ["ParameterServer", "main", "optimizer_class"]

_KINDS = ("apply", "settings", "load")


class _WorkerGone(Exception):
    """The worker's connection closed in the middle of a request: it is done, its request dropped."""


class ParameterServer:
    """Server ``place.index`` of the job: serves until every worker has said STOP or is gone (module notes)."""

    def __init__(self, pg: dist.ProcessGroup, place: PSPlace, watch: Membership | None = None) -> None:
        self.pg, self.place = pg, place
        self.workers = place.workers
        self.held = place.ranges_of(place.index)
        """The key ranges this server holds (its own first), in chain order."""
        self.ranges: dict[int, KeyRange] = {}
        self.ready = threading.Event()
        self.alive = [True] * place.servers
        """The servers not known dead (a forward down a chain failed)."""
        self.failure: BaseException | None = None
        self._lock = threading.Lock()
        self._watch = watch
        """The launcher's word on deaths (``--on-failure continue``), for the waits on the other servers."""

    def _wait(self, work: Any, s: int) -> None:
        """Wait for ``work`` with server ``s`` (stopped once the launcher says it died)."""
        watch = self._watch
        wait_for(work, (lambda: watch.server_gone(s)) if watch is not None else None, f"parameter server {s}")

    # -- set-up ---------------------------------------------------------------------------------------------------

    def setup(self, blob: dict[str, Any]) -> None:
        k = int(blob["range"])
        if k not in self.held:
            raise RuntimeError(f"parameter server {self.place.index} was sent key range {k}, which its chains "
                               f"do not give it (it holds {self.held}): the workers and the servers disagree on "
                               "DDPKIT_NUM_SERVERS or DDPKIT_PS_REPLICATION")
        self.ranges[k] = KeyRange(k, blob, self.workers, self._forward)
        if len(self.ranges) == len(self.held):
            for k in self.held:
                if self.place.chain(k).index(self.place.index) > 0:
                    self._listen(k)
            self.ready.set()

    def _range(self, k: int) -> KeyRange:
        if k not in self.ranges:
            raise RuntimeError(f"parameter server {self.place.index} was asked for key range {k}, which it does "
                               f"not hold (it holds {self.held})")
        return self.ranges[k]

    # -- the chains ------------------------------------------------------------------------------------------------

    def _forward(self, key_range: KeyRange, update: Update) -> None:
        """Hand ``update`` to the next live server of the range's chain; returns once it acknowledged (it hands
        it on first). A server found dead is skipped for the one after it."""
        chain = self.place.chain(key_range.index)
        for s in chain[chain.index(self.place.index) + 1 :]:
            if not self.alive[s]:
                continue
            try:
                self._send_update(s, key_range.index, update)
                return
            except RuntimeError as e:
                if not lost_peer(e):
                    raise
                self.alive[s] = False

    def _send_update(self, s: int, k: int, update: Update) -> None:
        dst, tag = self.place.server_rank(s), forward_tag(k)
        if update.kind == "apply":
            assert update.grad is not None and update.have is not None
            head = header(Op.FORWARD, _KINDS.index("apply"), update.worker, update.clock)
            payload = [update.have, update.grad]
        else:
            blob = to_bytes(update.blob)
            head, payload = header(Op.FORWARD, _KINDS.index(update.kind), 0, 0, blob.numel()), [blob]
        self._wait(self.pg.send([head], dst, tag), s)
        for t in payload:
            if t.numel():
                self._wait(self.pg.send([t], dst, tag), s)
        ack = torch.zeros(HEADER, dtype=torch.int64)
        self._wait(self.pg.recv([ack], dst, ack_tag(k)), s)

    def _listen(self, k: int) -> None:
        """A thread per server before this one in range ``k``'s chain, taking what it hands down."""
        chain = self.place.chain(k)
        for s in chain[: chain.index(self.place.index)]:
            threading.Thread(target=self._guard, args=(self._take_from, s, k), name=f"ps-chain{s}-range{k}",
                             daemon=True).start()

    def _take_from(self, s: int, k: int) -> None:
        src, tag, key_range = self.place.server_rank(s), forward_tag(k), self.ranges[k]
        while True:
            head = torch.zeros(HEADER, dtype=torch.int64)
            try:
                self._wait(self.pg.recv([head], src, tag), s)
                kind = _KINDS[int(head[1])]
                if kind == "apply":
                    have = torch.empty(len(key_range.params), dtype=torch.uint8)
                    grad = torch.empty_like(key_range.flat)
                    payload = [have, grad]
                else:
                    payload = [torch.empty(int(head[4]), dtype=torch.uint8)]
                for t in payload:
                    if t.numel():
                        self._wait(self.pg.recv([t], src, tag), s)
                update = Update("apply", int(head[2]), int(head[3]), grad, have) if kind == "apply" \
                    else Update(kind, blob=from_bytes(payload[0]))
            except RuntimeError as e:
                if not lost_peer(e):
                    raise
                return  # that server died; what it had not handed down whole was not acknowledged to anyone
            key_range.take(update)
            try:
                self._wait(self.pg.send([header(Op.FORWARD)], src, ack_tag(k)), s)
            except RuntimeError as e:
                if not lost_peer(e):
                    raise
                return

    # -- serving ----------------------------------------------------------------------------------------------

    def _recv(self, w: int, tensors: list[torch.Tensor], tag: int) -> None:
        for t in tensors:
            if t.numel():
                try:
                    self.pg.recv([t], w, tag).wait()
                except RuntimeError as e:
                    if lost_peer(e):
                        raise _WorkerGone from None
                    raise

    def _send(self, w: int, head: torch.Tensor, payload: torch.Tensor | None = None) -> None:
        try:
            self.pg.send([head], w, TAG_TO_WORKER).wait()
            if payload is not None and payload.numel():
                self.pg.send([payload], w, TAG_TO_WORKER).wait()
        except RuntimeError as e:
            if lost_peer(e):
                raise _WorkerGone from None
            raise

    def serve_worker(self, w: int) -> None:
        try:
            while self._request(w):
                pass
        except _WorkerGone:
            # The worker's process ended without a STOP (a script that never closed the optimizer, or a crash,
            # which its supervisor reports): it no longer takes part, and a request it had not sent whole is
            # dropped.
            pass
        for key_range in self.ranges.values():
            key_range.stop(w)

    def _request(self, w: int) -> bool:
        """Serve one request of worker ``w``; False once it said STOP."""
        h = torch.zeros(HEADER, dtype=torch.int64)
        self._recv(w, [h], TAG_HEADER)
        op, k = int(h[0]), int(h[7])
        if op == Op.SETUP:
            self.setup(from_bytes(self._blob(w, int(h[1]))))
            return True
        if op == Op.STOP:
            return False
        self.ready.wait()
        if op == Op.PUSH:
            key_range = self._range(k)
            mask = torch.empty(len(key_range.params), dtype=torch.uint8)
            grads = torch.empty_like(key_range.flat)
            self._recv(w, [mask, grads], TAG_TO_SERVER)
            fields, out = key_range.push(w, int(h[1]), int(h[2]), mask, grads)
            self._send(w, header(Op.PUSH, *fields), out)
        elif op == Op.PULL:
            key_range = self._range(k)
            with key_range.lock:
                out, version = key_range.flat.clone(), key_range.version
            self._send(w, header(Op.PULL, version), out)
        elif op == Op.STATE:
            key_range = self._range(k)
            with key_range.lock:
                blob = to_bytes(key_range.state())
            self._send(w, header(Op.STATE, blob.numel()), blob)
        elif op == Op.LOAD:
            data = from_bytes(self._blob(w, int(h[1]))) if int(h[1]) else None
            self._range(k).load(w, data)
            self._send(w, header(Op.LOAD))
        elif op == Op.SETTINGS:
            self._range(k).settings(from_bytes(self._blob(w, int(h[1]))))
        else:
            raise RuntimeError(f"parameter server {self.place.index}: unknown request {op} from worker {w}")
        return True

    def _blob(self, w: int, nbytes: int) -> torch.Tensor:
        data = torch.empty(nbytes, dtype=torch.uint8)
        self._recv(w, [data], TAG_TO_SERVER)
        return data

    def _guard(self, fn: Any, *args: Any) -> None:
        """Run a serving thread; its failure fails the server (every wait of every range stops)."""
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised by the main thread
            with self._lock:
                self.failure = self.failure or e
            for key_range in list(self.ranges.values()):
                key_range.fail(e)
            self.ready.set()

    def serve(self) -> None:
        """Serve every worker until all said STOP or are gone; a failure in any thread fails the server."""
        threads = [threading.Thread(target=self._guard, args=(self.serve_worker, w), name=f"ps-worker{w}",
                                    daemon=True) for w in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.5)
                if self.failure is not None:
                    break
            if self.failure is not None:
                raise RuntimeError(f"parameter server {self.place.index} failed: {self.failure}") from self.failure


def main() -> int:
    """A server process: join the channel from the environment, serve until every worker is done (a worker
    whose process ended without closing counts as done; its supervisor reports it if it failed); 0, or 2 for
    a process that is not a server. A failure raises."""
    try:
        place = ps_place(os.environ)
    except ValueError as e:
        print(f"ddpkit parameter server: {e}", file=sys.stderr)
        return 2
    if place is None or place.role != "server":
        print("ddpkit parameter server: not a server process (DDPKIT_ROLE=server and DDPKIT_NUM_SERVERS are set by "
              "ddpkit launch --num-servers K and ddpkit train)", file=sys.stderr)
        return 2
    set_process_name(f"ddpkit-server{place.index}")  # what ps and top show (the tests find it so, too)
    torch.set_num_threads(1)
    fd = os.environ.get(FD_ENV)
    reply = os.environ.get(REPLY_FD_ENV)  # (its beats: a stalled server is killed, as a stalled worker is)
    watch = (Membership(int(fd), -1, None, 60.0, int(reply) if reply else None, keep_alive=keep_alive_of(os.environ))
             if fd else None)
    gone = None if watch is None else (
        lambda: workers_lost(watch.left(range(place.workers)), watch.servers_lost(place.servers)))
    channel = connect(place, gone=gone)
    if watch is not None:
        watch.channel_built()
    ParameterServer(channel, place, watch).serve()
    return 0


if __name__ == "__main__":
    # The process ends without the interpreter's teardown: a Gloo group torn down by it would abort the process.
    try:
        code = main()
    except Exception:  # noqa: BLE001 - reported, then the exit code says it
        traceback.print_exc()
        code = 1
    exit_now(code)

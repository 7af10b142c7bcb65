"""One authenticated connection between two launchers of a job's council: the handshake that proves the job's
secret, and the sealed messages after it.

The handshake binds both nonces, both node ids, both places and both roles: the dialer sends its node, a nonce,
its place and its :data:`PROTOCOL` (another one is refused at once, naming both); the answering agent checks that
such a node may call it, then answers with its own nonce and an HMAC (keyed by the job's secret) of ``accept`` and
that transcript; the dialer checks it and answers with the HMAC of ``dial`` and the same transcript. A proof made
for one connection or role is worth nothing in another, so a process without the secret cannot take a seat by
relaying one agent's answers to another. Each side then derives a session key from the secret and the transcript,
and every later message carries its sequence number and an HMAC of both under that key (:class:`Connection`): a
forged, altered or replayed message is refused and the connection goes on (an intruder in the middle can delay or
drop, as a bad network can, but never speak for a node).
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ddpkit.launcher.supervise import say

__all__ = ["PROTOCOL", "Connection", "close_socket", "handshake"]

PROTOCOL = 2
"""The council's protocol (the fields of its messages: 2 since the membership's counter became a generation and the
joins holders and candidates). The launchers of one job must speak one: a connection that says another (another
ddpkit on that node) is refused, naming both, before anything else is read."""
_SEND_S = 2
"""Seconds a send to another agent may block (its buffers full: a cut link) before it is given up."""
_LINE_MAX = 4096
"""The longest handshake line read before the caller is known (a stranger's endless line is cut there)."""
HANDSHAKE_S = 5.0
"""The longest a whole handshake may take, however its bytes trickle in (three lines: milliseconds between nodes
that answer): a stranger that sends a byte now and then holds neither a dialer nor an answering slot past it."""


class _OtherProtocol(PermissionError):
    """A launcher that speaks another council protocol (another version of ddpkit)."""


@dataclass
class Connection:
    """One authenticated connection from this agent (``node``) to ``peer``: its session key and the sequence
    numbers of each direction."""

    sock: socket.socket
    node: int
    peer: int
    key: bytes
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0
    """The last sequence number this agent sent on it."""
    received: int = 0
    """The last sequence number this agent accepted on it (a message must carry the next one)."""
    acked: int = 0
    """The last of this agent's sequence numbers on it that the peer said (in its beats) it had received."""

    def send(self, message: dict[str, Any]) -> None:
        """``message`` sealed (its body, the next sequence number, their HMAC) and sent; a beat carries what this
        agent has read on this very link (``ack``).

        Raises:
            OSError: the link is lost (or its send timed out after ``_SEND_S``).
        """
        with self.lock:
            if message["kind"] == "beat":
                message = {**message, "ack": self.received}
            self.sent += 1
            body = json.dumps(message, sort_keys=True)
            label = f"{self.node}>{self.peer}|{self.sent}|{body}"
            _send_line(self.sock, {"seq": self.sent, "body": body,
                                   "mac": hmac.new(self.key, label.encode(), "sha256").hexdigest()})

    def open(self, line: bytes) -> dict[str, Any] | None:
        """A sealed line from the peer: its message, or None (said once per kind) when it is forged, altered or
        replayed. A beat's ``ack`` is taken here."""
        try:
            sealed = json.loads(line)
            seq, body = int(sealed["seq"]), str(sealed["body"])
            label = f"{self.peer}>{self.node}|{seq}|{body}"
            good = hmac.compare_digest(str(sealed["mac"]), hmac.new(self.key, label.encode(), "sha256").hexdigest())
        except (ValueError, KeyError, TypeError, RecursionError):
            good, seq, body = False, -1, ""
        if not good or seq != self.received + 1:
            why = "a forged or altered message" if not good else f"a replayed message (number {seq}, expected " \
                                                                   f"{self.received + 1})"
            say(f"refused {why} on node {self.peer}'s council connection ({_peer_name(self.sock)})")
            return None
        self.received = seq
        message = json.loads(body)
        if message.get("kind") == "beat":
            self.acked = int(message.get("ack", 0))  # of this link's numbers
        return message


def handshake(sock: socket.socket, key: bytes, node: int, place: list[Any], dialed: int | None,
              may_call: Callable[[int], None]) -> tuple[Connection, list[Any], BinaryIO] | None:
    """The handshake of the module notes on ``sock``, as the dialer (``dialed``: the node called) or the answering
    agent (``may_call`` raises PermissionError, saying why, for a node that may not call this one); ``key``: the
    job's council key. The link, the peer's place and the reader of its lines; None (said, and the socket closed)
    when the peer did not prove the secret or speaks another protocol."""
    sock.settimeout(HANDSHAKE_S)
    reader = sock.makefile("rb")
    mine = os.urandom(16).hex()
    # Past the deadline the socket is shut: a read blocked on a trickle ends at once (a per-read timeout would
    # start again with each byte). A handshake that ended as it fired is refused too (its socket is shut).
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        close_socket(sock)

    deadline = threading.Timer(HANDSHAKE_S, expire)
    deadline.daemon = True
    deadline.start()

    def mac(role: str, transcript: tuple[Any, ...]) -> str:
        return hmac.new(key, json.dumps([role, *transcript]).encode(), "sha256").hexdigest()

    try:
        if dialed is not None:
            _send_line(sock, {"node": node, "nonce": mine, "place": place, "protocol": PROTOCOL})
            theirs = json.loads(reader.readline(_LINE_MAX))
            _same_protocol(theirs)
            peer, nonce = int(theirs["node"]), str(theirs["nonce"])
            if peer != dialed:
                raise PermissionError(f"answered as node {peer}, not {dialed}")
            transcript = (mine, nonce, node, peer, place, list(theirs["place"]))
            if not hmac.compare_digest(str(theirs.get("mac")), mac("accept", transcript)):
                raise PermissionError("not this job's secret")
            _send_line(sock, {"mac": mac("dial", transcript)})
        else:
            theirs = json.loads(reader.readline(_LINE_MAX))
            _same_protocol(theirs)
            peer, nonce = int(theirs["node"]), str(theirs["nonce"])
            may_call(peer)
            transcript = (nonce, mine, peer, node, list(theirs["place"]), place)
            _send_line(sock, {"node": node, "nonce": mine, "place": place, "protocol": PROTOCOL,
                              "mac": mac("accept", transcript)})
            proof = json.loads(reader.readline(_LINE_MAX))
            if not hmac.compare_digest(str(proof.get("mac")), mac("dial", transcript)):
                raise PermissionError("not this job's secret")
        if len(nonce) != 32:
            raise PermissionError("a malformed nonce")
        deadline.cancel()
        if expired.is_set():
            raise TimeoutError(f"the handshake took more than {HANDSHAKE_S:g} s")
    except Exception as e:  # noqa: BLE001 - whatever a stranger's lines make of the parsing (a list, deep nesting)
        deadline.cancel()
        if isinstance(e, _OtherProtocol):
            say(f"refused a council connection from {_peer_name(sock)}: {e}")
        elif isinstance(e, PermissionError):
            say(f"refused a council connection from {_peer_name(sock)}: {e} (the job's secret)")
        close_socket(sock)
        return None
    session = hmac.new(key, json.dumps(["session", *transcript]).encode(), "sha256").digest()
    sock.settimeout(None)
    # A send to a node cut off must not hold this agent up once its buffers fill: give up after _SEND_S.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", _SEND_S, 0))
    return Connection(sock, node, peer, session), list(theirs["place"]), reader


def close_socket(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways (its peer's reader ends at once) and close it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _same_protocol(hello: dict[str, Any]) -> None:
    """Refuse a handshake's opening line that names another :data:`PROTOCOL` (or none: a ddpkit before it)."""
    theirs = hello.get("protocol", 1)
    if theirs != PROTOCOL:
        raise _OtherProtocol(f"it speaks council protocol {theirs}, this launcher {PROTOCOL}: run one version of "
                             "ddpkit on every node of the job")


def _send_line(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall((json.dumps(message) + "\n").encode())


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a peer"

"""The rendezvous of the ranks: reaching the store, admission by the job's secret, the census.

Used by :func:`ddpkit.init` (:mod:`ddpkit.runtime.group`). Every check fails
with a :class:`RendezvousError` naming the value and the fix, within one
deadline (``DDPKIT_TIMEOUT``), never a silent hang:

* ``MASTER_ADDR`` does not resolve, or nothing answers there in time (probed
  from Python first, so torch's retries and C++ stack traces never show), or
  what listens there never answers the store's handshake (a frozen rank 0,
  another program: torch's client waits for it past its timeout);
* rank 0 cannot listen on ``MASTER_PORT`` (the port is busy); with a
  loopback ``MASTER_ADDR`` the store listens on loopback only;
* a process presents no secret, or another one, than the job's
  (``DDPKIT_JOB_TOKEN``): it is refused, and rank 0's stall inspector says so;
* two processes claim the same rank;
* ranks disagree on ``WORLD_SIZE``, or fewer processes than ``WORLD_SIZE``
  join in time.
"""

from __future__ import annotations

import hmac
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.runtime import stall
from ddpkit.runtime.discovery import JOB_TOKEN_ENV, Placement, job_key
from ddpkit.runtime.network import loopback_listener
from ddpkit.runtime.sealed_store import ForgedValue

_POLL_S = 0.01
SPEAK_S = 15.0
"""A wait for other processes says, this often, whom it waits for and how long is left."""


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 2, 3``, or the first few of many."""
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) != 1 else ''} {shown}"


class RendezvousError(RuntimeError):
    """The ranks could not meet: unreachable store, busy port, or a world that disagrees."""


def open_store(place: Placement, join_timeout: float, deadline: float) -> dist.Store:
    try:
        socket.getaddrinfo(place.master_addr, place.master_port)
    except socket.gaierror as e:
        raise RendezvousError(
            f"MASTER_ADDR={place.master_addr!r} does not resolve ({e.strerror}): "
            "set it (--master-addr) to a host name or IP address of rank 0's node"
        ) from None
    # Under torchrun the launcher already serves the store on MASTER_PORT and
    # every worker connects to it as a client.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    is_server = place.rank == 0 and not agent_store
    if not is_server:
        _wait_reachable(place, join_timeout, deadline)
    try:
        listen = {"master_listen_fd": fd} if is_server and (fd := _loopback_listener(place)) is not None else {}
        timeout = timedelta(seconds=max(1.0, deadline - time.monotonic()))

        def make() -> dist.Store:
            return dist.TCPStore(place.master_addr, place.master_port, place.world_size, is_server, timeout=timeout,
                                 wait_for_workers=False, **listen)

        return make() if is_server else answered_in_time(make, timeout.total_seconds(), place)
    except RendezvousError:
        raise
    except Exception as e:  # noqa: BLE001 - torch raises several types here
        where = f"{place.master_addr}:{place.master_port}"
        if is_server:
            raise RendezvousError(
                f"rank 0 could not listen on {where} ({e}): the port is probably busy; "
                "choose a free one with --master-port / MASTER_PORT"
            ) from None
        if "Ping failed" in str(e) or "invalid value" in str(e):
            raise RendezvousError(
                f"rank {place.rank} found something other than a rendezvous store listening at {where}: another "
                "program uses that port, or MASTER_ADDR points at the wrong host; use rank 0's host and a port "
                "no other program uses (--master-port / MASTER_PORT)"
            ) from None
        raise RendezvousError(
            f"rank {place.rank} could not reach the rendezvous at {where} within "
            f"{join_timeout:g} s ({e}): check that rank 0 is running, that MASTER_ADDR/"
            "MASTER_PORT are the same on every node, and that the port is open"
        ) from None


def answered_in_time(make: Callable[[], dist.Store], seconds: float, place: Placement) -> dist.Store:
    """``make()`` (a store client's connection), or a :class:`RendezvousError` once ``seconds`` (and one more)
    have passed: torch's client waits for the store's answer to its handshake past its own timeout when what
    listens never answers. The connecting thread is left behind, blocked (the process is ending with the error)."""
    made: list[Any] = []

    def connect() -> None:
        try:
            made.append(make())
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            made.append(e)

    thread = threading.Thread(target=connect, name="ddpkit-store-connect", daemon=True)
    thread.start()
    thread.join(seconds + 1.0)
    if not made:
        where = f"{place.master_addr}:{place.master_port}"
        raise RendezvousError(
            f"rank {place.rank} reached {where}, but what listens there did not answer the rendezvous store's "
            f"handshake within {seconds:g} s: rank 0 may be stopped or frozen (a debugger, SIGSTOP), or another "
            "program holds the port (--master-port / MASTER_PORT)"
        )
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def _loopback_listener(place: Placement) -> int | None:
    try:
        return loopback_listener(place.master_addr, place.master_port)
    except OSError as e:
        raise RendezvousError(
            f"rank 0 could not listen on {place.master_addr}:{place.master_port} ({e.strerror}): the port is "
            "probably busy; choose a free one with --master-port / MASTER_PORT"
        ) from None


def job_keys(token: str | None) -> tuple[str, str]:
    """``(verifier, key prefix)`` of the job whose secret is ``token`` (``DDPKIT_JOB_TOKEN``).

    The verifier is published where any client can read it, so a process
    can learn that it holds the wrong secret; the job's keys (census, process
    group, stall inspector) live under the prefix, which cannot be derived
    from the verifier, so a process without the secret cannot even address them.
    Both come from :func:`job_key`, never from a fast hash of the secret.
    """
    if not token:
        return "none", "ddpkit/"
    key = job_key(token)

    def digest(purpose: str) -> str:
        return hmac.new(key, f"ddpkit {purpose}".encode(), "sha256").hexdigest()

    return digest("verifier"), f"ddpkit/{digest('prefix')[:32]}/"


def admit(store: dist.Store, place: Placement, token: str | None) -> None:
    """Rank 0 publishes the job's verifier; every other rank must present the same secret."""
    verifier, _ = job_keys(token)
    if place.rank == 0:
        store.set("ddpkit/auth", verifier)
        return
    where = f"{place.master_addr}:{place.master_port}"
    try:
        theirs = store.get("ddpkit/auth").decode()
    except Exception as e:  # noqa: BLE001 - the store's timeout error type varies by torch version
        raise RendezvousError(
            f"rank {place.rank} reached the rendezvous at {where} but rank 0 never opened the job there "
            f"({type(e).__name__}): check that rank 0 is running and that DDPKIT_TIMEOUT gives it time to start"
        ) from None
    if theirs == verifier:
        return
    n = store.add(stall.REFUSED_KEY, 1)
    store.set(f"{stall.REFUSED_KEY}/{n}", f"a process on {socket.gethostname()} (pid {os.getpid()}) claiming rank "
                                    f"{place.rank} {'without the job' if not token else 'with another job'}'s secret")
    if not token:
        why = ("the job there has a secret and this process presents none: start ranks with ddpkit launch, or "
               f"give every rank the job's {JOB_TOKEN_ENV} (--job-secret-file)")
    elif theirs == "none":
        why = (f"this process presents a secret ({JOB_TOKEN_ENV}) but the job there has none: unset it, or start "
               "rank 0 with the same one")
    else:
        why = (f"its {JOB_TOKEN_ENV} is not the job's secret: give every rank the same {JOB_TOKEN_ENV} "
               "(--job-secret-file)")
    raise RendezvousError(f"rank {place.rank} was refused by the rendezvous at {where}: {why}")


def wait_for_listener(host: str, port: int, deadline: float) -> OSError | None:
    """Wait until something listens at ``host:port``, before ``deadline`` (:func:`time.monotonic`'s); ``None``
    once it does, else the last error (:class:`TimeoutError` when no time was left for one try).

    A client of torch's ``TCPStore`` checks this first, in Python, so that an unreachable store fails once, on
    time and with ddpkit's message alone (torch's client retries past its timeout and logs a C++ stack trace of
    about twenty lines on every failed try).
    """
    last: OSError = TimeoutError("no time left")
    while (left := deadline - time.monotonic()) > 0:
        try:
            socket.create_connection((host, port), timeout=min(left, 2.0)).close()
            return None
        except OSError as e:
            last = e
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    return last


def _wait_reachable(place: Placement, join_timeout: float, deadline: float) -> None:
    """Wait until something listens at the rendezvous, within the one deadline of the whole rendezvous."""
    last = wait_for_listener(place.master_addr, place.master_port, deadline)
    if last is None:
        return
    raise RendezvousError(
        f"rank {place.rank} could not reach the rendezvous at {place.master_addr}:{place.master_port} within "
        f"{join_timeout:g} s ({last.strerror or last}): check that rank 0 is running, that MASTER_ADDR/"
        "MASTER_PORT are the same on every node, and that the port is open (DDPKIT_TIMEOUT sets the wait)"
    )


def census(store: dist.Store, place: Placement, join_timeout: float, deadline: float) -> None:
    """Check that exactly ``world_size`` distinct ranks agreeing on it have joined."""

    def fail(message: str) -> None:
        store.set("error", message)
        raise RendezvousError(message)

    if store.add(f"claim/{place.rank}", 1) > 1:
        fail(f"rank {place.rank} is claimed by more than one process: each process needs its "
             "own RANK in 0..WORLD_SIZE-1 (are two jobs sharing MASTER_PORT?)")
    if place.rank == 0:
        store.set("world_size", str(place.world_size))
    else:
        theirs = int(store.get("world_size"))
        if theirs != place.world_size:
            fail(f"rank {place.rank} has WORLD_SIZE={place.world_size} but rank 0 has "
                 f"WORLD_SIZE={theirs}: every process must be started with the same world size")
    store.add("joined", 1)
    where = f"{place.master_addr}:{place.master_port}"
    advice = "check that WORLD_SIZE matches the number of processes started on all nodes"
    joined = 0
    speak = time.monotonic() + SPEAK_S
    try:
        while (joined := store.add("joined", 0)) < place.world_size:
            if store.check(["error"]):
                raise RendezvousError(store.get("error").decode())
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"only {joined} of WORLD_SIZE={place.world_size} processes joined the rendezvous "
                    f"at {where} within {join_timeout:g} s: {advice}"
                )
            if place.rank == 0 and time.monotonic() >= speak:  # a wait that says what it waits for
                speak = time.monotonic() + SPEAK_S
                missing = [r for r in range(place.world_size) if not store.check([f"claim/{r}"])]
                whom = _ranks(missing) if missing else "ranks that claimed their place but have not joined"
                print(f"ddpkit: rank 0 waits at the rendezvous at {where} for {whom} ({joined} of "
                      f"{place.world_size} joined); it gives up in {max(0.0, deadline - time.monotonic()):.0f} s "
                      "(DDPKIT_TIMEOUT)", file=sys.stderr, flush=True)
            time.sleep(_POLL_S)
    except RendezvousError:
        raise
    except ForgedValue as e:  # the store answers, with a value the job's secret did not seal
        raise RendezvousError(f"rank {place.rank}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the store's network errors vary by version
        raise RendezvousError(
            f"rank {place.rank} lost the rendezvous at {where} while {joined} of "
            f"WORLD_SIZE={place.world_size} processes had joined (rank 0 gave up or died: see its "
            f"error) ({type(e).__name__}): {advice}"
        ) from None

"""Which network interface this machine reaches the rendezvous host through (torch-free).

Gloo advertises one address to its peers. Left alone it takes the address
the machine's host name resolves to, often ``127.0.0.1`` or an address other
nodes cannot reach, and a multi-node job then fails ("Gloo connectFullMesh
failed") or hangs. :func:`route_interface` asks the kernel which local
address it would use to reach ``MASTER_ADDR`` (a UDP ``connect``, which
sends nothing) and returns the interface holding that address; every node
can reach it, since that is the route the rendezvous itself takes.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

_SIOCGIFADDR = 0x8915


def local_address_towards(host: str, port: int) -> str | None:
    """The local IP address the kernel would use to reach ``host``, or ``None`` if there is no route."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            return str(sock.getsockname()[0]).split("%")[0]
    except OSError:
        return None


def interface_of(address: str) -> str | None:
    """The name of the interface holding ``address`` (IPv4 or IPv6), or ``None``."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        table = Path("/proc/net/if_inet6")
        if not table.exists():
            return None
        for line in table.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6 and ipaddress.IPv6Address(int(fields[0], 16)) == ip:
                return fields[5]
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def route_interface(host: str, port: int) -> str | None:
    """The interface this machine reaches ``host`` through (``lo`` for a local host), or ``None``."""
    address = local_address_towards(host, port)
    return interface_of(address) if address else None


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine: one of the addresses it resolves to can be bound here."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False


def loopback_listener(host: str, port: int, *, or_any: bool = False) -> int | None:
    """A listening socket's descriptor for a store at ``host:port`` when ``host`` is a loopback address.

    Only processes on this machine could reach such a store, so it listens
    on loopback alone instead of on every interface (the store's default).
    Returns ``None`` for other hosts, or with ``or_any`` a socket listening on
    every interface (IPv4) there; the caller then owns the descriptor.

    Raises:
        OSError: the port is busy.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos):
        family, address = infos[0][0], infos[0][4]
    elif or_any:
        family, address = socket.AF_INET, ("", port)
    else:
        return None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock.detach()


class BoundedStore:
    """A store whose operations each get at most ``timeout_s`` (then ``TimeoutError``).

    Each runs on a daemon thread: over a cut link a request blocks until TCP
    gives up (hours), and that thread is then abandoned, not the caller
    (nor the process's exit, which does not wait for daemon threads).
    """

    def __init__(self, store: Any, timeout_s: float) -> None:
        self._store = store
        self._timeout_s = timeout_s

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            box: dict[str, Any] = {}

            def run() -> None:
                try:
                    box["value"] = method(*args)
                except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                    box["error"] = e

            thread = threading.Thread(target=run, name="ddpkit-store-call", daemon=True)
            thread.start()
            thread.join(self._timeout_s)
            if thread.is_alive():
                raise TimeoutError(f"the rendezvous store did not answer {name}() within {self._timeout_s:g} s")
            if "error" in box:
                raise box["error"]
            return box["value"]

        return call

"""Two "nodes" on one machine: network namespaces joined by a veth pair (needs root and ``ip netns``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def two_nodes() -> Iterator[tuple[list[str], list[str]]]:
    """Yield ``(names, addresses)`` of two namespaces that reach each other over a veth pair.

    Skips the test (with the reason) where namespaces cannot be made.
    """
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 (ip netns) for two-node tests")
    tag = f"dk{os.getpid() % 100000}"
    names = [f"{tag}n0", f"{tag}n1"]
    octet = 10 + os.getpid() % 200
    addresses = [f"10.{octet}.0.1", f"10.{octet}.0.2"]
    try:
        for name in names:
            _ip("netns", "add", name)
    except subprocess.CalledProcessError as e:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"ip netns is not permitted here: {e.stderr.strip()}")
    try:
        _ip("link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
        for name, end, address in zip(names, (f"{tag}a", f"{tag}b"), addresses):
            _ip("link", "set", end, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", end)
            _ip("-n", name, "link", "set", end, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield names, addresses
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def in_namespace(name: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", name, *argv]


def veth_end(names: list[str], node: int) -> str:
    """The name of node ``node``'s end of the veth pair made by :func:`two_nodes`."""
    return names[0][:-2] + "ab"[node]


def mpirun_agent(folder: Path, names: list[str], addresses: list[str]) -> Path:
    """A remote shell for ``mpirun --mca plm_rsh_agent``: it starts Open MPI's daemon for host ADDRESS inside the
    namespace holding that address (ssh's place between real nodes)."""
    cases = "\n".join(f"  {address}) ns={name} ;;" for name, address in zip(names, addresses))
    agent = folder / "netns-rsh"
    agent.write_text(f"""#!/bin/sh
host="$1"; shift
case "$host" in
{cases}
  *) echo "netns-rsh: no namespace has address $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" /bin/sh -c "$*"
""")
    agent.chmod(0o755)
    return agent


@contextmanager
def bridged_nodes(count: int) -> Iterator[tuple[list[str], list[str], list[str]]]:
    """Yield ``(names, addresses, links)`` of ``count`` namespaces on one bridge; ``links[k]`` is node k's cable
    (its veth end on the bridge: ``ip link set LINK down`` cuts node k off).

    Skips the test (with the reason) where namespaces cannot be made.
    """
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 (ip netns) for multi-node tests")
    tag = f"dk{os.getpid() % 100000}"
    names = [f"{tag}n{k}" for k in range(count)]
    links = [f"{tag}h{k}" for k in range(count)]
    octet = 10 + os.getpid() % 200
    addresses = [f"10.{octet}.1.{k + 1}" for k in range(count)]
    bridge = f"{tag}br"
    try:
        _ip("link", "add", bridge, "type", "bridge")
    except subprocess.CalledProcessError as e:
        pytest.skip(f"a bridge cannot be made here: {e.stderr.strip()}")
    try:
        _ip("link", "set", bridge, "up")
        for name, link, address in zip(names, links, addresses):
            _ip("netns", "add", name)
            _ip("link", "add", link, "type", "veth", "peer", "name", f"{link}p")
            _ip("link", "set", f"{link}p", "netns", name)
            _ip("link", "set", link, "master", bridge)
            _ip("link", "set", link, "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", f"{link}p")
            _ip("-n", name, "link", "set", f"{link}p", "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield names, addresses, links
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        for link in links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)

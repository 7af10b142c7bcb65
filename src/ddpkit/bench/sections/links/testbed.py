"""Several "nodes" on one machine: network namespaces on one bridge, each link's rate shaped with ``tc``.

A :class:`Testbed` of ``count`` nodes makes a bridge (the switch) and, per
node, a namespace and a veth pair (its cable): one end in the namespace with
the node's address, the other on the bridge. :meth:`Testbed.shape` gives
every cable a rate in both directions with a token bucket (``tc qdisc ...
tbf``: the node's end limits what it sends, the bridge's end what it
receives; a bucket of 1 ms at the rate, at least 128 KiB), as a NIC of that
speed would; this kernel has no ``netem``, so
rate only, no added delay or loss. :meth:`Testbed.cut` and
:meth:`Testbed.mend` pull a node's cable and plug it back. Commands run in a
node through :meth:`Testbed.command` (``ip netns exec``); :meth:`Testbed.launch`
starts a ``ddpkit launch`` job on every node (the measurement scripts').

Needs root and iproute2 (``ip``, ``tc``); everything made is removed on
exit, also after an error. The tests' nodes and ``ddpkit bench links`` are
both made with it. Torch-free.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

__all__ = ["Node", "Testbed", "TestbedError", "parse_rate"]

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


class TestbedError(RuntimeError):
    """The testbed cannot be made here (not root, no iproute2, a kernel without namespaces or tbf)."""

    __test__ = False  # a name pytest would otherwise collect

def parse_rate(rate: str) -> int:
    """Bits per second of ``rate`` (``100mbit``, ``1gbit``, ``2.5gbit``, ``800kbit``, or a number of bit/s).

    Raises:
        ValueError: another form.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:bit)?\s*", str(rate).lower())
    if not m or int(float(m.group(1)) * _UNITS[m.group(2)]) < 1:
        raise ValueError(f"rate {rate!r}: give bits per second as 100mbit, 1gbit, 2.5gbit, 800kbit or a number")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass(frozen=True)
class Node:
    """One node of a :class:`Testbed`."""

    namespace: str
    address: str
    link: str
    """Its cable's end on the bridge (``ip link set LINK down`` cuts the node off)."""
    inner: str
    """Its cable's end inside its namespace."""


def _run(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")


class Testbed:
    """``count`` nodes on one bridge (see the module notes); a context manager.

    Args:
        count: nodes (at least 1, at most 250).
        tag: the prefix of every name it makes (default: random; at most 8 characters, so that a link's name
            stays within the kernel's 15).
        subnet: the second octet of the nodes' ``10.X.1.0/24`` addresses (default from the process id).

    Raises:
        TestbedError: not root, no ``ip`` or ``tc``, or a step the kernel refuses (named, with its message).
    """

    __test__ = False  # a name pytest would otherwise collect

    def __init__(self, count: int, tag: str | None = None, subnet: int | None = None) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 250:
            raise ValueError(f"count={count!r}: a testbed has 1 to 250 nodes")
        self.tag = tag or f"dk{secrets.token_hex(3)}"  # another testbed's names, even a dead one's, are not ours
        if len(self.tag) > 8 or not re.fullmatch(r"[a-z][a-z0-9]*", self.tag):
            raise ValueError(f"tag={self.tag!r}: 1 to 8 lower-case letters and digits, a letter first")
        octet = 10 + os.getpid() % 200 if subnet is None else subnet
        if isinstance(octet, bool) or not isinstance(octet, int) or not 0 <= octet <= 255:
            raise ValueError(f"subnet={subnet!r}: the second octet of 10.X.1.0/24, 0 to 255")
        self.bridge = f"{self.tag}br"
        self.nodes = [Node(f"{self.tag}n{k}", f"10.{octet}.1.{k + 1}", f"{self.tag}h{k}", f"{self.tag}h{k}p")
                      for k in range(count)]
        self.rate: str | None = None
        self._made = False
        self._namespaces: list[str] = []
        self._links: list[str] = []
        """What this testbed made, so that closing removes that and nothing else."""

    @staticmethod
    def why_not() -> str | None:
        """Why a testbed cannot be made here (None: it can be tried)."""
        if os.geteuid() != 0:
            return "needs root (network namespaces, a bridge and tc)"
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            return f"needs iproute2 ({', '.join(missing)} not found): apt-get install iproute2"
        return None

    def __enter__(self) -> Testbed:
        if (why := self.why_not()) is not None:
            raise TestbedError(why)
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            self._made = True
            _run("ip", "link", "set", self.bridge, "up")
            for node in self.nodes:
                _run("ip", "netns", "add", node.namespace)
                self._namespaces.append(node.namespace)
                _run("ip", "link", "add", node.link, "type", "veth", "peer", "name", node.inner)
                self._links.append(node.link)
                _run("ip", "link", "set", node.inner, "netns", node.namespace)
                _run("ip", "link", "set", node.link, "master", self.bridge)
                _run("ip", "link", "set", node.link, "up")
                _run("ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.inner)
                _run("ip", "-n", node.namespace, "link", "set", node.inner, "up")
                _run("ip", "-n", node.namespace, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Remove the namespaces, cables and bridge this testbed made (their processes are the caller's)."""
        for name in self._namespaces:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        for link in self._links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        if self._made:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self._made, self._namespaces, self._links = False, [], []

    def command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``node``."""
        return ["ip", "netns", "exec", self.nodes[node].namespace, *argv]

    def launch(self, script: list[str], nproc_per_node: int = 1) -> list[int]:
        """``ddpkit launch`` of ``script`` (a Python file and its arguments) on every node, ``nproc_per_node``
        workers each, node 0 the master; waits for the launchers and returns their exit codes. Each worker gets one
        thread, this checkout's ``src`` on its path and a fresh job token; ``GLOO_SOCKET_IFNAME`` is left out (each
        namespace has one interface, which gloo finds)."""
        import sys

        src = str(Path(__file__).resolve().parents[4])  # the checkout's src/
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": src, "DDPKIT_JOB_TOKEN": secrets.token_hex(16)}
        env.pop("GLOO_SOCKET_IFNAME", None)
        argv = [sys.executable, "-m", "ddpkit", "launch", "--nnodes", str(len(self.nodes)), "--nproc-per-node",
                str(nproc_per_node), "--master-addr", self.nodes[0].address, "--master-port",
                str(29500 + os.getpid() % 1000)]
        launchers = [subprocess.Popen(self.command(k, [*argv, "--node-rank", str(k), *script]), env=env)
                     for k in range(len(self.nodes))]
        return [p.wait() for p in launchers]

    def shape(self, rate: str | None) -> None:
        """Every cable at ``rate`` in both directions (``100mbit``, ``1gbit``, ...); None: unshaped again."""
        bits = None if rate is None else parse_rate(rate)
        for node in self.nodes:
            for where in (["ip", "netns", "exec", node.namespace], []):
                dev = node.inner if where else node.link
                if bits is None:
                    subprocess.run([*where, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
                    continue
                # A bucket of 1 ms at the rate, at least two segmentation-offloaded packets (128 KiB): tbf runs on
                # high-resolution timers, and a larger bucket lets a step's messages out unshaped at 1-10 Gbit/s.
                # 50 ms of queue.
                burst = max(128 * 1024, bits // 8 // 1000)
                _run(*where, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bits}bit",
                     "burst", str(burst), "latency", "50ms")
        self.rate = rate

    def cut(self, node: int) -> None:
        """Pull node ``node``'s cable: nothing reaches it or leaves it."""
        _run("ip", "link", "set", self.nodes[node].link, "down")

    def mend(self, node: int) -> None:
        """Plug node ``node``'s cable back."""
        _run("ip", "link", "set", self.nodes[node].link, "up")

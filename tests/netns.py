"""Several "nodes" on one machine for the tests: the project's namespaces testbed (needs root and ``ip netns``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ddpkit.bench.sections.links.testbed import Testbed


@contextmanager
def bridged_nodes(count: int) -> Iterator[tuple[list[str], list[str], list[str]]]:
    """Yield ``(names, addresses, links)`` of ``count`` namespaces on one bridge (the project's
    :class:`~ddpkit.bench.sections.links.testbed.Testbed`); ``links[k]`` is node k's cable (its veth end on the bridge:
    ``ip link set LINK down`` cuts node k off).

    Skips the test (with the reason) where it does not run as root with iproute2.
    """
    if (why := Testbed.why_not()) is not None:
        pytest.skip(f"multi-node tests: {why}")
    bed = Testbed(count).__enter__()  # root with iproute2 that cannot make one is a failure, not a skip
    try:
        yield [n.namespace for n in bed.nodes], [n.address for n in bed.nodes], [n.link for n in bed.nodes]
    finally:
        bed.close()


@contextmanager
def two_nodes() -> Iterator[tuple[list[str], list[str]]]:
    """Yield ``(names, addresses)`` of two namespaces that reach each other (over a bridge).

    Skips the test (with the reason) where namespaces cannot be made.
    """
    with bridged_nodes(2) as (names, addresses, _):
        yield names, addresses


def in_namespace(name: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", name, *argv]


def veth_end(names: list[str], node: int) -> str:
    """The name of node ``node``'s cable end inside its namespace (``ip -n NAME link set END down``)."""
    return f"{names[node][:-len(str(node)) - 1]}h{node}p"


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

"""Backends beyond torch's built-in ones, found through the package's entry points.

torch's pip builds carry gloo and NCCL; a backend of ddpkit's own (``mpi``:
a process group on mpi4py, in :mod:`ddpkit.comm.mpi`) lives in a layer above
this one. The runtime does not import it: the package declares it as an
entry point of the group ``ddpkit.backends`` (``pyproject.toml``), and
:func:`find` loads it by name when :func:`ddpkit.init` is asked for it. A
plugin is an object with:

- ``name``: ddpkit's name for it (``--backend`` and ``DDPKIT_BACKEND``);
- ``torch_name``: the name torch knows its groups by (``dist.get_backend()``);
  torch reserves ``mpi`` for its own, built-in backend;
- ``unavailable()``: why it cannot run here, with the fix, or ``None``
  (cheap: it must not start the library, the launcher calls it);
- ``join(place, timeout_s)``: meet the other ranks and return a :class:`Joined`.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol

from ddpkit.runtime.discovery import Placement

__all__ = ["ENTRY_POINTS", "Joined", "Plugin", "find", "names", "torch_names"]

ENTRY_POINTS = "ddpkit.backends"


@dataclass(frozen=True, kw_only=True)
class Joined:
    """Where a plugin's rendezvous left this process."""

    place: Placement
    """This process's place as the backend sees it (authoritative: an MPI communicator, not the environment)."""
    store: Any
    """A store every rank reaches (ddpkit's stall reports use it)."""
    store_addr: str
    store_port: int


class Plugin(Protocol):
    name: str
    torch_name: str

    def unavailable(self) -> str | None: ...

    def join(self, place: Placement, timeout_s: float) -> Joined: ...


_found: dict[str, Plugin] = {}


def names() -> list[str]:
    """The names of the plugin backends this installation declares."""
    return sorted(ep.name for ep in entry_points(group=ENTRY_POINTS))


def find(name: str) -> Plugin:
    """The plugin backend called ``name``, loaded on first use.

    Raises:
        ValueError: no installed package declares it (ddpkit itself run from a source tree that was never
            installed declares none).
    """
    if name in _found:
        return _found[name]
    matches = [ep for ep in entry_points(group=ENTRY_POINTS) if ep.name == name]
    if not matches:
        raise ValueError(
            f"backend {name!r} is found through the entry points of the installed ddpkit package, and none "
            f"declares it: install ddpkit (pip install -e '.[{name}]' in a checkout) rather than running it from "
            "its source tree on PYTHONPATH"
        )
    plugin = matches[0].load()
    _found[name] = plugin
    return plugin


def torch_names() -> dict[str, str]:
    """torch's name of each declared plugin backend -> ddpkit's (``mpi4py`` -> ``mpi``)."""
    return {find(name).torch_name: name for name in names()}

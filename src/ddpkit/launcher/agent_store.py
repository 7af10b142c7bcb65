"""The single-node launcher's store: torchrun's "agent store", served by the launcher for the whole job.

torchrun serves the job's TCP store from its agent and tells the workers so
(``TORCHELASTIC_USE_AGENT_STORE=True``): rank 0 then connects to it as a
client like every other rank (torch's ``env://`` rendezvous, and ddpkit's,
read that variable), and the store outlives a restart of the workers. ddpkit's
multi-node launchers already share a store (:mod:`ddpkit.launcher.node_rendezvous`);
this is the same contract on one node.

The port is bound at once, before any worker starts (so it cannot be taken
in between, and a worker's connection waits in the listen queue); torch,
which the store needs, is imported on a thread once the first workers have
been started (:meth:`AgentStore.start`), while they import their own, so the
workers start no later for it.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ddpkit.runtime.network import loopback_listener
from ddpkit.runtime.options import ConfigError

__all__ = ["AgentStore"]


class AgentStore:
    """A TCP store on ``host:port`` served from this process until :meth:`close`.

    ``timeout_s`` is called on the serving thread (it may import torch).

    Raises:
        ConfigError: the port is busy.
    """

    def __init__(self, host: str, port: int, timeout_s: Callable[[], float]) -> None:
        self.where = f"{host}:{port}"
        fd = _listen(host, port)
        self._store: Any = None
        self.error: str | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(host, port, fd, timeout_s),
                                        name="ddpkit-agent-store", daemon=True)

    def start(self) -> None:
        """Begin serving (importing torch on a thread); later calls do nothing."""
        if not self._thread.is_alive() and not self._ready.is_set():
            self._thread.start()

    def _serve(self, host: str, port: int, fd: int, timeout_s: Callable[[], float]) -> None:
        try:
            import torch.distributed as dist

            self._store = dist.TCPStore(host, port, None, True, timeout=timedelta(seconds=timeout_s()),
                                        wait_for_workers=False, master_listen_fd=fd)
        except Exception as e:  # noqa: BLE001 - reported by the launcher; the workers then cannot meet
            self.error = f"the launcher could not serve the rendezvous store at {self.where}: {e}"
            socket.close(fd)
        finally:
            self._ready.set()

    def wait_ready(self, timeout_s: float | None = None) -> str | None:
        """Wait until the store serves (or failed); return the failure, if any."""
        self._ready.wait(timeout_s)
        return self.error

    def close(self) -> None:
        """Stop serving (the store closes its socket when collected)."""
        if self._thread.is_alive() or self._ready.is_set():
            self._ready.wait()
        self._store = None


def _listen(host: str, port: int) -> int:
    """A listening socket for the store: on loopback alone for a loopback host, else on every interface."""
    try:
        fd = loopback_listener(host, port, or_any=True)
        assert fd is not None
        return fd
    except OSError as e:
        raise ConfigError(f"the rendezvous port {port} is busy on this node ({e.strerror}): choose a free one "
                          "with --master-port, or use --standalone to pick one") from None

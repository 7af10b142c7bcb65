"""DDP's buffers (BatchNorm's running statistics): which are broadcast, and when, by torch 2.13's rules.

* At construction, parameters and buffers go out from rank 0 together
  (buffers too, unless torch's old ``broadcast_buffers=False`` was given).
* Before a forward that follows a synchronised one (and only then: the first
  synchronised forward after a ``no_sync()`` block keeps each rank's own
  statistics), buffers go out from rank 0 when ``forward_sync_buffers``, in
  one message of raw bytes, without touching their autograd version counters
  (a graph that saved a buffer still runs backward after a second forward).
  Under ``join()`` they go out from the highest rank still training.
* Parameters and buffers named with
  ``_set_params_and_buffers_to_ignore_for_model`` before wrapping are left
  alone: not broadcast, not checked, not reduced. As in torch, a parameter of
  the root module itself is still reduced (torch matches those against
  ``".name"``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddpkit.parallel.common.broadcast import PackedBroadcast

__all__ = ["IGNORED_ATTRIBUTE", "DDPBuffers"]

IGNORED_ATTRIBUTE = "_ddp_params_and_buffers_to_ignore"
"""The module attribute naming what DDP leaves alone (torch's)."""


class DDPBuffers:
    """DDP's buffer rules (see the module notes); a part of :class:`ddpkit.DistributedDataParallel`.

    Reads the wrapper's ``module``, ``process_group``, ``parameters_to_ignore``,
    ``forward_sync_buffers`` and ``require_forward_param_sync``.
    """

    module: nn.Module
    process_group: Any
    parameters_to_ignore: set[str]
    forward_sync_buffers: bool
    require_forward_param_sync: bool

    def _init_buffers(self) -> list[torch.Tensor]:
        """Collect the buffers DDP syncs for the first time; returns them."""
        buffers = self.modules_buffers
        self._buffer_broadcast: PackedBroadcast | None = None
        self._buffer_ids: tuple[int, ...] = ()
        self._buffer_count = len(buffers)
        """Buffers at the last collection; none means no broadcast (as torch's
        cached ``modules_buffers``), and no walk over the modules per forward."""
        return buffers

    @property
    def broadcast_buffers(self) -> bool:
        """torch's older name for :attr:`forward_sync_buffers` (reads and sets it)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """Name parameters and buffers of ``module`` that DDP must leave alone, before wrapping (torch's API)."""
        setattr(module, IGNORED_ATTRIBUTE, params_and_buffers_to_ignore)
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name in params_and_buffers_to_ignore:
                tensor._ddp_ignored = True

    @property
    def modules_buffers(self) -> list[torch.Tensor]:
        """The buffers DDP broadcasts (the module's, less the ignored ones), as torch's."""
        if not self.parameters_to_ignore:
            return list(self.module.buffers())
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    @property
    def named_module_buffers(self) -> dict[str, torch.Tensor]:
        return {n: b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore}

    def _has_buffers(self) -> bool:
        return self._buffer_count > 0

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts buffers (torch's)."""
        return self.require_forward_param_sync and self.forward_sync_buffers and self._buffer_count > 0

    def sync_module_buffers(self, src: int = 0) -> None:
        """Broadcast group rank ``src``'s buffers (a collective); collected again each time, in case the model
        reassigned one."""
        if not self._buffer_count:
            return
        buffers = self.modules_buffers
        self._buffer_count = len(buffers)
        if not buffers:
            return
        ids = tuple(id(b) for b in buffers)
        if ids != self._buffer_ids:
            # Same structure on every rank, so every rank rebuilds here together.
            self._buffer_broadcast = PackedBroadcast(buffers, self.process_group, "buffers")
            self._buffer_ids = ids
        self._buffer_broadcast(src, keep_versions=True)  # type: ignore[misc]

    @staticmethod
    def _get_data_parallel_params(module: nn.Module, named_params: bool = False) -> Any:
        """The parameters DDP manages: all but those marked ``_ddp_ignored`` (torch's)."""
        for param in module.named_parameters() if named_params else module.parameters():
            if not hasattr(param[1] if named_params else param, "_ddp_ignored"):
                yield param

"""Where torch's API differs between the versions ddpkit supports (``torch>=2.4``, tested on 2.13; the GPU suite
on 2.11), the one place that chooses.

``reduce_scatter_tensor`` / ``all_gather_tensor``
    torch 2.12 renamed ``dist.reduce_scatter_tensor`` and
    ``dist.all_gather_into_tensor`` to ``reduce_scatter_single`` and
    ``all_gather_single`` (the old names warn from 2.13 on); before 2.12 only
    the old names exist. Same arguments: ``(output, input, [op,] group=None,
    async_op=False)``.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_tensor", "reduce_scatter_tensor"]

reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

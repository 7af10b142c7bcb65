"""torch's own implementations, for side-by-side comparison only.

The one module of ddpkit's source allowed to import ``torch.nn.parallel`` and
``torch.distributed.algorithms``: ``ddpkit bench`` and ``ddpkit train
--engine torch`` measure ddpkit against them. Nothing else may use them to do
ddpkit's job.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def torch_ddp(module: nn.Module, **kwargs: Any) -> nn.Module:
    """Wrap ``module`` in ``torch.nn.parallel.DistributedDataParallel`` with ``kwargs``."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, **kwargs)

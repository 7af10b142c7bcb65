"""DistributedDataParallel: ``wrapper`` is the class; its engine (``ddpkit.parallel.common.reducer``, or ZeRO's)
comes from ``engine``.

Nothing is imported here; the class is still ``ddpkit.parallel.ddp.DistributedDataParallel``, found when first
asked for.
"""

from ddpkit.runtime.exports import lazy

__all__ = ["DistributedDataParallel"]
__getattr__ = lazy(__name__, {"DistributedDataParallel": "wrapper"})

"""DistributedDataParallel and its engine: ``wrapper`` is the class, ``reducer`` the entry to the engine.

Nothing is imported here (the command line reads ``bucket_caps`` without importing torch); the class is
still ``ddpkit.parallel.ddp.DistributedDataParallel``, found when first asked for.
"""

from ddpkit.runtime.exports import lazy

__all__ = ["DistributedDataParallel"]
__getattr__ = lazy(__name__, {"DistributedDataParallel": "wrapper"})

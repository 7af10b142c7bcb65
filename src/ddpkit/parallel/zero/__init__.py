"""ZeRO: the optimizer state sharded (stage 1, ``stage1``) and the gradients too (stage 2, ``stage2``).

Nothing is imported here; ``ZeroRedundancyOptimizer`` is found when first asked for.
"""

from ddpkit.runtime.exports import lazy

__all__ = ["ZeroRedundancyOptimizer"]
__getattr__ = lazy(__name__, {"ZeroRedundancyOptimizer": "stage1"})

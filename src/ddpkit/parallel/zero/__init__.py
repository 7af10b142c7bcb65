"""ZeRO: the optimizer state sharded (stage 1, ``stage1``), the gradients too (stage 2, ``stage2``), and the
parameters too (stage 3, ``stage3``: units, gathering, reductions, state dicts whole, sharded checkpoints,
meta-device materialisation).

Nothing is imported here; ``ZeroRedundancyOptimizer`` is found when first asked for.
"""

from ddpkit.runtime.exports import lazy

__all__ = ["ZeroRedundancyOptimizer"]
__getattr__ = lazy(__name__, {"ZeroRedundancyOptimizer": "stage1"})

"""Parameter servers: the workers' ``optimizer``, the ``server`` process and their ``channel``.

Nothing is imported here (the launcher reads ``channel`` without importing torch); the workers' names are
found when first asked for.
"""

from ddpkit.runtime.exports import lazy

__all__ = ["ParameterServerOptimizer", "partition"]
__getattr__ = lazy(__name__, {"ParameterServerOptimizer": "optimizer", "partition": "optimizer"})

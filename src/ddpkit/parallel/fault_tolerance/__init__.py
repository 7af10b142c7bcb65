"""Fault tolerance's engine: how a step's gradients are reduced over the members (``ddpkit.FaultTolerance``,
in :mod:`ddpkit.train.fault_tolerance`, drives it).

``shard_tree`` is the deterministic mode's fixed order of additions, ``ordered_sum`` its reduction along that
tree (an ordered reduce-scatter and all-gather, in a dtype hook's dtype where the script registered one), and
``hook_reduction`` the summed mode's gradients reduced through a ``DistributedDataParallel``'s comm hook, bucket by
bucket. Each takes the step's collectives as a callable, so that the membership's waits (which end when a newer
view comes) stay the caller's.

Nothing is imported here; ``ShardTree`` is found when first asked for.
"""

from ddpkit.runtime.exports import lazy

__all__ = ["ShardTree"]
__getattr__ = lazy(__name__, {"ShardTree": "shard_tree"})

"""Fault tolerance: ``ddpkit.FaultTolerance``, training that goes on through a worker's death in the same
processes (under ``ddpkit launch --on-failure continue``), and how its steps' gradients are reduced over the
members.

``steps`` is ``FaultTolerance`` and its ``Step``s (given until applied, micro-batches per shard, each step's send
buffer and its bookkeeping); ``agreement`` what the members compare before they go on and the state transfer to
whoever is behind; ``model_buffers`` the module's buffers carried bit for bit; ``wrapped`` which models the mode
drives (a ``ddpkit.DistributedDataParallel`` among them). ``all_reduced_sum`` is the summed (default) mode's reduction
of a step's send buffer; ``shard_tree`` is the deterministic mode's fixed order
of additions, ``ordered_sum`` its reduction along that tree (an ordered reduce-scatter and all-gather, in a dtype
hook's dtype where the script registered one); ``overlap`` sends the summed mode's buckets during the last
micro-batch's backward, and ``hook_reduction`` reduces its gradients through a ``DistributedDataParallel``'s comm
hook after backward, bucket by bucket (a world of one). The reductions take the step's collectives as a
callable, so that the membership's waits (which end when a newer view comes) stay the caller's.

Nothing is imported here; each name is found when first asked for.
"""

from ddpkit.runtime.exports import lazy

__all__ = ["FaultTolerance", "ShardTree", "Step"]
__getattr__ = lazy(__name__, {"FaultTolerance": "steps", "ShardTree": "shard_tree", "Step": "steps"})

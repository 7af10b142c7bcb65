"""The parallel algorithms, one folder per algorithm so the tree shows which file is whose.

``ddp/``
    DistributedDataParallel: the wrapper, the reducer (one synchronised
    backward's state machine), buckets, staging, gradient hooks, unused
    parameters, the static graph, join, the observer and tracing, torch's
    logging data; also the engine's deferred mode that Horovod's
    ``DistributedOptimizer`` runs on.
``zero/``
    ZeRO: stage 1 (``ZeroRedundancyOptimizer``, torch's partition) and stage 2
    (the reducer whose buckets are reduce-scattered into per-rank shards).
``ps/``
    parameter servers: the workers' optimizer, the server process, their channel.

Beside them, the small wrappers and the other consistency models:
``dp`` and ``scatter`` (DataParallel in one process), ``syncbn``,
``optimizer`` (Horovod's ``DistributedOptimizer``), ``broadcast`` (parameters,
optimizer state and DDP's buffers from one rank), ``local_sgd`` and ``ssp``
(stale-synchronous training).
"""

"""The parallel algorithms, one folder per algorithm so the tree shows which file is whose, in layers of their own.

``common/``
    What several engines share: the reducer (one synchronised backward's
    state machine) and its parts (buckets, staging, gradient hooks, unused
    parameters, the static graph, the deferred mode Horovod's
    ``DistributedOptimizer`` runs on), the observers and tracing, ``Join``,
    the replica check, broadcasts, scatter and gather.
``zero/``
    ZeRO: stage 1 (``ZeroRedundancyOptimizer``, torch's partition), stage 2
    (the reducer whose buckets are reduce-scattered into per-rank shards) and
    stage 3 (the parameters sharded too, as DTensors, gathered unit by unit).
``ps/``
    parameter servers: the workers' optimizer, the server process, their channel.
``ddp/``
    ``DistributedDataParallel``: the wrapper, its arguments, buffers, output
    sink, join side and logging data, and the engine factory (``engine``), the
    one place it meets ``zero/``.

Beside them, above the folders: ``dp`` (DataParallel in one process),
``syncbn``, ``horovod_optimizer`` (Horovod's ``DistributedOptimizer``), ``local_sgd``
and ``ssp`` (stale-synchronous training), ``unwrap``.

Folders of one level do not import each other (``tests/test_layers.py``):
``common`` <- ``zero``, ``ps`` <- ``ddp`` <- the modules beside.
"""

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
``fault_tolerance/``
    ``FaultTolerance``: training that goes on through a worker's death (its
    steps, the members' agreement and state transfer, the deterministic
    mode's ordered reduction), driving ``ddp/``'s wrapper.

Beside them, above the folders: ``dp`` (DataParallel in one process),
``syncbn``, ``horovod_optimizer`` (Horovod's ``DistributedOptimizer``), ``local_sgd``,
``diloco`` and ``ssp`` (stale-synchronous training), ``unwrap``.

Folders of one level do not import each other (``tests/test_layers.py``):
``common`` <- ``zero``, ``ps`` <- ``ddp`` <- ``fault_tolerance`` and the modules beside (one level, neither
importing the other).
"""

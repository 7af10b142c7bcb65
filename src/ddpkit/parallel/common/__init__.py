"""What several engines share, below ``ddp/`` and ``zero/``: neither imports the other's parts for these.

``reducer`` (one synchronised backward's state machine) and its parts:
``buckets``, ``bucket_caps``, ``staging``, ``grad_hooks``, ``static_graph``,
``unused``, ``deferred`` (the mode Horovod's ``DistributedOptimizer`` runs it
in). DDP's wrapper drives the reducer, ZeRO stage 2 is a reducer, Horovod's
optimizer drives its deferred mode. Beside it: ``observer`` and ``trace``
(the engines' public events and the Chrome traces made of them), ``join_context``
(torch's ``Join`` protocol, for DDP and ``ZeroRedundancyOptimizer``),
``replicas`` (every rank holds the same model), ``broadcast`` (tensors from
one rank) and ``scatter`` (inputs over devices, outputs back).

Nothing is imported here (the command line reads ``bucket_caps`` without importing torch).
"""

"""Where this process stands in the job and the process group it joins.

``discovery`` (torch-free: env, torchrun, MPI, PMI, SLURM), ``group`` (init,
rendezvous and census, barrier, zero_first, print0), ``process`` (torch-free
process control shared by ``spawn`` and the launcher), ``spawn``, and ``states`` (torch-free: the one check of
every state machine's moves).

Nothing is imported here: the launcher reads ``discovery`` and ``process``
without paying for ``import torch``.
"""

"""Where this process stands in the job and the process group it joins.

``discovery`` (torch-free: env, torchrun, MPI, PMI, SLURM), ``group`` (init,
rendezvous and census, barrier, zero_first, print0), ``process`` (torch-free
process control shared by ``spawn`` and the launcher) and ``spawn``.

Nothing is imported here: the launcher reads ``discovery`` and ``process``
without paying for ``import torch``.
"""

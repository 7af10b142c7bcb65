"""The sections of ``ddpkit bench``, one module each: the engines side by side, DataParallel, averaging, scaling,
memory and ZeRO, MPI against gloo, the collectives, the consistency models, the cost of a failure, and the links
across the namespaces testbed (``links/``). Each times workloads with the runners and writes with the report."""

"""The parallel wrappers and their engine: the reducer and DistributedDataParallel."""

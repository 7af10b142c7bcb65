"""Data: the distributed sampler and the data sets ``ddpkit train`` reads."""

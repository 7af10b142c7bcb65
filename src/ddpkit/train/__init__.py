"""``ddpkit train``: its config, loop, models, checkpoints and run directory.

Nothing is imported here: ``train.config`` stays torch-free, so building the
command line costs no ``import torch``.
"""

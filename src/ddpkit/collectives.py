"""``ddpkit.collectives``: the public name of :mod:`ddpkit.comm.allreduce` (all-reduce algorithms)."""

from ddpkit.comm.allreduce import *  # noqa: F401,F403
from ddpkit.comm.allreduce import __all__  # noqa: F401

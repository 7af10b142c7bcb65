"""``ddpkit.collectives``: the public name of :mod:`ddpkit.comm.collectives` (all-reduce algorithms)."""

from ddpkit.comm.collectives import *  # noqa: F401,F403
from ddpkit.comm.collectives import __all__  # noqa: F401

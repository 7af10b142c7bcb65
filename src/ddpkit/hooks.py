"""``ddpkit.hooks``: the public name of :mod:`ddpkit.comm.hooks` (comm hooks for DDP)."""

from ddpkit.comm.hooks import *  # noqa: F401,F403
from ddpkit.comm.hooks import __all__  # noqa: F401

"""``ddpkit.hooks``: the public name of the comm hooks for DDP (:mod:`ddpkit.comm.bucket_hooks`,
:mod:`ddpkit.comm.powersgd`)."""

from ddpkit.comm import bucket_hooks as _hooks
from ddpkit.comm import powersgd as _powersgd
from ddpkit.comm.bucket_hooks import *  # noqa: F401,F403
from ddpkit.comm.powersgd import *  # noqa: F401,F403

__all__ = [*_hooks.__all__, *_powersgd.__all__]

"""``ddpkit doctor``: what a machine offers data-parallel training, and a self-test of ddpkit on it.

Run it first on a new machine or cluster node (:mod:`ddpkit.doctor.environment`
reports; :mod:`ddpkit.doctor.selftest` starts ranks and checks every backend
and device; :mod:`ddpkit.doctor.checkup` is the command).
"""

"""Communication: the bucket view comm hooks see, and the hooks themselves.

Sits below the engine (:mod:`ddpkit.parallel`): nothing here imports it.
"""

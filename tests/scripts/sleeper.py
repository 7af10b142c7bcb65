"""Initialises, says so, and sleeps: for signal tests.

In short naps: Python raises ``KeyboardInterrupt`` between bytecodes, so a
SIGINT that lands after the print but before one long ``time.sleep`` has
begun would wait for that sleep to end (seen once in 30 launches under load).
"""

import os
import time

import ddpkit

ddpkit.init()
print("SLEEPING", os.getpid(), flush=True)
for _ in range(1200):
    time.sleep(0.1)

"""Initialises, says so, and sleeps: for signal tests."""

import os
import time

import ddpkit

ddpkit.init()
print("SLEEPING", os.getpid(), flush=True)
time.sleep(120)

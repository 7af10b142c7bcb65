"""Imported by the forkserver ddpkit starts, and nowhere else: the server ends without the interpreter's teardown.

A forkserver exits when the process that started it does. With torch
imported, the interpreter's teardown would keep it (and the output streams it
shares) alive for a second or more after the command has ended, a process a
user, a script or a test sees as left over. Importing this module registers,
in the server, an exit handler that flushes and leaves at once, after the
others have run (handlers run last-registered first). The server's children
end with ``os._exit`` (multiprocessing's rule) and never reach it.
"""

from __future__ import annotations

import atexit

from ddpkit.runtime.process import exit_now

atexit.register(exit_now, 0)

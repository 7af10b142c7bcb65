"""Imported by the forkserver ddpkit starts, and nowhere else: the server leaves its parent's process group, and
ends without the interpreter's teardown.

A signal to the parent's process group (``timeout``, a job control's ``kill -TERM -PGID``) would kill the server at
once, and the kernel would then end every child it forked (``die_with_parent``) before the parent could stop them
gracefully; in a session of its own the server sees none of those, and exits when its parent does (multiprocessing
tells it so by a pipe: :func:`ddpkit.runtime.spawn.leave_forkserver`).

A forkserver exits when the process that started it does. With torch
imported, the interpreter's teardown would keep it (and the output streams it
shares) alive for a second or more after the command has ended, a process a
user, a script or a test sees as left over. Importing this module registers,
in the server, an exit handler that flushes and leaves at once, after the
others have run (handlers run last-registered first). The server's children
end with ``os._exit`` (multiprocessing's rule); those that run the exit
handlers themselves first (:func:`ddpkit.runtime.process.finish_as_interpreter`)
take this one out of their copy.
"""

from __future__ import annotations

import atexit
import os

from ddpkit.runtime.process import exit_now

if os.getpgid(0) != os.getpid():  # (a group leader cannot, and needs not)
    os.setsid()
atexit.register(exit_now, 0)

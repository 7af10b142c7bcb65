"""Processes that run ``python -u -m MODULE ARGS``, forked from a server that imported torch and MODULE's imports
once (multiprocessing's forkserver), where each fresh interpreter would import them again.

A worker of ``ddpkit train --on-failure continue`` started fresh spends about three CPU-seconds importing torch,
``torch._dynamo`` and the training code before it trains, and a replacement spends them before it can join the
job. Forked from a server that holds those imports, it starts in milliseconds. The launcher uses this for the
modules it is told to preload (``LaunchConfig.preload``, which only ``ddpkit train`` sets: its own modules); a
user's program always gets a fresh interpreter, as under torchrun.

What the child gets is what ``subprocess.Popen`` gives a fresh interpreter, with these differences, none of which
matters to ddpkit's own modules:

* the interpreter and torch started in the server, before the child's environment was set: what they read of it
  at their start is the server's (the launcher's): ``PYTHONHASHSEED``, ``PYTHONIOENCODING``, ``PYTHONWARNINGS``,
  ``PYTHONFAULTHANDLER``, torch's import-time variables (``OMP_NUM_THREADS`` is applied by hand, as
  :mod:`ddpkit.runtime.spawn` does);
* stdin is ``/dev/null`` (multiprocessing's rule; these modules read none);
* a file descriptor passed to the child has another number there: the environment variable that names it is
  rewritten to the child's number;
* ``ps`` shows the server's command line, and ``/proc/PID/environ`` the server's environment (the kernel keeps
  what ``exec`` was given); the launcher names each child instead (``/proc/PID/comm``, what ``ps -o comm`` and
  ``top`` show): ``ddpkit-rank3`` for rank 3's worker, ``ddpkit-server0`` for parameter server 0.

The child leads a process group of its own (:func:`start_module` returns once it does, so a signal to the group
reaches it) and dies with the server, which dies with the launcher (also one killed outright:
:func:`ddpkit.runtime.spawn.leave_forkserver`). Its module runs as ``python -m`` runs it, in a fresh ``__main__``
that stays ``__main__`` to the end; it ends as the interpreter would, without its teardown: an exception that
escaped goes to ``sys.excepthook`` (exit code 1), ``SystemExit`` gives its code, an escaped ``KeyboardInterrupt``
ends it by SIGINT; then non-daemon threads are joined, ``atexit`` handlers run, and the streams and files still
open are flushed before ``os._exit``.

As with every use of multiprocessing's forkserver, each child first imports the launcher's own main module (as
``__mp_main__``): its work must sit under ``if __name__ == "__main__":`` (``python -m ddpkit``'s does).
"""

from __future__ import annotations

import atexit
import builtins
import importlib.util
import io
import multiprocessing as mp
import multiprocessing.process
import os
import signal
import subprocess
import sys
import threading
import types
from collections.abc import Mapping, Sequence
from multiprocessing.connection import wait
from multiprocessing.reduction import DupFd
from typing import Any, BinaryIO

from ddpkit.runtime.process import die_with_parent, exit_now, finish_as_interpreter, set_process_name
from ddpkit.runtime.spawn import leave_forkserver, start_forkserver, take_environment

__all__ = ["Inherited", "PreloadedProcess", "start_module"]


class PreloadedProcess:
    """What the launcher reads of a ``subprocess.Popen``: ``pid``, ``stdout``, ``stderr`` (the read ends of the
    child's), ``poll()``, ``wait()``, ``returncode`` (negative: the signal that ended it)."""

    def __init__(self, process: Any, stdout: BinaryIO, stderr: BinaryIO) -> None:
        self._process = process
        # The forkserver sends the exit status once: one reader at a time, and none of multiprocessing's own (its
        # clean-up of finished children, at every start and at exit, would read it from another thread: the
        # loser reads the pipe's end and takes 255 for the status). The launcher waits for its workers itself.
        getattr(multiprocessing.process, "_children", set()).discard(process)
        self._lock = threading.Lock()
        self.pid: int = process.pid
        self.stdout = stdout
        self.stderr = stderr

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        with self._lock:
            return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        if not wait([self._process.sentinel], timeout):
            raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0.0)
        code = self.poll()
        assert code is not None  # the sentinel is readable once the status was sent
        return code


def start_module(module: str, args: Sequence[str], env: Mapping[str, str], *, preload: Sequence[str],
                 fds: Mapping[str, int] | None = None, name: str | None = None) -> PreloadedProcess:
    """Start ``python -u -m module *args`` with ``env``, forked from the forkserver with ``preload`` imported
    (:func:`ddpkit.runtime.spawn.start_forkserver`: started now if it is not running yet).

    Args:
        fds: environment variables that name a file descriptor of this process which the child inherits (the
            child's variable names its own copy).
        name: the child's name in ``/proc/PID/comm`` (15 characters at most).
    """
    start_forkserver(preload)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    ready_r, ready_w = os.pipe()
    passed = dict(fds or {})
    try:
        process = mp.get_context("forkserver").Process(
            target=_run, name=f"ddpkit:{module}",
            args=(module, list(args), dict(env), Inherited(out_w), Inherited(err_w), Inherited(ready_w),
                  {variable: Inherited(fd) for variable, fd in passed.items()}, name),
        )
        process.start()
    except BaseException:
        for fd in (out_r, err_r, ready_r):
            os.close(fd)
        raise
    finally:
        for fd in (out_w, err_w, ready_w):
            os.close(fd)
    started = PreloadedProcess(process, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
    with os.fdopen(ready_r, "rb", buffering=0) as ready:
        ready.read(1)  # the child leads its process group (or died before: then it is read as its exit)
    return started


class Inherited:
    """A file descriptor of this process that a child of the forkserver inherits (an argument of its
    ``Process``): pickled for the child's start (and only then), it goes with the start's own (SCM_RIGHTS), and
    arrives as the child's number for it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _received, (DupFd(self.fd),)


def _received(dup: Any) -> int:
    return dup.detach()


def _run(module: str, args: list[str], env: dict[str, str], stdout: int, stderr: int, ready: int,
         fds: dict[str, int], name: str | None) -> None:
    """The child (see the module notes)."""
    die_with_parent()
    leave_forkserver()
    os.setsid()
    if name:
        set_process_name(name)
    for target, received in ((1, stdout), (2, stderr)):
        os.dup2(received, target)
        os.close(received)
    with os.fdopen(ready, "wb", buffering=0) as told:
        told.write(b"1")
    env = {**env, **{variable: str(fd) for variable, fd in fds.items()}}
    take_environment(env)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)  # python -u
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    atexit.unregister(exit_now)  # the server's own (ddpkit.runtime.server_exit) would end this with 0
    sys.argv = [module, *args]
    code, interrupted = 0, False
    try:
        _run_as_main(module)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:  # noqa: BLE001 - the interpreter's rule: the hook prints it, the exit code says it
        sys.excepthook(type(e), e, e.__traceback__)
        code, interrupted = 1, isinstance(e, KeyboardInterrupt)
    _exit(code, interrupted)


def _run_as_main(module: str) -> None:
    """Run ``module`` as ``python -m`` does: its parent packages imported, its code run in a fresh ``__main__``
    module that stays in ``sys.modules`` (a package runs its ``__main__`` submodule)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)
    if spec.submodule_search_locations is not None:
        return _run_as_main(f"{module}.__main__")
    code = spec.loader.get_code(spec.name)  # type: ignore[attr-defined]
    main = types.ModuleType("__main__")
    main.__dict__.update(__spec__=spec, __file__=spec.origin, __loader__=spec.loader, __package__=spec.parent,
                         __cached__=spec.cached, __builtins__=builtins)
    sys.modules["__main__"] = main
    sys.argv[0] = spec.origin or module
    exec(code, main.__dict__)  # noqa: S102 - what python -m does with the module's code
    return None


def _exit(code: int, interrupted: bool) -> None:
    """End the child as the interpreter would, without its teardown (see the module notes)."""
    finish_as_interpreter()
    if interrupted:  # the interpreter's rule for an escaped KeyboardInterrupt: end by SIGINT
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    exit_now(code)

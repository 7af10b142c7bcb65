"""Process control shared by :func:`ddpkit.spawn` and ``ddpkit launch`` (torch-free).

* :func:`worker_env`: the one builder of a worker's environment, torchrun's
  contract (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
  ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_*``, ``MASTER_ADDR``,
  ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``).
* :func:`terminate`: SIGTERM to each worker's process group, SIGKILL to what
  outlives one grace period. Every worker leads its own process group, so its
  children (DataLoader workers, a shell's children) go with it.
* :func:`describe_exit`: an exit status in words.
* :func:`free_port`, :func:`free_ports` (several, all different; outside the ephemeral range).
* :func:`rank_bar`: a rank's progress bar, whose lock leaves nothing behind when the rank is killed.
* :class:`SignalCatcher`: SIGINT/SIGTERM become :class:`Interrupted`, held
  back while workers are being started so that none escapes the teardown.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import logging
import multiprocessing.util
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ddpkit.runtime.discovery import LOOPBACK

GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL when a group of workers is torn down."""

_POLL_S = 0.02
# Inherited from a torchrun parent, this would send our workers looking for
# torchrun's agent store instead of the one their rank 0 serves.
_NOT_INHERITED = ("TORCHELASTIC_USE_AGENT_STORE",)


def free_port(host: str = LOOPBACK) -> int:
    """An unused TCP port on ``host``, free at the time of the call (see :func:`free_ports`)."""
    return free_ports(1, host)[0]


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DRAWN_FROM = ((10000, 29999), (32768, 65000))
"""Where :func:`free_ports` draws, less the kernel's ephemeral range: not below 10000 (well-known services), not
Kubernetes' node ports (30000-32767: forwarded by the node's rules, with no socket a bind would meet), not above
65000 (a port + 1 must stay a port: the parameter servers' channel's default is ``MASTER_PORT + 1``)."""


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` unused TCP ports on ``host``, all different (held open together while they are found: two calls
    of :func:`free_port` may return the same port, free again once the first call closed it).

    Found outside the range the kernel hands out to outgoing connections (``ip_local_port_range``): a port from
    that range, as the OS picks for ``bind(("", 0))``, is free when found but may be taken by any process's next
    connection before the rank that serves it binds it (measured: a parameter servers' channel failed with its
    port in use in a suite of 2,000 tests). Ports are drawn uniformly at random there (see :data:`_DRAWN_FROM`),
    so that two jobs starting together rarely try the same; where the kernel's range leaves fewer than 1,000
    ports there, or ``host`` does not resolve to an IPv4 address, the OS picks as before."""
    draw = _draw_outside_ephemeral()
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError):
        draw = None  # (the OS's pick below meets the same error, as before)
    with contextlib.ExitStack() as held:
        socks: list[socket.socket] = []
        for _ in range(64 * count):
            if draw is None or len(socks) == count:
                break
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind((address, draw()))
            except OSError:  # in use (or lingering): draw again
                sock.close()
                continue
            socks.append(sock)
        while len(socks) < count:
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]


def _draw_outside_ephemeral() -> Callable[[], int] | None:
    """A function drawing a port of :data:`_DRAWN_FROM` outside the kernel's ephemeral range, uniformly at random
    (a generator of its own: the user's ``random`` state is not touched), or ``None`` where that leaves fewer
    than 1,000 ports."""
    try:
        low, high = map(int, _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return None
    ranges = []
    for a, b in _DRAWN_FROM:
        ranges += [(x, y) for x, y in ((a, min(b, low - 1)), (max(a, high + 1), b)) if x <= y]
    total = sum(b - a + 1 for a, b in ranges)
    if total < 1000:
        return None
    pick = random.Random(os.urandom(16))

    def draw() -> int:
        n = pick.randrange(total)
        for a, b in ranges:
            if n <= b - a:
                return a + n
            n -= b - a + 1
        raise AssertionError("unreachable: n < total")

    return draw


NUM_SERVERS_ENV = "DDPKIT_NUM_SERVERS"
"""How many parameter servers the job has (every process of a job with servers)."""
ROLE_ENV = "DDPKIT_ROLE"
"""``server`` in a parameter server process."""
SERVER_RANK_ENV = "DDPKIT_SERVER_RANK"
PS_PORT_ENV = "DDPKIT_PS_PORT"
"""Port of the parameter servers' store on ``MASTER_ADDR`` (default ``MASTER_PORT + 1``)."""
PS_REPLICATION_ENV = "DDPKIT_PS_REPLICATION"
"""On how many servers each key range of the parameters lives (default 1: no copy)."""
SERVER_MODULE = "ddpkit.parallel.ps.server"
"""What a parameter server process runs (``python -m``)."""


def key_range_chain(k: int, servers: int, replication: int) -> list[int]:
    """The parameter servers holding key range ``k``, head first: ``k, k+1, ..., k+R-1`` (mod K)."""
    return [(k + i) % servers for i in range(replication)]


def lost_key_ranges(dead: set[int], servers: int, replication: int) -> list[int]:
    """The key ranges none of whose servers is left, when the servers ``dead`` died."""
    return [k for k in range(servers) if all(s in dead for s in key_range_chain(k, servers, replication))]


def set_process_name(name: str) -> None:
    """Show this process as ``name`` (15 characters at most) in ``ps``, ``top`` and ``/proc/PID/comm`` (Linux;
    elsewhere nothing happens)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME, for the calling (main) thread
    except (OSError, AttributeError):
        pass


def rank_bar(**options: Any) -> Any:
    """A tqdm bar (``options``: tqdm's) in one rank of a job, where one rank at most draws.

    tqdm's default lock holds a multiprocessing ``RLock``: a named semaphore that the job's resource tracker
    counts. A rank killed by the teardown after another rank failed leaves it behind, and the tracker prints
    "There appear to be 1 leaked semaphore objects to clean up at shutdown" under the job's one-line error
    (``ddpkit train`` whose final save failed on a full disk, under load). No other process shares a rank's
    bar: a lock of this process's own is all it needs.
    """
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    return tqdm(**options)


def server_env(worker: Mapping[str, str], index: int) -> dict[str, str]:
    """The environment of parameter server ``index``, from a worker's (``WORLD_SIZE`` stays the workers')."""
    env = {k: v for k, v in worker.items()
           if k not in ("RANK", "LOCAL_RANK", "ROLE_RANK", "GROUP_RANK", "TORCHELASTIC_ERROR_FILE")}
    env.update({ROLE_ENV: "server", SERVER_RANK_ENV: str(index), "ROLE_NAME": "server", "OMP_NUM_THREADS":
                worker.get("OMP_NUM_THREADS", "1")})
    return env


def worker_env(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    master_port: int,
    master_addr: str = LOOPBACK,
    node_rank: int = 0,
    nnodes: int = 1,
    restart_count: int = 0,
    max_restarts: int = 0,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The complete environment of one worker: ``base`` plus the launcher contract.

    Args:
        base: the environment to extend (default: this process's).

    Returns:
        A new dict; ``OMP_NUM_THREADS=1`` is added when several workers share
        the node and ``base`` does not set it, as torchrun does.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _NOT_INHERITED}
    env.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
    })
    if local_world_size > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def describe_exit(code: int | None) -> str:
    """``exit code 3`` or ``killed by signal SIGKILL`` (a negative code is a signal)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _alive(proc: Any) -> bool:
    # subprocess.Popen and multiprocessing.Process, both.
    return proc.poll() is None if hasattr(proc, "poll") else proc.is_alive()


def _reap(proc: Any) -> None:
    if hasattr(proc, "poll"):
        proc.wait()
    else:
        proc.join()


def signal_groups(processes: Sequence[Any], sig: int) -> None:
    """Send ``sig`` to the process group each process leads (gone ones are skipped)."""
    for proc in processes:
        if proc.pid is None:
            continue
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def children(pid: int) -> list[int]:
    """The processes ``pid`` started that still run (Linux's ``/proc``: each thread's list of them, or, on a kernel
    built without those lists, every process's parent); none where that cannot be read."""
    if not _LISTS_CHILDREN:
        return _children_by_parent(pid)
    found: list[int] = []
    try:
        threads = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for thread in threads:
        try:
            found += [int(child) for child in (thread / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # (a thread that ended meanwhile)
    return found


_LISTS_CHILDREN = Path(f"/proc/self/task/{os.getpid()}/children").exists()
"""Whether this kernel lists each thread's children in ``/proc`` (``CONFIG_PROC_CHILDREN``)."""


def _children_by_parent(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def process_stopped(pid: int) -> bool:
    """Whether process ``pid``, or one it started, is stopped (SIGSTOP, SIGTSTP, a debugger's stop), from Linux's
    ``/proc``: a wrapper script waits in a sleep while the program it runs is the one stopped. False where that
    cannot be read (no such process, another system)."""
    todo = [pid]
    while todo:
        at = todo.pop()
        try:
            stat = Path(f"/proc/{at}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] in ("T", "t"):
            return True
        todo += children(at)
    return False


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block (the processes it starts read them), then put back what was."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def finish_as_interpreter(join_threads: bool = True) -> None:
    """What the interpreter does at exit before its teardown, which :func:`exit_now` skips: join the non-daemon
    threads (``join_threads``), run the ``atexit`` handlers (a logger's last upload, a writer's close), and flush
    every file object still open, whose buffer the teardown would have written (an unclosed log file came out
    empty). About a tenth of a second with torch loaded, where the teardown takes most of a second."""
    if join_threads and threading.current_thread() is threading.main_thread():
        # The interpreter's own step: threading's exit hooks first (concurrent.futures wakes the idle workers of
        # executors never shut down, which a plain join would wait for forever), then the non-daemon threads.
        threading._shutdown()  # noqa: SLF001 - what the interpreter runs at exit, which os._exit skips
    elif join_threads:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
    atexit.unregister(exit_now)  # a forked child's copy of its forkserver's own (server_exit) would end it with 0
    atexit._run_exitfuncs()  # noqa: SLF001 - what the interpreter runs at exit, which os._exit skips
    for obj in gc.get_objects():
        if type(obj) in _FILE_TYPES:  # (by type, not isinstance: a tenth of the time over a torch process's objects)
            try:
                if not obj.closed:
                    obj.flush()
            except Exception:  # noqa: BLE001, S110 - as the teardown: a file that cannot be flushed is left
                pass


_FILE_TYPES = frozenset({io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair, io.FileIO})
"""What ``open()`` returns, and what it wraps: the files whose buffers :func:`finish_as_interpreter` flushes."""


def exit_now(code: int) -> NoReturn:
    """End this process now: flush what it printed and logged, then exit without the interpreter's teardown.

    With torch loaded the teardown takes a second or two and does nothing
    useful at the end of a worker or of a command. multiprocessing's own exit
    step still runs (its finalizers unlink the semaphores this process made).
    """
    logging.shutdown()
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:
        _finalize_mpi()
    os._exit(code)


def _finalize_mpi() -> None:
    """Leave MPI before a successful exit when this process is an MPI rank (the mpi backend): ``mpirun`` counts a
    rank that exits without ``MPI_Finalize`` as failed. A failing exit skips it: Open MPI's finalise waits for
    ranks that may be blocked for good in a collective this one left."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def die_with_parent() -> None:
    """In a child, before ``exec``: let the kernel SIGKILL it when the process that started it dies (Linux).

    A launcher killed with SIGKILL (or an OOM kill) cannot stop its workers;
    without this they would run on, orphaned, holding the node's GPUs and
    ports. Elsewhere than Linux this does nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def terminate(processes: Sequence[Any], grace_s: float = GRACE_S, first_signal: int = signal.SIGTERM) -> None:
    """Stop every process and its children: ``first_signal``, then SIGKILL after ``grace_s``.

    Each process must lead its own process group (``start_new_session=True``
    or ``os.setpgid(0, 0)`` in the child). The SIGKILL goes to every group,
    exited leaders included, which also reaps orphaned grandchildren.
    """
    signal_groups([p for p in processes if _alive(p)], first_signal)
    # A stopped worker (SIGSTOP, Ctrl-Z) would only act on the signal when continued: continue it now
    # rather than wait out the grace period for the SIGKILL.
    signal_groups([p for p in processes if _alive(p)], signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while any(_alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    signal_groups(processes, signal.SIGKILL)
    for proc in processes:
        _reap(proc)


@contextlib.contextmanager
def torn_down(processes: list[Any], signals: SignalCatcher) -> Iterator[None]:
    """On leaving the block (success, failure or a signal): stop every process of ``processes`` and its children
    (:func:`terminate`), first with the signal that interrupted the block, else SIGTERM. Processes that
    succeeded have exited already; the list may grow inside the block."""
    first_signal = signal.SIGTERM
    try:
        yield
    except Interrupted as e:
        first_signal = e.signum
        raise
    finally:
        signals.deferring = True
        terminate(processes, GRACE_S, first_signal)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while workers ran; they have been stopped.

    A ``KeyboardInterrupt``, so code that handles Ctrl-C handles it too;
    ``signum`` says which signal (a command exits ``128 + signum``).
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"received {signal.Signals(signum).name}")


class SignalCatcher:
    """SIGINT/SIGTERM raise :class:`Interrupted` in the main thread, except while deferred.

    A signal that lands while a worker is being started is only noted, and
    raised by :meth:`raise_pending` once every started worker is on the books:
    raised in the middle of ``fork``, it would leave that worker out of the
    teardown.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, signals: Sequence[int] | None = None) -> None:
        self.received: int | None = None
        self.deferring = False
        self.signals = tuple(signals) if signals is not None else self.SIGNALS

    def __call__(self, signum: int, frame: object) -> None:
        self.received = signum
        if not self.deferring:
            raise Interrupted(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[SignalCatcher]:
        """Handle the signals inside the block (only possible in the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self) for s in self.signals}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold signals back inside the block; raise the one that came, after it."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        self.raise_pending()

    def raise_pending(self) -> None:
        if self.received is not None:
            raise Interrupted(self.received)

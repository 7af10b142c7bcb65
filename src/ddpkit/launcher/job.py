"""A launcher's job: its rendezvous (none, static or c10d), its rounds of workers, restarts.

:func:`run` is ``ddpkit launch``: it checks what can be checked before any
worker starts (backend, address, port), chooses the rendezvous, and runs
rounds of a :class:`~ddpkit.launcher.supervise.WorkerGroup` until the job
succeeds, fails with no restart left, or the launcher is signalled
(SIGINT/SIGTERM and ``--signals-to-handle``: the signal goes to every
worker group, then the launcher exits ``128 + signal``).

Static rendezvous (one node, or ``--node-rank`` on each): every node knows
its rank and all restart together. Dynamic (``--rdzv-backend c10d``): each
round's nodes agree on ranks at the endpoint; failures and arrivals form the
next round (see :mod:`ddpkit.launcher.elastic`).
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from collections.abc import Callable

from ddpkit.launcher.agent_store import AgentStore
from ddpkit.launcher.launch_config import LaunchConfig
from ddpkit.launcher.council import Council, Entry, Role, take_seat
from ddpkit.launcher.elastic import DynamicRendezvous, RendezvousClosed
from ddpkit.launcher.mpi_group import MPIWorkerGroup
from ddpkit.launcher.output import LogLayout
from ddpkit.launcher.plan import NodeSlot, plan_workers
from ddpkit.launcher.node_rendezvous import POLL_S, NodeRendezvous, RemoteFailure, rendezvous_timeout
from ddpkit.launcher.settings import LaunchSettings, resolve
from ddpkit.launcher.supervise import Failure, WorkerGroup, copy_root_cause, report, say
from ddpkit.launcher.council_group import CouncilGroup
from ddpkit.launcher.fault_tolerant_group import FaultTolerantGroup
from ddpkit.runtime import mpirun, variables
from ddpkit.runtime.discovery import JOB_TOKEN_ENV, LOOPBACK, mint_job_token
from ddpkit.runtime.network import is_local
from ddpkit.runtime.options import ConfigError
from ddpkit.runtime.process import Interrupted, SignalCatcher, describe_exit, free_port


def run(cfg: LaunchConfig) -> int:
    """Start, supervise and (re)start this node's workers; return the exit code.

    Raises:
        ConfigError: the launch cannot work: a setting :func:`~ddpkit.launcher.settings.resolve` refuses, an
            unresolvable address, a busy port.
    """
    launch = resolve(cfg)
    variables.refuse_bad_environment(os.environ)  # what every worker reads first: one line now, not N tracebacks
    if cfg.backend:
        os.environ["DDPKIT_BACKEND"] = cfg.backend  # what every worker's ddpkit.init() reads
    check_backend(os.environ.get("DDPKIT_BACKEND", ""), launch.max_nodes)
    if cfg.on_failure == "continue" and os.environ.get("DDPKIT_BACKEND", "").strip().lower() not in ("", "gloo"):
        raise ConfigError(f"--on-failure continue with the {os.environ['DDPKIT_BACKEND']} backend: the survivors "
                          "rebuild gloo groups (an MPI job cannot lose a process and go on; NCCL's abort path is "
                          "not built yet); use --backend gloo for this mode")
    master_addr = launch.master_addr
    if launch.standalone:
        port = free_port()
        master_addr = standalone_addr(cfg.local_addr)
    elif launch.dynamic:
        port = launch.endpoint[1]  # type: ignore[index]
    else:
        port = launch.port()
        check_rendezvous(launch, port)
    if launch.nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        say(f"setting OMP_NUM_THREADS=1 for each of the {launch.nproc} workers so they do not "
            "oversubscribe the CPU; set it yourself to tune")
    for note in launch.notes():
        say(note)
    token = job_token(launch)
    # torchrun's run id: a fresh uuid under --standalone (replacing --rdzv-id, as torchrun does), else
    # --rdzv-id or "none" (never the random secret, which must not reach logs).
    run_id = str(uuid.uuid4()) if launch.standalone else cfg.rdzv_id or "none"
    layout = LogLayout(launch, run_id, os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"))
    if layout.shown_dir is not None:
        say(f"worker logs in {layout.shown_dir}")
    signals = SignalCatcher(launch.signals)
    job = _Job(launch, master_addr, port, signals, token, run_id, layout)
    try:
        with signals.installed():
            try:
                with signals.deferred():
                    if launch.dynamic:
                        job.rdzv = DynamicRendezvous(launch, token)
                        if job.rdzv.serving:
                            say(f"serving the rendezvous at {job.rdzv.where}: the job ends if this launcher stops")
                    elif launch.max_nodes > 1:
                        beat_s, stale_s = launch.keep_alive()
                        job.rdzv = NodeRendezvous(host=master_addr, port=port, node=cfg.node_rank,
                                                  nnodes=launch.nnodes, token=token, beat_s=beat_s, stale_s=stale_s,
                                                  timeout_s=launch.join_timeout_s(rendezvous_timeout()))
                    else:
                        job.store = AgentStore(master_addr, port, rendezvous_timeout)
                code = job.elastic_rounds() if launch.dynamic else job.attempts()
                if code and job.failure is not None:  # (before the layout's error files are removed)
                    copy_root_cause(job.failure.error_file, job.failure.exitcode,
                                    os.environ.get("TORCHELASTIC_ERROR_FILE"))
                return code
            except Interrupted as e:
                say(f"received {signal.Signals(e.signum).name}: stopping all workers")
                signals.deferring = True  # a second Ctrl-C must not cut the teardown short
                if job.group is not None:
                    job.group.stop(first_signal=e.signum)
                return 128 + e.signum
    finally:
        if job.rdzv is not None:
            job.rdzv.close()
        if job.store is not None:
            job.store.close()
        layout.close()


def check_backend(backend: str, nnodes: int) -> None:
    """``DDPKIT_BACKEND=mpi`` needs mpi4py and an ``mpirun`` of its MPI: say so before any worker starts.

    Raises:
        ConfigError: the backend the workers would ask for cannot run here, or not under this launch.
    """
    if backend.strip().lower() != "mpi":
        return
    if nnodes != 1:
        raise ConfigError("DDPKIT_BACKEND=mpi with several nodes: start the job with mpirun --host A,B -np N "
                          "python script.py (ddpkit.init meets over MPI), not with ddpkit launch")
    try:
        mpirun.check(mpirun.find(), mpirun.library_of_mpi4py())
    except mpirun.MpirunError as e:
        raise ConfigError(f"DDPKIT_BACKEND=mpi: {e}") from None


def standalone_addr(local_addr: str | None) -> str:
    """``MASTER_ADDR`` under ``--standalone``, as torchrun sets it: ``--local-addr``, else this host's FQDN.

    Falls back to loopback when that name does not resolve to an address of
    this machine (a container whose host name is in no resolver).
    """
    name = local_addr or socket.getfqdn()
    if is_local(name):
        return name
    if local_addr:
        raise ConfigError(f"--local-addr {local_addr!r} is not an address of this machine: give one of its "
                          "host names or addresses")
    return LOOPBACK


SECRET_MIN_CHARS = 32
"""The shortest job secret a job across nodes takes: 128 bits as hex (``secrets.token_hex(16)``)."""


def job_token(launch: LaunchSettings) -> str | None:
    """The job's secret: ``--job-secret-file``'s content, else ``DDPKIT_JOB_TOKEN``, else, on a single node, a
    random one. Not ``--rdzv-id``, which names the job and is in every process list.

    Raises:
        ConfigError: a job across nodes without a secret, or with one shorter than :data:`SECRET_MIN_CHARS`
            (the nodes must share it, so none can be made up for them; one a dictionary guesses opens the job).
    """
    path = launch.config.job_secret_file
    if path is not None:
        try:
            token: str | None = path.read_text().strip() or None
        except OSError as e:
            raise ConfigError(f"--job-secret-file {path}: cannot read it ({e.strerror})") from None
        if token is None:
            raise ConfigError(f"--job-secret-file {path} is empty: write the job's secret in it")
        # ssh refuses a private key that others can read; a secret on a cluster's shared file system may have to
        # be readable by a group, so this says so and goes on.
        if (mode := path.stat().st_mode) & 0o044:
            say(f"--job-secret-file {path} can be read by other users of this machine (mode {mode & 0o777:04o}): "
                f"whoever of them reaches it and the job's ports can join the job; chmod 600 {path}")
    else:
        token = os.environ.get(JOB_TOKEN_ENV) or None
    if token is None and (launch.max_nodes == 1 or launch.standalone):  # its rendezvous is this machine's alone
        return mint_job_token()
    fix = (f"make one on one machine (python3 -c 'import secrets; print(secrets.token_hex(16))') and give every "
           f"node the same, in {JOB_TOKEN_ENV} or a file named by --job-secret-file (not on the command line, "
           "which every process list shows)")
    if token is None:
        raise ConfigError(f"--nnodes {launch.config.nnodes}: a job across nodes needs a secret that only its "
                          f"launchers hold, or any process that reaches the rendezvous joins it: {fix}")
    if launch.max_nodes > 1 and not launch.standalone and len(token) < SECRET_MIN_CHARS:
        raise ConfigError(f"the job's secret has {len(token)} characters: across nodes it needs at least "
                          f"{SECRET_MIN_CHARS} (128 bits as hex), or a dictionary guesses it from what the "
                          f"rendezvous store shows; {fix}")
    return token


class _Job:
    """One launcher's run: its rounds of workers, the failures between them, and the node rendezvous."""

    def __init__(self, launch: LaunchSettings, master_addr: str, port: int, signals: SignalCatcher,
                 token: str | None, run_id: str, layout: LogLayout):
        self.launch, self.master_addr, self.port, self.signals, self.token, self.run_id, self.layout = (
            launch, master_addr, port, signals, token, run_id, layout)
        self.rdzv: NodeRendezvous | None = None
        self.store: AgentStore | None = None
        """One node: the store the launcher serves for every round (see :mod:`ddpkit.launcher.agent_store`)."""
        self.group: WorkerGroup | None = None
        self.council: Council | None = None
        """Several nodes under ``--on-failure continue``: the agents' majority membership."""
        self.failure: Failure | None = None
        """This node's last failed worker (the root cause torchrun's ``@record`` copies: :func:`copy_root_cause`)."""

    def _round(self, attempt: int, restart_count: int, slot: NodeSlot,
               watch: Callable[[], RemoteFailure | str | None] | None) -> Failure | RemoteFailure | str | None:
        """Run this node's workers for one round; the outcome of :meth:`WorkerGroup.wait`, reported."""
        launch = self.launch
        self.failure = None  # (a round that ends otherwise must not pass an earlier round's error on)
        errors = self.layout.start_attempt(attempt, launch.nproc)
        specs = plan_workers(launch, master_port=slot.master_port, restart_count=restart_count, base_env=os.environ,
                             job_token=self.token, agent_store=True, run_id=self.run_id,
                             slot=slot, error_files=errors)
        mpi = os.environ.get("DDPKIT_BACKEND", "").strip().lower() == "mpi"
        if launch.config.on_failure == "continue":
            replacements = launch.config.max_restarts
            self.group = (FaultTolerantGroup(launch, self.layout, replacements) if self.council is None
                          else CouncilGroup(launch, self.layout, self.council, replacements))
        else:
            self.group = (MPIWorkerGroup if mpi else WorkerGroup)(launch, self.layout)
        self.group.start(specs, self.signals)
        if self.store is not None:
            self.store.start()  # torch for the store, imported while the workers import theirs
        outcome = self.group.wait(watch=watch)
        if outcome is None:
            self.group.finish()
        else:
            self.group.stop()
        if isinstance(outcome, Failure) and self.rdzv is not None and self.council is None:
            # Another node stopped its workers for a membership change before
            # this one looked: the broken connection is that, not a failure.
            if change := self.rdzv.declared_change(attempt):
                return change
        if isinstance(outcome, RemoteFailure):
            say(f"{outcome.describe()}\nstopped this node's workers")
        elif isinstance(outcome, Failure):
            cause = _share(self.rdzv, attempt, slot.node_rank, outcome) if self.rdzv and not self.council else None
            report(outcome)
            self.failure = outcome
            if cause is not None and cause.node != slot.node_rank:
                say(f"root cause on another node: {cause.describe()}")
        return outcome

    def _succeeded(self, round_: int) -> int:
        remote = self.rdzv.finish(round_, ok=True) if self.rdzv else None
        if remote is None:
            return 0
        say(f"{remote.describe()}\n(this node's workers had finished)")
        return 1

    def _store_failure(self) -> RemoteFailure | None:
        error = self.store.wait_ready(0) if self.store else None
        return RemoteFailure(-1, None, error) if error else None

    def attempts(self) -> int:
        """Static rendezvous: every node knows its rank; all restart together."""
        launch, rdzv, port = self.launch, self.rdzv, self.port
        max_restarts = launch.config.max_restarts if launch.config.on_failure == "restart" else 0
        first = rdzv.current_round() if rdzv else 0
        if rdzv and launch.config.on_failure == "continue":
            return self.council_round(rdzv)
        if first:
            say(f"joining the job in progress at restart round {first}")
        for attempt in range(first, max_restarts + 1):
            if rdzv:
                try:
                    rdzv.begin(attempt)
                except Exception as e:  # noqa: BLE001 - node 0 went away between rounds
                    say(f"node 0's rendezvous stopped answering ({type(e).__name__}) before restart round {attempt}: "
                        "node 0 is down, its launcher was killed, or the network to it is cut")
                    return 1
            outcome = self._round(attempt, attempt, NodeSlot.static(launch, port, self.master_addr),
                                  (lambda a=attempt: rdzv.watch(a)) if rdzv else self._store_failure)
            if outcome is None:
                return self._succeeded(attempt)
            if isinstance(outcome, RemoteFailure) and outcome.node < 0:
                return 1  # no store, no next round
            if attempt < max_restarts:
                say(f"restarting the worker group (restart {attempt + 1} of {max_restarts})"
                    + (", every node together" if rdzv else ""))
            elif rdzv:
                rdzv.finish(attempt, ok=False)
        return 1

    def council_round(self, rdzv: NodeRendezvous) -> int:
        """Several nodes under ``--on-failure continue``: one round, its memberships decided by the agents'
        majority (:mod:`ddpkit.launcher.council`); the first store is needed only to meet. A spare node
        (``--nnodes MIN:MAX``, ``--node-rank`` MIN or more) joins the running job."""
        launch = self.launch
        try:
            # The failure detector is the rendezvous's keep-alive (--rdzv-conf): interval x attempts, 6 s by default.
            suspect_s = launch.keep_alive()[1]
            self.council, served = take_seat(rdzv, node=rdzv.node, nnodes=launch.nnodes, nproc=launch.nproc,
                                             master_addr=self.master_addr, port=self.port, token=self.token,
                                             timeout_s=rendezvous_timeout(), most=launch.max_nodes,
                                             suspect_s=suspect_s)
        except RuntimeError as e:
            say(str(e))
            return 1
        rdzv.begin(0)
        rdzv.close()  # its heartbeats to node 0's store: the council's beats judge the nodes from now on
        if rdzv.node == 0 and launch.nnodes == 2:
            say("--on-failure continue with 2 nodes: a worker's death is survived, a node's loss is not (neither "
                "node alone is a majority); use 3 or more nodes to survive one"
                + (", or let a spare join first" if launch.max_nodes > 2 else ""))
        try:
            slot = NodeSlot.static(launch, self.port, self.master_addr)
            if launch.spare:
                entry = self._admitted(self.council)
                if entry is None:
                    return 0 if self.council.entry.succeeded and self.council.role is not Role.STOPPED else 1
                slot = NodeSlot.spare(launch, entry.store)
            outcome = self._round(0, 0, slot, None)
        finally:
            self.council.close()
            if served is not None:
                served.close()
        return 0 if outcome is None else 1

    def _admitted(self, council: Council) -> Entry | None:
        """A spare node: wait until the job's nodes make it a voting node; the entry that did (None: it was not,
        said why)."""
        node = council.node
        say(f"spare node {node}: joining the running job; the nodes' majority admits it")
        entry = council.wait_admitted(rendezvous_timeout())
        if entry is not None:
            say(f"spare node {node} admitted: {len(entry.nodes)} voting nodes; its {self.launch.nproc} worker(s) "
                "join at a step boundary with the training state from a peer")
        elif council.role is Role.STOPPED:
            say(council.stop_reason)
        elif council.entry.succeeded:
            say(f"spare node {node}: the job's training ended before it was admitted; nothing left to do")
        else:
            say(f"spare node {node}: not admitted within {rendezvous_timeout():g} s")
        return entry

    def elastic_rounds(self) -> int:
        """Dynamic rendezvous: each round's nodes agree on ranks; failures and arrivals form the next round."""
        launch, rdzv = self.launch, self.rdzv
        max_restarts = launch.config.max_restarts
        assert isinstance(rdzv, DynamicRendezvous)
        round_ = rdzv.current_round()
        while True:
            try:
                formed = rdzv.join(round_)
            except RendezvousClosed as e:
                say(str(e))
                return 0 if e.ok else 1
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - the store is gone with the node serving it
                say(rdzv.store_lost(e).describe())
                return 1
            round_, slot = formed.number, formed.slot
            say(f"rendezvous round {round_}: node {slot.node_rank} of {slot.nnodes} ("
                + ", ".join(f"{n['addr']} x{n['nproc']}" for n in formed.nodes)
                + f"), ranks {slot.rank_base}..{slot.rank_base + launch.nproc - 1} of {slot.world_size}"
                + (f", after {formed.restarts} restart(s)" if formed.restarts else ""))

            def watch(r: int = round_) -> RemoteFailure | str | None:
                try:
                    change = rdzv.membership_change(r)
                except Exception as e:  # noqa: BLE001 - the store is gone
                    return rdzv.store_lost(e)
                return change or rdzv.watch(r)

            outcome = self._round(round_, formed.restarts, slot, watch)
            if outcome is None:
                return self._succeeded(round_)
            if isinstance(outcome, str):
                say(f"membership change: {outcome}; stopped this node's workers to form rendezvous round "
                    f"{round_ + 1} (not counted as a restart)")
            elif isinstance(outcome, RemoteFailure) and outcome.node < 0:
                return 1  # the store is gone: no next round can form
            elif formed.restarts >= max_restarts:
                rdzv.finish(round_, ok=False)
                return 1
            else:
                say(f"restarting with the nodes still here (restart {formed.restarts + 1} of {max_restarts}), "
                    f"rendezvous round {round_ + 1}")
            round_ += 1


def check_rendezvous(launch: LaunchSettings, port: int) -> None:
    """Fail fast on a master address that does not resolve or a busy port on node 0.

    Raises:
        ConfigError: with the offending value and the fix.
    """
    try:
        socket.getaddrinfo(launch.master_addr, port)
    except socket.gaierror as e:
        raise ConfigError(
            f"--master-addr {launch.master_addr!r} does not resolve ({e.strerror}): "
            "use a host name or IP address of node 0"
        ) from None
    if not launch.hosts_rendezvous:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR as the store itself uses: a port in TIME_WAIT is fine,
        # only a live listener makes the bind fail.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as e:
            raise ConfigError(
                f"--master-port {port} is busy on this node ({e.strerror}): choose a free port, "
                "or use --standalone to pick one"
            ) from None


_PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "connectFullMesh")


def _share(rdzv: NodeRendezvous, attempt: int, node: int, failure: Failure) -> RemoteFailure:
    """Tell the other nodes of this failure; return the round's first failure (maybe another node's)."""
    text = failure.traceback + "\n".join(failure.last_lines)
    if any(k in text for k in _PEER_ERRORS):
        # A broken connection is the symptom; the cause is on the node that
        # went away, which its launcher (or node 0, by its heartbeat) records.
        deadline = time.monotonic() + (rdzv.stale_s + 2 * POLL_S if rdzv.serving else 2.0)
        while time.monotonic() < deadline:
            if remote := rdzv.watch(attempt):
                return remote
            time.sleep(POLL_S)
    lines = failure.stall[:1] or (failure.traceback.splitlines() or failure.last_lines or [""])[-1:]
    mine = RemoteFailure(node, failure.rank, describe_exit(failure.exitcode), lines[0])
    try:
        return rdzv.record(attempt, mine)
    except Exception:  # noqa: BLE001 - node 0 unreachable: the others learn it from its silence
        return rdzv.watch(attempt) or mine

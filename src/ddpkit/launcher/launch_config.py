"""What the user typed to ``ddpkit launch``: one typed dataclass shared by the command line and the API.

:class:`LaunchConfig` holds the flags as given (``--nproc-per-node auto``,
``--nnodes 1:4``) and checks, in ``__post_init__``, every rule that needs
nothing but the values themselves. What is derived from them, with the
environment, the file system and (for ``gpu``/``auto``) torch, is
:class:`ddpkit.launcher.settings.LaunchSettings`, made by
:func:`ddpkit.launcher.settings.resolve` before any worker starts.
"""

from __future__ import annotations

import math
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from ddpkit.runtime.discovery import DEFAULT_PORT, LOOPBACK
from ddpkit.runtime.options import ConfigError, option

ENDPOINT_PORT = 29400
"""torchrun's default port for ``--rdzv-endpoint``."""
SHUTDOWN_TIMEOUT_S = 30.0
"""torchrun's grace between SIGTERM and SIGKILL: time for a worker's SIGTERM handler to save a checkpoint."""

RDZV_CONF = {
    # key: (default, converter); torchrun's c10d and dynamic rendezvous settings.
    "join_timeout": (600.0, float),
    "timeout": (600.0, float),
    "last_call_timeout": (30.0, float),
    "read_timeout": (60.0, float),
    "keep_alive_interval": (1.0, float),
    "keep_alive_max_attempt": (6, int),
    "is_host": (None, lambda v: {**dict.fromkeys(("1", "true", "t", "yes", "y"), True),
                                 **dict.fromkeys(("0", "false", "f", "no", "n"), False)}[v.lower()]),  # torch's
    "store_type": ("tcp", str),
}
"""``--rdzv-conf`` keys ddpkit reads, with their defaults."""

STD = {0: (), 1: ("stdout",), 2: ("stderr",), 3: ("stdout", "stderr")}
"""``--redirects``/``--tee`` values: which streams."""


def parse_std(value: str, nproc: int, flag: str) -> dict[int, tuple[str, ...]]:
    """``3`` or ``0:1,1:3`` as torchrun reads them: the streams of each local rank.

    Raises:
        ConfigError: a value outside 0-3, a malformed map, or a local rank outside this node.
    """
    def streams(v: str) -> tuple[str, ...]:
        if not v.strip().isdigit() or int(v) not in STD:
            raise ConfigError(f"{flag} {value!r}: {v!r} is not 0 (none), 1 (stdout), 2 (stderr) or 3 (both)")
        return STD[int(v)]

    if ":" not in value:
        return dict.fromkeys(range(nproc), streams(value))
    out = dict.fromkeys(range(nproc), ())
    for part in value.split(","):
        rank, sep, v = part.partition(":")
        if not sep or not rank.strip().isdigit():
            raise ConfigError(f"{flag} {value!r}: write one value (0-3) or LOCAL_RANK:VALUE pairs like 0:1,1:3")
        if int(rank) >= nproc:
            raise ConfigError(f"{flag} {value!r}: local rank {rank} does not exist on this node (0..{nproc - 1})")
        out[int(rank)] = streams(v)
    return out


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``HOST[:PORT]`` (``[v6]:PORT`` too) as torchrun reads ``--rdzv-endpoint``."""
    host, port = endpoint.strip(), str(default_port)
    if host.startswith("["):
        host, _, rest = host[1:].partition("]")
        if rest.startswith(":"):
            port = rest[1:]
    elif host.count(":") == 1:
        host, port = host.split(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r} is not HOST[:PORT] with a port in 0..65535")
    return host, int(port)


@dataclass(kw_only=True)
class LaunchConfig:
    """Everything ``ddpkit launch`` needs to start and supervise one node's workers."""

    program: str = option(help="the training script (or module name with -m)", positional=True)
    args: list[str] = option(
        help="arguments for the script", factory=list, positional=True, nargs="...", metavar="args"
    )
    module: bool = option(False, "run PROGRAM as a module, like python -m", flags=["-m", "--module"])
    nproc_per_node: int | str = option(
        1, "workers on this node: an integer, cpu (one per core), gpu (one per GPU) or auto (per GPU, else per "
        "core), as torchrun", metavar="N|cpu|gpu|auto"
    )
    nnodes: int | str = option(
        1, "number of nodes (one launcher per node), or MIN:MAX for an elastic job (needs --rdzv-backend c10d; "
        "under --on-failure continue: MIN nodes start the job, nodes MIN..MAX-1 are spares that join it running)",
        metavar="N|MIN:MAX",
    )
    node_rank: int = option(0, "this node's index in 0..nnodes-1 (static rendezvous); node 0 hosts the rendezvous")
    master_addr: str = option(LOOPBACK, "node 0's address, where the rendezvous store is served (static rendezvous)")
    master_port: int | None = option(None, f"rendezvous port on node 0 (default: {DEFAULT_PORT})")
    standalone: bool = option(False, "single node: pick a free port, rendezvous on loopback")
    max_restarts: int = option(0, "restart the whole group up to this many times after a failure (with "
                               "--on-failure continue: start up to this many replacements, which join live)")
    on_failure: str = option(
        "restart", "what a worker's death does: restart (stop every worker; restart them all while "
        "--max-restarts allows) or continue (the survivors go on in the same processes, the job's membership "
        "changes; see ddpkit.FaultTolerance; across --nnodes N the launchers decide each membership by "
        "majority)", choices=["restart", "continue"],
    )
    rdzv_backend: str = option(
        "static", "static (node ranks from --node-rank) or c10d (nodes agree on ranks and world size at "
        "--rdzv-endpoint; elastic with --nnodes MIN:MAX)", metavar="static|c10d",
    )
    rdzv_endpoint: str = option(
        "", f"HOST[:PORT] of the rendezvous (default port {ENDPOINT_PORT}); the node whose address it is "
        "serves it. With static: replaces --master-addr/--master-port", metavar="HOST[:PORT]",
    )
    rdzv_id: str | None = option(
        None, "the job's name (torchrun's run id), the same on every node; not its secret, which any process "
        "list shows no more: see --job-secret-file", metavar="ID",
    )
    job_secret_file: Path | None = option(
        None, "a file holding the job's secret (at least 32 characters: 128 bits as hex), the same on every "
        "node; default DDPKIT_JOB_TOKEN, else a random one for a single-node job. A job across nodes needs one: "
        "only processes that hold it join the job", metavar="FILE",
    )
    rdzv_conf: str = option(
        "", "rendezvous settings key=value,...: join_timeout (600 s), last_call_timeout (30 s), read_timeout "
        "(60 s), keep_alive_interval (1 s), keep_alive_max_attempt (6), is_host", metavar="K=V,...",
    )
    local_addr: str | None = option(
        None, "this node's address as the other nodes see it (default: its host name)", metavar="ADDR"
    )
    local_rank_arg: bool = option(
        False, "also pass --local_rank=N to the script (torch.distributed.launch style)"
    )
    prefix_output: bool = option(
        False, "prefix each worker output line on the console with [rankN]: (torchrun prints lines as they are)",
        negate="--no-prefix",
    )
    log_dir: Path | None = option(
        None, "save each rank's output to LOG_DIR/attempt_K/rankN.log (and the console); with --tee or "
        "--redirects, torchrun's layout LOG_DIR/RUN_ID_xxxx/attempt_K/LOCAL_RANK/stdout.log, stderr.log"
    )
    redirects: str = option(
        "0", "send worker streams to files in the log directory instead of the console: 0 none, 1 stdout, "
        "2 stderr, 3 both, or per local rank as 0:1,1:3", flags=["-r", "--redirects"], metavar="STD",
    )
    tee: str = option(
        "0", "like --redirects, but also to the console (those lines prefixed [ROLE LOCAL_RANK]:, as torchrun)",
        flags=["-t", "--tee"], metavar="STD",
    )
    local_ranks_filter: str = option(
        "", "show only these local ranks' output on the console, e.g. 0 or 0,1 (files keep everything)",
        metavar="RANKS",
    )
    duplicate_stdout_filters: str = option(
        "", "also copy stdout lines containing any of these words (comma-separated) to "
        "filtered_stdout.log in the attempt's log directory", metavar="WORDS",
    )
    duplicate_stderr_filters: str = option(
        "", "the same for stderr lines (filtered_stderr.log)", metavar="WORDS"
    )
    no_python: bool = option(False, "run PROGRAM directly, not with python (a binary or a script with a shebang)")
    role: str = option("default", "the workers' role (ROLE_NAME), as torchrun")
    grace_period_s: float | None = option(
        None, "seconds between SIGTERM and SIGKILL when workers are stopped (default: "
        f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else {SHUTDOWN_TIMEOUT_S:g}, as torchrun)",
        flags=["--shutdown-timeout", "--shutdown_timeout"], metavar="SECONDS",
    )
    signals_to_handle: str = option(
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "signals the launcher forwards to every worker before it stops them "
        "(add SIGUSR1,SIGUSR2 for SLURM)", metavar="SIGNALS",
    )
    virtual_local_rank: bool = option(
        False, "give every worker LOCAL_RANK=0 and only its own GPU in CUDA_VISIBLE_DEVICES"
    )
    run_path: bool = option(
        False, "accepted for torchrun's command lines; every worker runs the script as __main__, as "
        "runpy.run_path does"
    )
    numa_binding: str | None = option(
        None, "accepted for torchrun's command lines; ddpkit does not bind workers to NUMA nodes",
        choices=["node", "socket", "exclusive", "core-complex"],
    )
    logs_specs: str | None = option(
        None, "accepted for torchrun's command lines; ddpkit has no log plugins (see --log-dir, --tee)",
        metavar="NAME",
    )
    event_log_handler: str = option(
        "null", "accepted for torchrun's command lines; ddpkit writes no event log", metavar="NAME"
    )
    monitor_interval: float = option(
        0.1, "accepted for torchrun's command lines; ddpkit learns of a worker's exit the moment it happens"
    )
    start_method: str = option(
        "spawn", "accepted for torchrun's command lines; every worker is a new process running PROGRAM",
        choices=["spawn", "fork", "forkserver"],
    )
    num_servers: int = option(
        0, "parameter server processes to start on node 0 beside the workers (python -m ddpkit.parallel.ps.server: "
        "ddpkit.ParameterServerOptimizer, ddpkit train --strategy ps-sync|ps-async); their channel listens on "
        "a free port on one node, MASTER_PORT + 1 across nodes, unless DDPKIT_PS_PORT says; they stop when every "
        "worker has finished", metavar="K",
    )
    ps_replication: int = option(
        1, "on how many parameter servers each key range of the parameters lives (chain replication): with R, "
        "the job survives R - 1 servers' deaths losing no update a worker was answered for (see "
        "ddpkit.parallel.ps.keyrange); at most --num-servers", metavar="R",
    )
    backend: str | None = option(
        None, "the workers' backend (sets DDPKIT_BACKEND): gloo, nccl, or mpi, whose workers mpirun starts as one "
        "MPI job on this node (default: DDPKIT_BACKEND, else the workers' own choice)", metavar="gloo|nccl|mpi",
    )
    python: str = option(sys.executable, "interpreter that runs the workers", cli=False)
    preload: tuple[str, ...] = option(
        (), "modules imported once, in a server the workers of a -m program are forked from (see "
        "ddpkit.runtime.preloaded): ddpkit train's own workers and servers, never a user's program", cli=False,
    )

    def __post_init__(self) -> None:
        # Every rule that needs nothing but the values; the rest is resolve()'s (settings.py).
        text = str(self.nproc_per_node).strip()
        if text.lstrip("-").isdigit():
            if int(text) < 1:
                raise ConfigError(f"--nproc-per-node {text} must be at least 1 (or cpu, gpu, auto)")
        elif text not in ("cpu", "gpu", "auto"):
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node!r} is not a number: use a positive integer, "
                              "cpu, gpu or auto")
        low, high = node_range(self.nnodes)
        if self.num_servers < 0:
            raise ConfigError(f"--num-servers {self.num_servers} must be 0 (none) or more")
        if self.ps_replication < 1 or (self.num_servers and self.ps_replication > self.num_servers):
            raise ConfigError(f"--ps-replication {self.ps_replication} must be between 1 and --num-servers "
                              f"{self.num_servers}: a key range lives on at most every server")
        if self.ps_replication > 1 and not self.num_servers:
            raise ConfigError(f"--ps-replication {self.ps_replication} without --num-servers: there are no "
                              "parameter servers to replicate; add --num-servers K (K >= R)")
        if self.num_servers and low != high:
            raise ConfigError(f"--num-servers {self.num_servers} does not fit an elastic --nnodes {self.nnodes}: the "
                              "servers hold one world's state; give a fixed number of nodes")
        if self.rdzv_backend not in ("static", "c10d"):
            raise ConfigError(f"--rdzv-backend {self.rdzv_backend!r} is not supported: use c10d (nodes agree on "
                              "their ranks at --rdzv-endpoint) or static (--node-rank on each node)")
        rendezvous_conf(self.rdzv_conf)
        if self.rdzv_backend == "c10d" and not self.standalone:
            if not self.rdzv_endpoint:
                raise ConfigError("--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT], the same on every node")
            parse_endpoint(self.rdzv_endpoint, ENDPOINT_PORT)
        elif low != high and not self.standalone and self.on_failure != "continue":
            raise ConfigError(f"--nnodes {self.nnodes} is a range, which needs the nodes to agree on their ranks: "
                              "add --rdzv-backend c10d --rdzv-endpoint HOST[:PORT]")
        elif self.rdzv_endpoint and not self.standalone:
            parse_endpoint(self.rdzv_endpoint, ENDPOINT_PORT)
        signal_numbers(self.signals_to_handle)
        dynamic = self.rdzv_backend == "c10d" and not self.standalone
        if not dynamic and not 0 <= self.node_rank < high:
            raise ConfigError(f"--node-rank {self.node_rank} is out of range for --nnodes {high}: use 0..{high - 1}")
        self._check_numbers()
        if self.standalone and low != 1:
            raise ConfigError(f"--standalone runs this node alone, but --nnodes {self.nnodes} needs at least {low} "
                              "nodes, which could never join a rendezvous on this host's loopback: drop --standalone "
                              "and give --rdzv-backend c10d --rdzv-endpoint HOST[:PORT] on every node")
        if self.rdzv_id is not None and not self.rdzv_id.strip():
            raise ConfigError("--rdzv-id is empty: give the job an id (the same on every node), or leave it out")
        if self.job_secret_file is not None:
            self.job_secret_file = Path(self.job_secret_file)
            if not self.job_secret_file.is_file():
                raise ConfigError(f"--job-secret-file {self.job_secret_file}: no such file (write the secret there "
                                  "first, e.g. python3 -c 'import secrets; print(secrets.token_hex(16))' > FILE)")
        if self.no_python and self.module and not self.run_path:
            raise ConfigError("--no-python and -m cannot go together: -m runs a module with python")
        if not self.role.strip():
            raise ConfigError("--role is empty: give the workers' role a name (default: default)")
        self._check_backend(low, high)
        self._check_on_failure(high)

    def _check_on_failure(self, high: int) -> None:
        if self.on_failure != "continue":
            return
        if high != 1 and self.rdzv_backend == "c10d":
            raise ConfigError(f"--on-failure continue with --nnodes {self.nnodes} and --rdzv-backend c10d: across "
                              "nodes the mode's launchers decide each membership by majority among themselves; give "
                              "--rdzv-backend static (the default) with --node-rank on each node (with MIN:MAX, "
                              "nodes 0..MIN-1 start the job and nodes MIN..MAX-1 join it as spares)")
        if high != 1 and self.num_servers:
            raise ConfigError(f"--on-failure continue with --num-servers {self.num_servers} and --nnodes "
                              f"{self.nnodes}: the parameter servers survive deaths on one node only (they all "
                              "run on node 0); use one node, or --on-failure restart")
        if self.num_servers and self.max_restarts:
            raise ConfigError(f"--on-failure continue with --num-servers {self.num_servers} and --max-restarts "
                              f"{self.max_restarts}: a replacement cannot take a seat in the parameter servers' "
                              "channel, which its members build once; drop --max-restarts (the workers left go on)")

    def _check_backend(self, low: int, high: int) -> None:
        if self.backend is None:
            return
        self.backend = self.backend.strip().lower()
        if self.backend not in ("gloo", "nccl", "mpi"):
            raise ConfigError(f"--backend {self.backend!r} is not a backend: choose gloo, nccl or mpi")
        if self.backend == "mpi" and high != 1:
            raise ConfigError(
                f"--backend mpi with --nnodes {self.nnodes}: ddpkit launch starts one MPI job on this node; for "
                "several nodes start the job with MPI's launcher itself (mpirun --host A,B -np N python script.py): "
                "ddpkit.init(backend='mpi') meets over MPI, with no rendezvous to configure"
            )

    def _check_numbers(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts} must be 0 or more")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port {self.master_port} is not a TCP port: use 1..65535")
        if self.grace_period_s is not None and not 0 <= self.grace_period_s < math.inf:
            raise ConfigError(f"--shutdown-timeout {self.grace_period_s} must be a finite number of seconds, 0 or more")
        if not 0 < self.monitor_interval < math.inf:
            raise ConfigError(f"--monitor-interval {self.monitor_interval} must be a positive, finite number of "
                              "seconds")


def node_range(nnodes: int | str) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` as ``(MIN, MAX)``.

    Raises:
        ConfigError: not a number, or not 1 <= MIN <= MAX.
    """
    text = str(nnodes)
    low, sep, high = text.partition(":")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        raise ConfigError(f"--nnodes {text!r} is not a number of nodes: use N or MIN:MAX") from None
    if lo < 1 or hi < lo:
        raise ConfigError(f"--nnodes {text} must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX (e.g. 2 or 1:4)")
    return lo, hi


MIN_SILENCE_S = 0.5
"""The shortest time a node may go unheard before the others judge it gone (``keep_alive_interval`` x
``keep_alive_max_attempt``): five of the council's beats of 0.1 s."""


def rendezvous_conf(text: str) -> tuple[dict[str, object], list[str]]:
    """``--rdzv-conf key=value,...`` with torchrun's defaults filled in, and the keys ddpkit does not read.

    Raises:
        ConfigError: a malformed pair, a bad value, or a store type other than tcp.
    """
    conf = {key: default for key, (default, _) in RDZV_CONF.items()}
    unknown: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"--rdzv-conf {text!r}: {part!r} is not KEY=VALUE")
        if key not in RDZV_CONF:
            unknown.append(key)
            continue
        try:
            conf[key] = RDZV_CONF[key][1](value.strip())
        except (KeyError, ValueError):
            raise ConfigError(f"--rdzv-conf {key}={value!r} is not a valid value for {key}") from None
    if "timeout" in text and "join_timeout" not in text:
        conf["join_timeout"] = conf["timeout"]  # torchrun's older name
    if conf["store_type"] != "tcp":
        raise ConfigError(f"--rdzv-conf store_type={conf['store_type']}: ddpkit's rendezvous is a TCP store; "
                          "leave store_type out")
    for key in ("join_timeout", "last_call_timeout", "read_timeout", "keep_alive_interval"):
        if not 0 < conf[key] < math.inf:  # type: ignore[operator]
            raise ConfigError(f"--rdzv-conf {key}={conf[key]} must be a positive, finite number of seconds")
    if conf["keep_alive_max_attempt"] < 1:  # type: ignore[operator]
        raise ConfigError(f"--rdzv-conf keep_alive_max_attempt={conf['keep_alive_max_attempt']} must be 1 or more")
    silent = conf["keep_alive_interval"] * conf["keep_alive_max_attempt"]  # type: ignore[operator]
    if silent < MIN_SILENCE_S:
        raise ConfigError(f"--rdzv-conf keep_alive_interval={conf['keep_alive_interval']} x keep_alive_max_attempt="
                          f"{conf['keep_alive_max_attempt']} = {silent:g} s: a node is judged gone after that "
                          f"long unheard, which must be at least {MIN_SILENCE_S:g} s (the launchers speak every "
                          "0.1 s); the default is 1 x 6 = 6 s")
    return conf, unknown


def signal_numbers(names: str) -> tuple[int, ...]:
    """``--signals-to-handle SIGTERM,SIGINT,...`` as signal numbers.

    Raises:
        ConfigError: a name that is no signal, or one the launcher cannot catch.
    """
    found = []
    for name in filter(None, (n.strip().upper() for n in names.split(","))):
        sig = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
        if not isinstance(sig, signal.Signals) or sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise ConfigError(f"--signals-to-handle {names!r}: {name!r} is not a signal the "
                              "launcher can catch (e.g. SIGTERM,SIGINT,SIGUSR1)")
        found.append(int(sig))
    return tuple(found)

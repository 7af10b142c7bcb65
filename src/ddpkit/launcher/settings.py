"""What a launch is, derived from what was typed: the values the launcher runs with.

:func:`resolve` turns a :class:`~ddpkit.launcher.launch_config.LaunchConfig` into
:class:`LaunchSettings` before any worker starts. It is where the input meets
the machine: ``--nproc-per-node cpu|gpu|auto`` is counted (``gpu`` and
``auto`` import torch to count GPUs, torchrun's rule), the program is looked
for (a script, a module on ``sys.path`` as ``python -m`` would see it, or a
command on ``PATH``), ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` is read, and the
implied settings are made explicit (one node with no port or endpoint runs
as ``--standalone``; a static ``--rdzv-endpoint`` is node 0's address and
port; ``--run-path`` wins over ``--no-python``, as in torchrun).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ddpkit.launcher.launch_config import (
    ENDPOINT_PORT,
    RDZV_CONF,
    SHUTDOWN_TIMEOUT_S,
    LaunchConfig,
    node_range,
    parse_endpoint,
    parse_std,
    rendezvous_conf,
    signal_numbers,
)
from ddpkit.runtime.discovery import DEFAULT_PORT, LOOPBACK
from ddpkit.runtime.options import ConfigError

__all__ = ["LaunchSettings", "nproc_for", "resolve"]


@dataclass(frozen=True, kw_only=True)
class LaunchSettings:
    """A launch as it runs: the config as typed, and every value derived from it (see the module notes)."""

    config: LaunchConfig
    nproc: int
    """Workers on this node."""
    nnodes: int
    """Nodes in the job (the most, for an elastic range; under ``--on-failure continue`` the nodes that start it,
    MIN: nodes MIN..MAX-1 are spares)."""
    min_nodes: int
    max_nodes: int
    standalone: bool
    """One node, a free port, the rendezvous on this host (given, or implied)."""
    master_addr: str
    master_port: int | None
    endpoint: tuple[str, int] | None
    """``--rdzv-endpoint`` as host and port, under ``--rdzv-backend c10d``."""
    conf: dict[str, object]
    """``--rdzv-conf`` with torchrun's defaults."""
    unknown_conf: list[str]
    redirect_map: dict[int, tuple[str, ...]]
    tee_map: dict[int, tuple[str, ...]]
    shown_ranks: set[int] | None
    signals: tuple[int, ...]
    grace_period_s: float
    no_python: bool

    @property
    def dynamic(self) -> bool:
        """Nodes agree on their ranks at a rendezvous endpoint (``--rdzv-backend c10d``)."""
        return self.config.rdzv_backend == "c10d" and not self.standalone

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes

    @property
    def spare(self) -> bool:
        """Under ``--on-failure continue``: this node is not one of the MIN that start the job; it joins it."""
        return self.config.on_failure == "continue" and self.config.node_rank >= self.nnodes

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def hosts_rendezvous(self) -> bool:
        """Node 0's rank 0 serves the store, so this launcher must find its port free."""
        return self.config.node_rank == 0

    def port(self) -> int:
        return self.master_port if self.master_port is not None else DEFAULT_PORT

    def keep_alive(self) -> tuple[float, float]:
        """``--rdzv-conf``'s keep-alive: a heartbeat every ``keep_alive_interval`` seconds, and a node not heard for
        that times ``keep_alive_max_attempt`` judged gone (1 s and 6 s by default)."""
        beat = float(self.conf["keep_alive_interval"])  # type: ignore[arg-type]
        return beat, beat * int(self.conf["keep_alive_max_attempt"])  # type: ignore[call-overload]

    def join_timeout_s(self, default: float) -> float:
        """How long a static job's launchers wait for node 0's store: ``--rdzv-conf join_timeout`` (or its older
        name ``timeout``, which torchrun's static rendezvous reads) where given, else ``default``."""
        given = {part.partition("=")[0].strip() for part in self.config.rdzv_conf.split(",")}
        return float(self.conf["join_timeout"]) if given & {"join_timeout", "timeout"} else default  # type: ignore

    def notes(self) -> list[str]:
        """One line for each torchrun flag given here that changes nothing in ddpkit."""
        cfg = self.config
        notes = []
        if self.standalone and node_range(cfg.nnodes)[1] > 1:
            notes.append(f"--standalone --nnodes {cfg.nnodes}: no other node can reach a standalone rendezvous, so "
                         "this node runs alone, at once (torchrun first waits its last-call timeout, 30 s, "
                         "for nodes that cannot come)")
        if self.standalone and (cfg.rdzv_endpoint or cfg.rdzv_backend != "static"):
            notes.append("--standalone: --rdzv-backend and --rdzv-endpoint are ignored, as torchrun ignores them")
        if self.dynamic and cfg.node_rank:
            notes.append(f"--node-rank {cfg.node_rank}: ignored with --rdzv-backend c10d, where the nodes agree "
                         "on their ranks at the rendezvous (as torchrun)")
        if self.unknown_conf:
            notes.append(f"--rdzv-conf: {', '.join(self.unknown_conf)} not used by ddpkit's rendezvous "
                         f"(it reads {', '.join(k for k in RDZV_CONF if k != 'timeout')})")
        if cfg.run_path:
            notes.append("--run-path: each worker runs the script as __main__ in its own interpreter, which is "
                         "what runpy.run_path gives torchrun's workers")
        if cfg.numa_binding:
            notes.append(f"--numa-binding {cfg.numa_binding}: not done by ddpkit; workers run where the OS puts "
                         "them (bind them yourself with numactl and --no-python)")
        if cfg.logs_specs:
            notes.append(f"--logs-specs {cfg.logs_specs}: ddpkit has no log plugins; --log-dir, --tee and "
                         "--redirects choose where output goes")
        if cfg.event_log_handler != "null":
            notes.append(f"--event-log-handler {cfg.event_log_handler}: ddpkit writes no event log")
        if cfg.monitor_interval != 0.1:
            notes.append(f"--monitor-interval {cfg.monitor_interval:g}: not needed, ddpkit learns of a worker's "
                         "exit the moment it happens")
        if cfg.start_method != "spawn":
            notes.append(f"--start-method {cfg.start_method}: every worker is a new process running the program "
                         "(torchrun's start method matters only for function entry points)")
        return notes


def resolve(cfg: LaunchConfig, environ: Mapping[str, str] | None = None) -> LaunchSettings:
    """The settings of ``cfg`` on this machine (see the module notes).

    Args:
        environ: the environment to read (default ``os.environ``).

    Raises:
        ConfigError: ``--nproc-per-node gpu`` without CUDA; a program that
            cannot be found; a bad ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; a log
            directory that is a file; a local rank outside this node.
    """
    environ = os.environ if environ is None else environ
    text = str(cfg.nproc_per_node).strip()
    nproc = int(text) if text.isdigit() else nproc_for(text)
    min_nodes, max_nodes = node_range(cfg.nnodes)
    conf, unknown = rendezvous_conf(cfg.rdzv_conf)
    standalone, master_addr, master_port, endpoint = cfg.standalone, cfg.master_addr, cfg.master_port, None
    if cfg.rdzv_backend == "c10d" and not standalone:
        endpoint = parse_endpoint(cfg.rdzv_endpoint, ENDPOINT_PORT)
    elif cfg.rdzv_endpoint and not standalone:
        # torchrun's static backend: the endpoint is node 0's address and port.
        master_addr, master_port = parse_endpoint(cfg.rdzv_endpoint, ENDPOINT_PORT)
    elif max_nodes == 1 and master_port is None and not standalone:
        # torch 2.13's torchrun: one node with no port and no endpoint given runs as --standalone (a free port, a
        # fresh run id), so two such jobs on a machine do not fight over port 29500.
        standalone = True
    if standalone:
        # torchrun's --standalone is a c10d rendezvous on localhost at a free port: no other node can reach it,
        # so an elastic --nnodes 1:MAX runs this node alone (see notes()).
        master_addr, min_nodes, max_nodes = LOOPBACK, 1, 1
    if cfg.log_dir is not None and Path(cfg.log_dir).is_file():
        raise ConfigError(f"--log-dir {str(cfg.log_dir)!r} is a file: give a directory")
    no_python = cfg.no_python and not cfg.run_path  # torchrun: --run-path takes precedence over --no-python
    _check_program(cfg, no_python)
    # --on-failure continue: MIN nodes start the job (its world); the others join it running, as spares.
    starting = min_nodes if cfg.on_failure == "continue" else max_nodes
    return LaunchSettings(
        config=cfg, nproc=nproc, nnodes=starting, min_nodes=min_nodes, max_nodes=max_nodes, standalone=standalone,
        master_addr=master_addr, master_port=master_port, endpoint=endpoint, conf=conf, unknown_conf=unknown,
        redirect_map=parse_std(cfg.redirects, nproc, "--redirects"), tee_map=parse_std(cfg.tee, nproc, "--tee"),
        shown_ranks=_shown_ranks(cfg.local_ranks_filter, nproc), signals=signal_numbers(cfg.signals_to_handle),
        grace_period_s=_grace(cfg.grace_period_s, environ), no_python=no_python,
    )


def nproc_for(kind: str) -> int:
    """Workers for ``--nproc-per-node cpu|gpu|auto``, as torchrun counts them.

    ``cpu``: one per CPU core this process may use; ``gpu``: one per visible
    GPU (an error without CUDA); ``auto``: one per GPU, else one per core.

    Raises:
        ConfigError: ``gpu`` without CUDA, or another word.
    """
    if kind == "cpu":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if kind not in ("gpu", "auto"):
        raise ConfigError(f"--nproc-per-node {kind!r} is not a number: use a positive integer, cpu, gpu or auto")
    import torch  # only here: the launcher itself needs no torch otherwise

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    if kind == "gpu":
        raise ConfigError("--nproc-per-node gpu: CUDA is not available here; use a number, cpu or auto")
    return nproc_for("cpu")


def _grace(given: float | None, environ: Mapping[str, str]) -> float:
    """torchrun's grace between SIGTERM and SIGKILL: the flag, else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30 s."""
    if given is not None:
        return given
    raw = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "")
    try:
        value = float(raw) if raw.strip() else SHUTDOWN_TIMEOUT_S
    except ValueError:
        raise ConfigError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={raw!r} is not a number of seconds "
                          "(the grace between SIGTERM and SIGKILL): unset it or give e.g. 30") from None
    if value < 0:
        raise ConfigError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={raw!r} must be 0 or more seconds")
    return value


def _shown_ranks(text: str, nproc: int) -> set[int] | None:
    if not text.strip():
        return None
    try:
        shown = {int(r) for r in text.split(",")}
    except ValueError:
        raise ConfigError(f"--local-ranks-filter {text!r}: list local ranks like 0 or 0,1,2") from None
    if outside := sorted(r for r in shown if not 0 <= r < nproc):
        raise ConfigError(f"--local-ranks-filter {text!r}: local rank(s) {outside} do not exist "
                          f"on this node (0..{nproc - 1})")
    return shown


def _module_exists(name: str) -> bool:
    """Whether ``python -m name`` finds the module, without importing anything of it where it can: ``find_spec``
    of a dotted name imports its parent packages (their ``__init__`` would run in the launcher, without the
    workers' environment); here the top-level name goes through the import system's finders, which locate it
    without running it, and each part after it is looked for in its package's folders."""
    parts = name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
        for i in range(1, len(parts)):
            if spec is None or not spec.submodule_search_locations:
                spec = None  # (a module, not a package: nothing below it)
                break
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]),
                                                            list(spec.submodule_search_locations))
        if spec is not None:
            return True
        # Not in its packages' folders: a package that extends its path when imported (pkgutil's namespaces), or
        # an importer on sys.meta_path alone (a frozen bundle). Only then is the package imported to look.
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _check_program(cfg: LaunchConfig, no_python: bool) -> None:
    if no_python:
        program = cfg.program
        # As the workers are started (exec, as a shell): a name with a slash is a path, any other a command on PATH.
        found = shutil.which(program) if os.sep not in program else program if Path(program).is_file() else None
        if found is None and os.sep not in program and Path(program).is_file():
            raise ConfigError(f"--no-python: {program!r} is in {os.getcwd()} but not a command on PATH: give "
                              f"./{program}, as a shell takes it")
        if found is None:
            raise ConfigError(f"--no-python: {program!r} is neither a file nor a command on PATH")
        if not os.access(found, os.X_OK):
            raise ConfigError(f"--no-python: {found!r} is not executable: chmod +x {found} (with a #! line), or "
                              "drop --no-python to run it with python")
        return
    if cfg.module:
        # Workers run `python -m`, which puts the working directory first on sys.path.
        sys.path.insert(0, os.getcwd())
        try:
            found = _module_exists(cfg.program)
        finally:
            sys.path.pop(0)
        if not found:
            raise ConfigError(f"module {cfg.program!r} cannot be found: check the name and PYTHONPATH")
    elif not (Path(cfg.program).is_file() or (Path(cfg.program) / "__main__.py").is_file()):
        # (python runs a folder or a zip archive holding a __main__.py, as torchrun's workers do)
        raise ConfigError(
            f"script {cfg.program!r} does not exist (looked in {os.getcwd()}): check the path, "
            "or pass -m to run a module"
        )

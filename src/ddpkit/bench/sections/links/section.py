"""``ddpkit bench links``: the same training across nodes joined by links of each rate, one way of keeping the
replicas together after another.

For every link rate (``--rates``; ``none`` is the unshaped veth) a
:class:`~ddpkit.bench.sections.links.testbed.Testbed` of ``--nodes`` namespaces (one
worker each) is shaped to it, and every run of ``--runs`` trains the GPT on
tiny Shakespeare there (``ddpkit launch`` on each node, ``-m ddpkit train
--model gpt --dataset shakespeare``, AdamW, equal samples per worker):

* ``ddp``: gradients averaged every step;
* ``local-sgd``: parameters averaged every ``--sync-every`` steps;
* ``diloco``: ``ddpkit.DiLoCo``, an outer step every ``--sync-every`` steps;
* ``streaming``: DiLoCo in 4 fragments, each exchange overlapping
  ``--fragment-delay`` inner steps (tau, default 5 or ``--sync-every`` - 1), the pseudo-gradients in int8;
* ``fp16``, ``powersgd``: DDP with that comm hook (PowerSGD at rank 4, from
  step 10);
* ``auto``: DDP with ``--comm-hook auto``, the reduction chosen from the
  link as the run goes (:mod:`ddpkit.comm.auto`; its decision's line is kept
  in the row).

Each row: seconds a step and symbols a second (the run's training wall time
over its steps, evaluation included), MB each rank sent a step (every
collective, from the run's own count), the validation loss per character,
and the step time of DDP at the same rate over this run's. The runs of one
rate follow each other; the rates are measured in the order given.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddpkit.bench.report.table import note_lines
from ddpkit.bench.sections.links.testbed import Testbed, TestbedError, parse_rate
from ddpkit.runtime.options import ConfigError, RunError, option, plain, writable_file
from ddpkit.train.train_config import TEXT_MODELS

__all__ = ["RUNS", "LinksBenchConfig", "Row", "TestbedError", "format_rows", "run"]

RUNS = {
    "ddp": lambda h, tau: [],
    "local-sgd": lambda h, tau: ["--local-sgd", str(h)],
    "diloco": lambda h, tau: ["--sync-every", str(h)],
    "diloco-int8": lambda h, tau: ["--sync-every", str(h), "--outer-codec", "int8"],
    "streaming": lambda h, tau: ["--sync-every", str(h), "--fragments", "4", "--fragment-delay", str(tau),
                                 "--outer-codec", "int8"],
    "fp16": lambda h, tau: ["--comm-hook", "fp16"],
    "powersgd": lambda h, tau: ["--comm-hook", "powersgd", "--powersgd-rank", "4"],
    "auto": lambda h, tau: ["--comm-hook", "auto"],
}
"""Each run's ``ddpkit train`` flags, given ``--sync-every`` and ``--fragment-delay``."""
GPT_SIZES = {"gpt": "0.8 M", "gpt-10m": "10.7 M", "gpt-25m": "25.3 M"}
"""Each GPT's parameters, as the table's note names them (tests/bench/test_links.py keeps it in step)."""
BLOCK = 64
"""Characters a sample of ``--dataset shakespeare``."""


@dataclass(kw_only=True)
class LinksBenchConfig:
    """What ``ddpkit bench links`` runs."""

    data_dir: Path | None = option(None, "folder of tiny Shakespeare's input.txt (e.g. ../shared/data/tinyshakespeare)")
    rates: tuple[str, ...] = option(("none", "1gbit", "100mbit"), "link rates, in bit/s ('none': unshaped)",
                                    metavar="RATE")
    runs: tuple[str, ...] = option(("ddp", "local-sgd", "diloco", "streaming"), f"runs, among {', '.join(RUNS)}",
                                   metavar="NAME")
    model: str = option("gpt", "the GPT: gpt (0.8 M parameters), gpt-10m or gpt-25m", choices=TEXT_MODELS)
    nodes: int = option(2, "nodes (namespaces), one worker each")
    sync_every: int = option(16, "H of local SGD and DiLoCo: inner steps between two exchanges")
    fragment_delay: int | None = option(None, "tau of the streaming run: inner steps each fragment's exchange "
                                           "overlaps, less than --sync-every (default 5, or --sync-every - 1 if less)")
    train_samples: int = option(2048, "training samples of 64 characters (the steps: these / (nodes x batch))")
    batch_size: int = option(32, "samples a worker takes a step")
    epochs: int = option(1, "epochs per run")
    timeout: float = option(900.0, "seconds a run may take before it counts as failed")
    json: Path | None = option(None, "write the rows as JSON here")
    progress: bool = option(True, "print a line as each run starts", negate="--no-progress", negate_only=True)

    def __post_init__(self) -> None:
        if self.data_dir is None:
            raise ConfigError("ddpkit bench links trains the GPT on tiny Shakespeare: give --data-dir "
                              "(e.g. ../shared/data/tinyshakespeare)")
        if self.model not in TEXT_MODELS:
            raise ConfigError(f"--model {self.model}: not a GPT; choose among {', '.join(TEXT_MODELS)}")
        unknown = [r for r in self.runs if r not in RUNS]
        if unknown:
            raise ConfigError(f"--runs {' '.join(unknown)}: not a run; choose among {', '.join(RUNS)}")
        for rate in self.rates:
            if rate != "none":
                try:
                    parse_rate(rate)
                except ValueError as e:
                    raise ConfigError(f"--rates: {e}") from None
        if not 2 <= self.nodes <= 8:
            raise ConfigError(f"--nodes {self.nodes} must be from 2 to 8 (one worker each, on this machine)")
        for name in ("sync_every", "train_samples", "batch_size", "epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)} must be at least 1")
        if "streaming" in self.runs and self.sync_every < 4:
            raise ConfigError(f"--sync-every {self.sync_every}: the streaming run's 4 fragments need at least 4 "
                              "(each fragment's exchange every --sync-every steps, one every --sync-every / 4)")
        if self.fragment_delay is None:
            self.fragment_delay = min(5, self.sync_every - 1)
        if isinstance(self.fragment_delay, bool) or not isinstance(self.fragment_delay, int) or (
                "streaming" in self.runs and not 0 <= self.fragment_delay < self.sync_every):
            raise ConfigError(f"--fragment-delay {self.fragment_delay!r} must be a whole number from 0 to "
                              f"--sync-every - 1 ({self.sync_every - 1})")
        if self.json is not None:
            self.json = writable_file(self.json, "--json")


@dataclass
class Row:
    """One run at one rate."""

    rate: str
    run: str
    flags: str
    step_s: float
    symbols_per_s: float
    sent_mb_per_step: float | None
    test_loss: float
    steps: int
    vs_ddp: float | None = None
    """DDP's step time at this rate over this run's (above 1: faster than DDP)."""
    chosen: str | None = None
    """``auto``: what its (last) decision chose."""


def _one(cfg: LinksBenchConfig, bed: Testbed, name: str, out: Path, port: int) -> Row:
    flags = RUNS[name](cfg.sync_every, cfg.fragment_delay)
    train = ["-m", "ddpkit", "train", "--model", cfg.model, "--dataset", "shakespeare", "--data-dir",
             str(Path(cfg.data_dir).resolve()), "--train-samples", str(cfg.train_samples), "--test-samples", "64",
             "--batch-size", str(cfg.batch_size), "--epochs", str(cfg.epochs), "--optimizer", "adamw", "--lr",
             "0.001", "--no-progress", "--checkpoint-every", "0", "--output-dir", str(out), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DDPKIT_JOB_TOKEN": secrets.token_hex(16)}
    env.pop("GLOO_SOCKET_IFNAME", None)  # each namespace has one interface: gloo finds it
    procs = [subprocess.Popen(bed.command(k, [
        sys.executable, "-m", "ddpkit", "launch", "--nnodes", str(cfg.nodes), "--node-rank", str(k),
        "--nproc-per-node", "1", "--master-addr", bed.nodes[0].address, "--master-port", str(port),
        "--rdzv-id", f"links-{name}", *train]), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k in range(cfg.nodes)]
    outs, errs = [""] * len(procs), [""] * len(procs)

    def drain(k: int) -> None:  # every node's pipes at once: one that writes much never blocks the job
        outs[k], errs[k] = procs[k].communicate()

    readers = [threading.Thread(target=drain, args=(k,), daemon=True) for k in range(len(procs))]
    try:
        for t in readers:
            t.start()
        deadline = time.monotonic() + cfg.timeout
        for t in readers:
            t.join(max(0.0, deadline - time.monotonic()))
        late = [k for k, t in enumerate(readers) if t.is_alive()]
    finally:  # a timeout, an interrupt or an error here: no launcher outlives the run
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for t in readers:
            t.join(5.0)
    where = f"run {name} at {bed.rate or 'none'}"
    if late:
        tails = "; ".join(f"node {k}: {errs[k].strip()[-800:] or '(nothing on stderr)'}" for k in late)
        raise RunError(f"{where}: node(s) {late} did not end within {cfg.timeout:g} s (--timeout): {tails}")
    errors = [f"node {k} exited {p.returncode}: {errs[k].strip()[-1500:]}" for k, p in enumerate(procs)
              if p.returncode != 0]
    if errors:
        raise RunError(f"{where} failed: " + "; ".join(errors))
    summary = json.loads((out / "summary.json").read_text())
    chosen = re.findall(r"^comm auto at step \d+: .*; chose (\S+) ", outs[0], re.MULTILINE)
    steps = int(summary["steps"])
    wall = float(summary["wall_time_s"])
    return Row(rate=bed.rate or "none", run=name, flags=" ".join(flags), step_s=wall / steps,
               symbols_per_s=steps * cfg.batch_size * cfg.nodes * BLOCK / wall,
               sent_mb_per_step=summary.get("sent_mb_per_step"), test_loss=float(summary["test_loss"]), steps=steps,
               chosen=chosen[-1] if chosen else None)


def run(cfg: LinksBenchConfig) -> list[dict[str, Any]]:
    """Run the bench (see the module notes); print the table; the rows.

    Raises:
        TestbedError: the namespaces cannot be made here (the message says why: root, iproute2).
        RunError: a run failed or outlasted ``--timeout`` (each node's last words).
    """

    def say(text: str) -> None:
        if cfg.progress:
            print(f"ddpkit bench links: {text}", file=sys.stderr, flush=True)

    rows: list[Row] = []

    def terminated(signum: int, frame: Any) -> None:  # so that the testbed is taken down on a SIGTERM too
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        with tempfile.TemporaryDirectory(prefix="ddpkit-bench-links-") as work, Testbed(cfg.nodes) as bed:
            port = 29400 + os.getpid() % 500
            for rate in cfg.rates:
                bed.shape(None if rate == "none" else rate)
                for name in cfg.runs:
                    say(f"{name} across {cfg.nodes} nodes at {rate}")
                    port += 1
                    rows.append(_one(cfg, bed, name, Path(work) / f"{rate}-{name}", port))
    finally:
        signal.signal(signal.SIGTERM, previous)
    for row in rows:
        ddp = next((r for r in rows if r.rate == row.rate and r.run == "ddp"), None)
        row.vs_ddp = None if ddp is None else ddp.step_s / row.step_s
    result = [asdict(r) for r in rows]
    print(format_rows(result, cfg))
    if cfg.json is not None:
        cfg.json.write_text(json.dumps({"config": plain(cfg), "rows": result}, indent=2) + "\n")
    return result


def format_rows(rows: list[dict[str, Any]], cfg: LinksBenchConfig) -> str:
    """The rows as a Markdown table, and what it measured."""
    lines = ["| link | run | s / step | symbols / s | MB sent / step | val loss | DDP's step / this |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        sent = "-" if r["sent_mb_per_step"] is None else f"{r['sent_mb_per_step']:.3f}"
        vs = "-" if r["vs_ddp"] is None else f"{r['vs_ddp']:.2f}"
        run = r["run"] if r.get("chosen") is None else f"{r['run']}: {r['chosen']}"
        lines.append(f"| {r['rate']} | {run} | {r['step_s']:.3f} | {r['symbols_per_s']:.0f} | {sent} | "
                     f"{r['test_loss']:.3f} | {vs} |")
    lines += [""] + note_lines(
        f"{cfg.nodes} nodes (network namespaces on one bridge, each cable shaped with tc tbf in both directions), "
        f"one worker each; the GPT --model {cfg.model} ({GPT_SIZES[cfg.model]}) on tiny Shakespeare, "
        f"{cfg.train_samples} samples of {BLOCK} characters, "
        f"batch {cfg.batch_size} a worker, AdamW, {cfg.epochs} epoch(s); --sync-every {cfg.sync_every}"
        + ("; diloco-int8: the outer gradients in int8" if "diloco-int8" in cfg.runs else "")
        + (f"; streaming: 4 fragments, tau {cfg.fragment_delay}, int8" if "streaming" in cfg.runs else "")
        + "; one run each. s / step: the training's wall time (evaluation included) over its steps.")
    return "\n".join(lines)


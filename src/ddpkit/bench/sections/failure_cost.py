"""``ddpkit bench failures``: what a worker's death costs, restart against continue, and the mode's cost without one.

For every job (``--jobs``) and world size, four ``ddpkit train`` runs, the two
modes interleaved: ``--on-failure restart`` (today: every worker restarts and
resumes from the newest checkpoint; ``--max-restarts 1``) and ``--on-failure
continue --deterministic-shards W`` (the survivors go on; ``--max-restarts 1``
starts a replacement that joins live), each once without a fault and once
with a SIGKILL to a random worker at ``--kill-at`` of the uninterrupted run's
training time (from the run's first line of training). Measured per faulted
run, from the outside and from the run's own files:

* **detect**: from the kill to the moment the job knew: continue, the first
  survivor's notice (``membership.jsonl``); restart, the line that says the
  workers restart (after the others were torn down);
* **next step**: from the kill to the first step applied after it: continue,
  the first survivor's next applied step; restart, the line where the new
  attempt resumes from its checkpoint (its first step follows);
* **joined**: continue, from the kill to the replacement's admission (the
  view that has the world size back), the state handed to it;
* **steps lost**: applied steps whose work was thrown away. Continue: none
  (the step in flight is redone, at most one per change). Restart: the steps
  between the newest checkpoint (or the start of training, when there was
  none yet) and the kill, estimated from that age at the kill and the run's
  median step time;
* **wall lost** and **CPU-s lost**: the faulted run's wall time and CPU time of
  all its processes over the uninterrupted run's (each process's own CPU time
  sampled every 0.1 s from ``/proc``, so a process's last 0.1 s before it
  ends may be missed);
* **samples**: every sample once in every epoch (``min_seen``/``max_seen``);
  **bitwise**: final weights equal to the uninterrupted run of the mode.

And without a fault, the mode's step time against DDP's (restart mode is
ddpkit's DDP): the median epoch time of the continue run over the restart
run's, epochs after the first.

With ``--repeats R`` each job and world size is measured R times (the victim drawn anew) and each figure is
the median.

Jobs: ``mnist`` (the ConvNet on MNIST, a checkpoint every 50 steps) and
``compiled`` (the same under ``torch.compile``, a checkpoint only at epoch
ends: a restart recompiles in every process and redoes up to an epoch, as a
large job that checkpoints every few minutes does).
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.bench.report.table import note_lines
from ddpkit.runtime.options import ConfigError, option, plain, writable_file
from ddpkit.runtime.process import children

__all__ = ["FailuresBenchConfig", "format_rows", "run"]

JOBS = {
    "mnist": ["--checkpoint-every", "50"],
    "compiled": ["--compile", "--checkpoint-every", "0"],
}


@dataclass(kw_only=True)
class FailuresBenchConfig:
    """What ``ddpkit bench failures`` runs."""

    jobs: tuple[str, ...] = option(tuple(JOBS), f"jobs, among {', '.join(JOBS)}", metavar="NAME")
    world_sizes: tuple[int, ...] = option((2, 3, 4), "worker counts", metavar="N")
    data_dir: Path | None = option(None, "folder of the MNIST IDX files (e.g. ../shared/data/mnist)")
    epochs: int = option(3, "epochs per run")
    kill_at: float = option(0.5, "when the worker is killed: this fraction of the uninterrupted run's training")
    seed: int = option(0, "seed of the runs and of the victim's choice")
    repeats: int = option(1, "times each job and world size is measured (the rows give medians)")
    json: Path | None = option(None, "write the rows as JSON here")
    progress: bool = option(True, "print a line as each run starts", negate="--no-progress", negate_only=True)

    def __post_init__(self) -> None:
        unknown = [j for j in self.jobs if j not in JOBS]
        if unknown:
            raise ConfigError(f"--jobs {' '.join(unknown)}: not a job; choose among {', '.join(JOBS)}")
        if self.data_dir is None:
            raise ConfigError("ddpkit bench failures trains on MNIST: give --data-dir (e.g. ../shared/data/mnist)")
        if any(w < 2 for w in self.world_sizes):
            raise ConfigError("--world-sizes: a death needs at least 2 workers to leave a survivor")
        if not 0 < self.kill_at < 1:
            raise ConfigError(f"--kill-at {self.kill_at} must be a fraction of the run, between 0 and 1")
        if self.repeats < 1:
            raise ConfigError(f"--repeats {self.repeats} must be at least 1")
        if self.epochs < 2:
            raise ConfigError("--epochs must be at least 2 (the step time is taken after the first epoch)")
        if self.json is not None:
            self.json = writable_file(self.json, "--json")


@dataclass
class Outcome:
    """One ``ddpkit train`` run as seen from outside."""

    wall_s: float
    cpu_s: float
    lines: list[tuple[float, str]]
    killed_at: float | None
    out: Path
    returncode: int
    checkpoint_age_s: float | None = None
    """Faulted: the newest checkpoint's age at the kill (restart mode; continue writes none)."""
    began: float | None = None
    """``time.time()`` of the run's first line of training."""

    def first(self, text: str, after: float = 0.0) -> float | None:
        return next((t for t, line in self.lines if text in line and t >= after), None)

    @property
    def metrics(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines()]


def _tree_cpu(root: int) -> dict[int, float]:
    """User and system CPU seconds so far of ``root`` and each of its descendants, each its own (not its
    children's), from one pass over ``/proc``."""
    parent, cpu = {}, {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            pid = int(entry.name)
            parent[pid], cpu[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
    tree, todo = {root}, [root]
    while todo:
        here = todo.pop()
        for pid, up in parent.items():
            if up == here and pid not in tree:
                tree.add(pid)
                todo.append(pid)
    return {pid: cpu[pid] for pid in tree if pid in cpu}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _workers(pid: int) -> list[int]:
    """The training workers of the ``ddpkit train`` process ``pid``: the children of its forkserver, which both
    failure modes fork them from; not the other helpers (the resource tracker, a compiler's workers, a parameter
    server: ``ddpkit-server0``)."""
    found = []
    for child in children(pid):
        if "forkserver" in _cmdline(child):
            found += [w for w in children(child) if not _comm(w).startswith("ddpkit-server")]
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _train(args: list[str], out: Path, kill_after: float | None, rng: random.Random) -> Outcome:
    """Run ``ddpkit train ARGS``; with ``kill_after``, SIGKILL a random worker that long after training began."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit", "train", "--output-dir", str(out), "--no-progress",
                             *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    began = threading.Event()
    started: list[float] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip()))
            if line.startswith("ddpkit train:") and " on " in line and not began.is_set():  # training's first line
                started.append(lines[-1][0])
                began.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    cpu: dict[int, float] = {}
    done = threading.Event()

    def account() -> None:  # every process of the run, sampled: a fork server's children are nobody's to wait for
        while not done.wait(0.1):
            for pid, seconds in _tree_cpu(proc.pid).items():
                cpu[pid] = max(cpu.get(pid, 0.0), seconds)

    accountant = threading.Thread(target=account, daemon=True)
    accountant.start()
    killed_at = age = None
    if kill_after is not None and began.wait(600):
        time.sleep(kill_after)
        workers = _workers(proc.pid)
        if workers:
            killed_at = time.time()
            os.kill(rng.choice(sorted(workers)), signal.SIGKILL)
            age = _checkpoint_age(out, killed_at)  # now: a restart replaces the files soon
    _, status, _ = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    accountant.join()
    reader.join(timeout=10)
    return Outcome(time.monotonic() - start, sum(cpu.values()), lines, killed_at, out, proc.returncode, age,
                   started[0] if started else None)


@dataclass
class Row:
    """One job, world size and mode: its uninterrupted and its faulted run."""

    job: str
    world_size: int
    mode: str
    detect_s: float | None = None
    next_step_s: float | None = None
    joined_s: float | None = None
    steps_lost: float | None = None
    wall_lost_s: float | None = None
    cpu_lost_s: float | None = None
    every_sample_once: bool | None = None
    bitwise: bool | None = None
    epoch_s: float | None = None
    """The uninterrupted run's median epoch time (epochs after the first)."""
    step_ratio: float | None = None
    """continue: its epoch time over restart's (DDP's) without a fault."""
    notes: list[str] = field(default_factory=list)
    repeats: int = 1


def _epoch_s(run: Outcome) -> float:
    return statistics.median(m["epoch_time_s"] for m in run.metrics[1:])


def _weights_equal(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return sorted(x) == sorted(y) and all(x[k].equal(y[k]) for k in x)


def _restart_row(row: Row, faulted: Outcome, steps_per_epoch: int) -> None:
    kill = faulted.killed_at or 0.0
    if (t := faulted.first("restarting the workers", kill)) is not None:
        row.detect_s = t - kill
    resumed = [t for text in ("resuming from", "no checkpoint yet") if (t := faulted.first(text, kill)) is not None]
    if resumed:
        row.next_step_s = min(resumed) - kill
    # Work since the newest checkpoint, or since training began when there was none yet.
    age = faulted.checkpoint_age_s
    if age is None and faulted.began is not None:
        age = kill - faulted.began
    if age is not None and row.epoch_s:
        row.steps_lost = round(age / (row.epoch_s / steps_per_epoch), 1)


def _continue_row(row: Row, faulted: Outcome) -> None:
    kill = faulted.killed_at or 0.0
    path = faulted.out / "membership.jsonl"
    changes = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    after = [c for c in changes if c["noticed"] >= kill]
    if after:
        row.detect_s = min(c["noticed"] for c in after) - kill
        resumed = [c["resumed"] for c in after if c["resumed"] is not None and c["size"] < row.world_size]
        if resumed:
            row.next_step_s = min(resumed) - kill
        grown = [c["rebuilt"] for c in after if c["size"] == row.world_size]
        if grown:
            row.joined_s = min(grown) - kill
    row.steps_lost = 0.0  # applied steps are never undone; the step in flight is redone (counted in wall lost)


def _checkpoint_age(out: Path, at: float) -> float | None:
    """Seconds since the newest checkpoint of ``out`` at ``at`` (its start, when it has none yet)."""
    folder = out / "checkpoints"
    times = []
    for path in folder.iterdir() if folder.is_dir() else []:
        try:
            times.append(path.stat().st_mtime)
        except FileNotFoundError:
            continue  # replaced by a newer one as we looked
    times = [t for t in times if t <= at]
    return at - max(times) if times else None


def bench_world(cfg: FailuresBenchConfig, job: str, world: int, work: Path, rng: random.Random,
                say: Any) -> list[Row]:
    base = ["--dataset", "mnist", "--data-dir", str(cfg.data_dir), "--epochs", str(cfg.epochs), "--seed",
            str(cfg.seed), "--nproc-per-node", str(world), "--max-restarts", "1", *JOBS[job]]
    modes = {"restart": [], "continue": ["--on-failure", "continue", "--deterministic-shards", str(world)]}
    runs: dict[tuple[str, bool], Outcome] = {}
    for faulted in (False, True):
        for mode, extra in modes.items():
            if faulted:
                reference = runs[(mode, False)]
                training = reference.lines[-1][0] - (reference.began or reference.lines[0][0])
                kill_after = cfg.kill_at * training
            else:
                kill_after = None
            say(f"{job}, {world} workers, {mode}, {'one worker killed' if faulted else 'no fault'}")
            out = work / f"{job}-{world}-{mode}-{'kill' if faulted else 'plain'}"
            out.parent.mkdir(parents=True, exist_ok=True)
            outcome = _train([*base, *extra], out, kill_after, rng)
            if outcome.returncode != 0:
                raise RuntimeError(f"ddpkit bench failures: the run in {out} failed:\n"
                                   + "\n".join(line for _, line in outcome.lines[-20:]))
            runs[(mode, faulted)] = outcome
    rows = []
    steps_per_epoch = runs[("restart", False)].metrics[0]["step"]
    for mode in modes:
        plain_run, faulted_run = runs[(mode, False)], runs[(mode, True)]
        row = Row(job, world, mode, epoch_s=_epoch_s(plain_run))
        row.wall_lost_s = faulted_run.wall_s - plain_run.wall_s
        row.cpu_lost_s = faulted_run.cpu_s - plain_run.cpu_s
        last = faulted_run.metrics
        row.every_sample_once = all(m["min_seen"] == m["max_seen"] == 1 for m in last)
        row.bitwise = _weights_equal(plain_run.out, faulted_run.out)
        if faulted_run.killed_at is None:
            row.notes.append("the run ended before the kill")
        elif mode == "restart":
            _restart_row(row, faulted_run, steps_per_epoch)
        else:
            _continue_row(row, faulted_run)
        rows.append(row)
    rows[1].step_ratio = rows[1].epoch_s / rows[0].epoch_s
    return rows


def _median_row(rows: list[Row]) -> Row:
    """One row from the repeats: the median of each figure measured, True only when every repeat was."""
    merged = Row(rows[0].job, rows[0].world_size, rows[0].mode, repeats=len(rows))
    for name in ("detect_s", "next_step_s", "joined_s", "steps_lost", "wall_lost_s", "cpu_lost_s", "epoch_s",
                 "step_ratio"):
        values = [getattr(r, name) for r in rows if getattr(r, name) is not None]
        setattr(merged, name, statistics.median(values) if values else None)
    for name in ("every_sample_once", "bitwise"):
        setattr(merged, name, all(getattr(r, name) for r in rows))
    merged.notes = sorted({note for r in rows for note in r.notes})
    return merged


def run(cfg: FailuresBenchConfig) -> list[dict[str, Any]]:
    """Run the bench (see the module notes); print the table; the rows."""

    def say(text: str) -> None:
        if cfg.progress:
            print(f"ddpkit bench failures: {text}", file=sys.stderr, flush=True)

    rng = random.Random(cfg.seed)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-failures-") as work:
        for job in cfg.jobs:
            for world in cfg.world_sizes:
                measured = [bench_world(cfg, job, world, Path(work) / str(r), rng, say) for r in range(cfg.repeats)]
                rows += [_median_row([m[i] for m in measured]) for i in range(2)]
    result = [asdict(r) for r in rows]
    print(format_rows(result))
    if cfg.json is not None:
        cfg.json.write_text(json.dumps({"config": plain(cfg), "rows": result}, indent=2) + "\n")
    return result


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The rows as two Markdown tables within :data:`~ddpkit.bench.report.table.WIDTH` columns (what a fault costs; the
    run as a whole), then each row's notes."""
    def key(r: dict[str, Any]) -> str:
        return f"| {r['job']} | {r['world_size']} | {r['mode']} |"

    lines: list[str] = []
    for head, cells in (
        ("| job | workers | mode | detect (s) | next step (s) | joined (s) | steps lost |",
         lambda r: f" {_f(r['detect_s'])} | {_f(r['next_step_s'])} | {_f(r['joined_s'])} | "
                   f"{_f(r['steps_lost'], 1)} |"),
        ("| job | workers | mode | wall lost (s) | CPU-s lost | samples once | bitwise | epoch (s) | / DDP |",
         lambda r: f" {_f(r['wall_lost_s'], 1)} | {_f(r['cpu_lost_s'], 1)} | {r['every_sample_once']} | "
                   f"{r['bitwise']} | {_f(r['epoch_s'])} | {_f(r['step_ratio'], 3) if r['step_ratio'] else '-'} |"),
    ):
        lines += [*([""] if lines else []), head, "|" + " --- |" * (head.count(" | ") + 1)]
        lines += [key(r) + cells(r) for r in rows]
    notes = [f"{r['job']}, {r['world_size']} workers, {r['mode']}: {'; '.join(r['notes'])}" for r in rows
             if r["notes"]]
    lines += ["", *note_lines("samples once: every sample trained once in every epoch; / DDP: the mode's epoch "
                              "without a fault over the restart mode's (ddpkit's DDP)")]
    for note in notes:
        lines += ["", *note_lines(note)]
    return "\n".join(lines)

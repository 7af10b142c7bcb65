"""Chaos: train under seeded random faults and prove that nothing is lost.

Runs ``ddpkit train`` (the MLP on scikit-learn's digits, 2 ranks) while a
seeded schedule sends faults at random moments, and checks at the end of every
run that

* the final weights are bit-identical to an uninterrupted run's;
* every epoch trained every sample exactly once (``min_seen == max_seen == 1``
  in ``metrics.jsonl``: counted per sample, across ranks and restarts);
* no process of the run is left (each carries a marker in its environment),
  no temporary file, no lock, and at most ``--keep-checkpoints`` step files.

Modes (``--mode``):

``launch``
    one node: ``ddpkit launch --max-restarts N -m ddpkit train``;
``train``
    ``ddpkit train --max-restarts N``, which starts its own workers;
``nodes``
    two nodes as two launchers on this machine (static rendezvous, node 0
    serves it);
``continue``
    four workers under ``ddpkit launch --on-failure continue`` training with
    ``--deterministic-shards 4``: the survivors go on in the same processes
    and every dead worker's replacement joins live, so a run takes all its
    faults and must still end bit-identical to an uninterrupted run of the
    mode, every sample once. Faults: SIGKILL, SIGTERM, SIGSTOP/SIGCONT.

Faults: SIGKILL, SIGTERM, or SIGSTOP then SIGCONT (0.5-3 s later) to a random
worker; SIGKILL to rank 0 the moment it starts writing a checkpoint (inotify
sees the temporary file appear); SIGKILL to a launcher (``launch``, ``nodes``)
or to ``ddpkit train`` itself (``train``). A run that a fault ends (its
launcher killed, the rendezvous host gone) is started again with ``--resume``,
which is what a user or a cluster's scheduler does; the report says which
faults the job survived by itself and which needed that. When a run finishes
before the faults are all sent, the next run starts, and each run is checked.

``--zero 2`` runs the faulted jobs with ZeRO stage 2 (sharded gradients and
optimizer state; the checkpoints hold the unsharded state), against the same
stage-0 reference: at two ranks the stages train the same bits.
``--strategy ps-sync`` runs them with a parameter server (started by
``ddpkit train``, or by the launcher with ``--num-servers 1``), which the
faults may hit like any other process of the job: at two workers ps-sync
trains DDP's bits too.

Run: ``.venv/bin/python scripts/chaos.py --faults 50 --seed 7 [--mode launch] [--zero 2 | --strategy ps-sync]
[--json report.json]``
(prints one line per fault and a summary; exit code 0 when every check passed).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import re
import select
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["--model", "mlp", "--dataset", "digits", "--batch-size", "32", "--checkpoint-every", "5",
         "--keep-checkpoints", "3", "--no-progress"]
MARK = "DDPKIT_CHAOS_RUN"
KINDS = ("sigkill-worker", "sigterm-worker", "sigstop-worker", "kill-mid-checkpoint", "sigkill-launcher")
CONTINUE = ["--on-failure", "continue", "--deterministic-shards", "4"]
"""``--mode continue``: the training mode of the faulted runs and of their reference (four workers)."""
CONTINUE_KINDS = ("sigkill-worker", "sigterm-worker", "sigstop-worker")
WEIGHTS = (3, 2, 2, 2, 1)


# ---------------------------------------------------------------- processes


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


SERVER_KEY = 1000
"""Where :func:`_workers` numbers a launcher's parameter servers."""


def _marked(mark: str) -> list[int]:
    """Every live process whose environment carries ``MARK=mark`` (zombies left aside)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _environ(int(entry.name)).get(MARK) == mark:
            try:
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                found.append(int(entry.name))
    return found


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _workers(mark: str) -> dict[int, int]:
    """Rank -> pid of the run's training processes (a launcher's parameter server k: ``SERVER_KEY + k``).

    A launcher's workers carry ``RANK`` in the environment they were started
    with; ``ddpkit train``'s own workers (forked from its forkserver, or
    started by ``ddpkit.spawn``) set theirs after start, where /proc does not
    show it: they are numbered in pid order.
    """
    found, spawned, servers = {}, [], {}
    for pid in sorted(_marked(mark)):
        env, cmd = _environ(pid), _cmdline(pid)
        if "spawn_main" in cmd:
            spawned.append(pid)
        elif "forkserver import main" in cmd:
            servers[pid] = _parent(pid)  # the server, and the workers forked from it
        elif "ddpkit.parallel.ps.server" in cmd:  # a launcher's parameter server
            found[SERVER_KEY + int(env.get("DDPKIT_SERVER_RANK", "0"))] = pid
        elif "RANK" in env and " launch " not in cmd:
            found[int(env["RANK"])] = pid
    spawned += sorted(pid for pid, parent in servers.items() if parent in servers)
    found.update({k: pid for k, pid in enumerate(spawned, start=len(found))})
    return found


class Inotify:
    """New files in a folder, as the kernel reports them (no polling gap)."""

    IN_CREATE = 0x100

    def __init__(self, folder: Path) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        folder.mkdir(parents=True, exist_ok=True)
        if self.libc.inotify_add_watch(self.fd, str(folder).encode(), self.IN_CREATE) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {folder} failed")

    def next_name(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return None
        data = os.read(self.fd, 4096)
        _, _, _, length = struct.unpack_from("iIII", data, 0)
        return data[16 : 16 + length].rstrip(b"\0").decode(errors="replace")

    def close(self) -> None:
        os.close(self.fd)


# ---------------------------------------------------------------- one job


@dataclass
class Job:
    """One run of the training command, possibly started several times (``--resume``)."""

    mode: str
    out: Path
    epochs: int
    max_restarts: int
    mark: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    current: dict = field(default_factory=dict)
    """The newest process of each node (None: the single launcher or ddpkit train)."""
    starts: int = 0
    zero: int = 0
    """``--zero``: the ZeRO stage of the runs (the reference is stage 0, which trains the same bits at world 2)."""
    strategy: str = "ddp"
    """``--strategy``: ddp, or ps-sync with one parameter server (the same bits at world 2)."""
    deaths: list[float] = field(default_factory=list)
    """``time.time()`` of each SIGKILL or SIGTERM sent to a worker."""

    def command(self, node: int | None, resume: bool, port: int) -> list[str]:
        train = ["--output-dir", str(self.out), "--epochs", str(self.epochs), *TRAIN, "--zero", str(self.zero),
                 "--strategy", self.strategy] + (["--resume"] if resume else [])
        servers = ["--num-servers", "1"] if self.strategy == "ps-sync" else []
        py = [sys.executable, "-m", "ddpkit"]
        if self.mode == "train":
            return [*py, "train", "--max-restarts", str(self.max_restarts), *train]
        if self.mode == "continue":
            return [*py, "launch", "--nproc-per-node", "4", "--on-failure", "continue", "--max-restarts",
                    str(self.max_restarts), "-m", "ddpkit", "train", *train, *CONTINUE]
        if self.mode == "launch":
            return [*py, "launch", "--nproc-per-node", "2", *servers, "--max-restarts", str(self.max_restarts),
                    "--shutdown-timeout", "3", "-m", "ddpkit", "train", *train]
        return [*py, "launch", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", *servers,
                "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-id", f"chaos-{self.mark}",
                "--max-restarts", str(self.max_restarts), "--shutdown-timeout", "3", "-m", "ddpkit", "train", *train]

    def start(self, log: Path, resume: bool = False, nodes: tuple[int, ...] = (0, 1)) -> None:
        from ddpkit.runtime.process import free_port

        self.log = log
        env = {**os.environ, MARK: self.mark, "OMP_NUM_THREADS": "1", "DDPKIT_TIMEOUT": "60"}
        if self.mode == "nodes":  # a job across nodes needs a secret its launchers share (not on a command line)
            import secrets

            self.secret = getattr(self, "secret", None) or secrets.token_hex(16)
            env["DDPKIT_JOB_TOKEN"] = self.secret
        self.port = getattr(self, "port", None) or free_port()
        targets = list(nodes) if self.mode == "nodes" else [None]
        for node in targets:
            with open(log, "a") as f:
                f.write(f"--- start {self.starts} node {node} resume={resume}\n")
                proc = subprocess.Popen(self.command(node, resume, self.port), cwd=ROOT, env=env,
                                        stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            self.procs.append(proc)
            self.current[node] = proc
        self.starts += 1

    def running(self) -> list[subprocess.Popen]:
        return [p for p in self.procs if p.poll() is None]

    def launchers(self) -> list[subprocess.Popen]:
        return self.running()

    def kill_all(self) -> None:
        for pid in _marked(self.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _reference(out: Path, epochs: int, log: Path, mode: str) -> tuple[dict, float]:
    """The uninterrupted run: its weights and its wall time."""
    start = time.monotonic()
    extra = [*CONTINUE, "--nproc-per-node", "4"] if mode == "continue" else []
    done = subprocess.run([sys.executable, "-m", "ddpkit", "train", "--output-dir", str(out), "--epochs", str(epochs),
                           *TRAIN, *extra], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True)
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"chaos: the reference run failed:\n{done.stderr[-2000:]}")
    return _weights(out), time.monotonic() - start


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")


# ---------------------------------------------------------------- faults


@dataclass
class Report:
    mode: str
    seed: int
    faults_asked: int
    sent: dict[str, int] = field(default_factory=dict)
    survived_by_the_job: int = 0
    needed_a_relaunch: int = 0
    runs: list[dict] = field(default_factory=list)
    not_survivable: list[str] = field(default_factory=list)
    reference_wall_s: float = 0.0
    seconds_lost_per_fault: float = 0.0
    ok: bool = False


def _wait_for_workers(job: Job, count: int, timeout: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = _workers(job.mark)
        if len(workers) >= count or not job.running():
            return workers
        time.sleep(0.05)
    return _workers(job.mark)


def _wait_for_holders(job: Job, timeout: float) -> None:
    """``--mode continue``: until every replacement the launcher started holds the training state (its
    ``member N holds the training state`` line), so that a fault never finds the state held only by processes
    still starting. (A job that loses every holder at once ends, by design: the chaos is about faults a job can
    survive, spaced as the launcher's replacements can follow.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.running():
        text = job.log.read_text(errors="replace") if job.log.exists() else ""
        started = set(re.findall(r"started member (\d+) to replace", text))
        held = set(re.findall(r"member (\d+) holds the training state", text))
        if started <= held:
            return
        time.sleep(0.05)


def _send(kind: str, job: Job, rng: random.Random, watcher: Inotify | None, say) -> str:
    """Send one fault; return how the job is expected to live on: ``job``, ``relaunch``."""
    if job.mode == "continue":
        _wait_for_holders(job, 120)
    workers = _wait_for_workers(job, 2, 60)
    if not workers:
        return "none"
    rank = rng.choice(sorted(workers))
    if kind == "kill-mid-checkpoint":
        assert watcher is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            name = watcher.next_name(0.5)
            if name and ".tmp-" in name:
                pid = int(name.rsplit("-", 1)[1])  # the writer names itself in its temporary file
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                say(f"SIGKILL to rank 0 (pid {pid}) while it wrote {name}")
                return "job"
        kind = "sigkill-worker"  # no checkpoint came in time (the run is ending): a plain kill instead
    pid = workers[rank]
    who = f"rank {rank}" if job.mode != "train" else "a worker"  # spawn's ranks are not visible from outside
    if rank >= SERVER_KEY:
        who = f"parameter server {rank - SERVER_KEY}"
    if kind == "sigkill-worker":
        job.deaths.append(time.time())
        os.kill(pid, signal.SIGKILL)
    elif kind == "sigterm-worker":
        job.deaths.append(time.time())
        os.kill(pid, signal.SIGTERM)
    elif kind == "sigstop-worker":
        stop = rng.uniform(0.5, 3.0)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(stop)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        say(f"SIGSTOP to {who} (pid {pid}), SIGCONT {stop:.1f} s later")
        return "job"
    elif kind == "sigkill-launcher":
        launchers = job.running()
        if not launchers:
            return "none"
        victim = rng.choice(launchers)
        node = next(n for n, p in job.current.items() if p is victim)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        what = {"train": "ddpkit train itself", "launch": "the launcher"}.get(job.mode, f"node {node}'s launcher")
        say(f"SIGKILL to {what} (pid {victim.pid})")
        if job.mode == "nodes" and node == 1:
            return "node1"
        return "relaunch"
    say(f"{kind.split('-')[0].upper()} to {who} (pid {pid})")
    return "job"


def _recovery(job: Job) -> dict:
    """``--mode continue``: for each death sent, seconds until the first survivor knew (``detect_s``) and until
    the first survivor applied a step after it (``next_step_s``), from the workers' ``membership.jsonl``. A death
    while the workers were still starting (no step yet) has none."""
    path = job.out / "membership.jsonl"
    changes = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    detect, next_step = [], []
    for at in job.deaths:
        after = [c for c in changes if c["noticed"] >= at]
        if after:
            detect.append(round(min(c["noticed"] for c in after) - at, 4))
            resumed = [c["resumed"] for c in after if c["resumed"] is not None]
            if resumed:
                next_step.append(round(min(resumed) - at, 4))
    return {"detect_s": detect, "next_step_s": next_step}


def _check_run(job: Job, reference: dict, report: Report, say) -> dict:
    """The end-of-run checks (see the module notes); returns the run's record."""
    import torch

    weights = _weights(job.out)
    identical = sorted(weights) == sorted(reference) and all(torch.equal(weights[k], reference[k]) for k in reference)
    metrics = [json.loads(line) for line in (job.out / "metrics.jsonl").read_text().splitlines()]
    once = [m["epoch"] for m in metrics if not (m.get("min_seen") == m.get("max_seen") == 1)]
    leftover = _marked(job.mark)
    temporaries = [p.name for p in job.out.rglob("*") if ".tmp-" in p.name]
    folder = job.out / "checkpoints"  # none under --on-failure continue: its state lives in the survivors
    steps = [p.name for p in folder.iterdir() if p.name.startswith("step-")] if folder.is_dir() else []
    record = {"out": str(job.out), "starts": job.starts, "bit_identical": identical,
              "epochs": [m["epoch"] for m in metrics], "epochs_not_once": once, "processes_left": leftover,
              "temporaries_left": temporaries, "lock_left": (job.out / "lock.json").exists(),
              "step_files": len(steps)}
    if job.mode == "continue":
        summary = json.loads((job.out / "summary.json").read_text())
        record["membership_changes"] = summary["membership_changes"]
        record["world_size_at_the_end"] = summary["world_size"]
        record.update(_recovery(job))
    record["ok"] = (identical and not once and not leftover and not temporaries and not record["lock_left"]
                    and len(steps) <= 3 and record["epochs"] == list(range(1, job.epochs + 1)))
    if record.get("detect_s"):
        detect, step = record["detect_s"], record["next_step_s"] or [float("nan")]
        say(f"run {job.out.name}: {len(detect)} deaths during training: detected in {statistics.median(detect):.3f} s, "
            f"next step {statistics.median(step):.3f} s after the kill (medians; largest {max(detect):.3f} s, "
            f"{max(step):.3f} s)")
    say(f"run {job.out.name}: {'OK' if record['ok'] else 'FAILED'} "
        f"(bit-identical {identical}, every sample once {not once}, processes left {len(leftover)}, "
        f"temporaries {len(temporaries)}, lock left {record['lock_left']}, step files {len(steps)})")
    return record


def chaos(args: argparse.Namespace) -> Report:
    rng = random.Random(args.seed)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ddpkit-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "chaos.log"

    def say(text: str) -> None:
        line = f"chaos: {text}"
        print(line, flush=True)
        with open(log, "a") as f:
            f.write(line + "\n")

    report = Report(mode=args.mode, seed=args.seed, faults_asked=args.faults)
    reference, report.reference_wall_s = _reference(work / "reference", args.epochs, work / "reference.log",
                                                    args.mode)
    say(f"reference run: {report.reference_wall_s:.1f} s")
    chosen = [k for k in KINDS if k in args.kinds and (args.mode != "continue" or k in CONTINUE_KINDS)]
    kinds, weights = chosen, [w for k, w in zip(KINDS, WEIGHTS) if k in chosen]
    sent = 0
    chaos_wall = 0.0
    run = 0
    while sent < args.faults:
        job = Job(args.mode, work / f"run{run}", args.epochs, max_restarts=args.faults + 5, mark=f"{args.seed}-{run}",
                  zero=args.zero, strategy=args.strategy)
        run_start = time.monotonic()
        watcher = Inotify(job.out / "checkpoints")
        job.start(work / f"run{run}.log")
        while job.running() and sent < args.faults:
            if not _wait_for_workers(job, 2, 120):
                break
            time.sleep(rng.uniform(0.3, 2.5))
            if not job.running():
                break
            kind = rng.choices(kinds, weights)[0]
            outcome = _send(kind, job, rng, watcher, say)
            if outcome == "none":
                continue
            sent += 1
            report.sent[kind] = report.sent.get(kind, 0) + 1
            if outcome == "job":
                report.survived_by_the_job += 1
            elif outcome == "node1":
                # A cluster's scheduler brings the node back: a new launcher joins the restart round.
                job.start(work / f"run{run}.log", nodes=(1,))
                report.survived_by_the_job += 1
            else:
                report.needed_a_relaunch += 1
                if args.mode == "nodes":
                    note = "node 0's launcher serves the static rendezvous: the job cannot outlive it"
                elif args.mode == "launch":
                    note = "a single-node job's launcher is the job: nothing can restart it but its caller"
                else:
                    note = "ddpkit train's own process starts its workers: nothing can restart it but its caller"
                if note not in report.not_survivable:
                    report.not_survivable.append(note)
                for p in job.running():
                    p.wait(timeout=120)  # the rest of the job ends by itself (failure seen, or workers gone)
                job.kill_all()
                # What a user does: --resume when the run got as far as writing its settings, else start it again.
                resume = (job.out / "config.json").exists()
                say(f"  relaunching{' with --resume' if resume else ' (it had not started: no --resume)'} ({note})")
                job.start(work / f"run{run}.log", resume=resume)
        for p in job.procs:
            try:
                p.wait(timeout=600)
            except subprocess.TimeoutExpired:
                job.kill_all()
        watcher.close()
        time.sleep(1.0)  # the kernel reaps the last children
        chaos_wall += time.monotonic() - run_start
        if any(p.returncode != 0 for p in job.current.values()):
            say(f"run {run}: the job's last start failed; see {work / f'run{run}.log'}")
            report.runs.append({"out": str(job.out), "ok": False, "failed": True})
            job.kill_all()
            break
        report.runs.append(_check_run(job, reference, report, say))
        run += 1
    report.seconds_lost_per_fault = (chaos_wall - run * report.reference_wall_s) / max(sent, 1)
    report.ok = bool(report.runs) and all(r["ok"] for r in report.runs) and sent == args.faults
    say(f"{sent} faults sent ({', '.join(f'{k} {v}' for k, v in sorted(report.sent.items()))}); survived by the "
        f"job itself {report.survived_by_the_job}, after a relaunch {report.needed_a_relaunch}; "
        f"{len(report.runs)} run(s), all bit-identical and every sample once: {report.ok}; "
        f"time lost per fault {report.seconds_lost_per_fault:.1f} s")
    for note in report.not_survivable:
        say(f"not survivable by design: {note}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=50, help="faults to send in all (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="the schedule's seed (default 0)")
    parser.add_argument("--mode", choices=("launch", "train", "nodes", "continue"), default="launch")
    parser.add_argument("--epochs", type=int, default=12, help="epochs of each run (default 12)")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                        help="ZeRO stage of the faulted runs (ddpkit train --zero; default 0)")
    parser.add_argument("--strategy", choices=("ddp", "ps-sync"), default="ddp",
                        help="ddp, or ps-sync with one parameter server, itself a target of the faults (default ddp)")
    parser.add_argument("--workdir", help="where the runs go (default: a new temporary folder, removed at the end)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, runs)")
    parser.add_argument("--json", help="write the report as JSON here")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), metavar="KIND",
                        help=f"the faults to draw from (default all: {' '.join(KINDS)})")
    args = parser.parse_args()
    if args.faults < 1 or args.epochs < 1:
        parser.error("--faults and --epochs must be at least 1")
    sys.path.insert(0, str(ROOT / "src"))
    report = chaos(args)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

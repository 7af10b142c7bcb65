"""Helpers for tests that start real processes: ranks by hand, or ddpkit launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parents[1]
NODES_SECRET = "5ec2e7f00d5ec2e7f00d5ec2e7f00d42"
"""The secret the tests give the launchers of a job across nodes (such a job needs one of 128 bits)."""


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str

    def reports(self) -> list[dict]:
        """The JSON lines printed by scripts/report_env.py, sorted by rank."""
        found = [json.loads(line.split("REPORT ", 1)[1]) for line in self.stdout.splitlines() if "REPORT " in line]
        return sorted(found, key=lambda r: r["rank"])


def base_env(**extra: str) -> dict[str, str]:
    """This environment minus any launcher variables the test runner might carry."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                         "MASTER_ADDR", "MASTER_PORT", "DDPKIT_JOB_TOKEN")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_ranks(envs: list[dict[str, str]], script: str = "report_env.py", timeout: float = 60) -> list[Done]:
    """Start one process per env concurrently (a hand-made launcher) and wait for all."""
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / script)], env={**base_env(), **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for env in envs]
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        done.append(Done(proc.returncode, out, err))
    return done


def launch(*args: str, timeout: float = 60, env: dict[str, str] | None = None, cwd: Path | None = None) -> Done:
    """Run ``python -m ddpkit launch ARGS`` to completion."""
    proc = subprocess.run([sys.executable, "-m", "ddpkit", "launch", *args], env=env or base_env(),
                          capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT)
    return Done(proc.returncode, proc.stdout, proc.stderr)


def script(name: str) -> str:
    return str(SCRIPTS / name)


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the direct children of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append((int(entry.name), cmdline))
    return found


def descendants(root: int) -> list[int]:
    """Every descendant of ``root``."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child, _ in children(pid):
            found.append(child)
            todo.append(child)
    return found


def named(root: int, name: str) -> list[int]:
    """The descendants of ``root`` named ``name`` (``/proc/PID/comm``): ``ddpkit-rank3``, the worker of rank 3 that
    ``ddpkit train --on-failure continue`` started; ``ddpkit-server0``, parameter server 0. Not the processes such
    a worker forks (they inherit its name)."""
    def comm(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return ""

    def parent(pid: int) -> int:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    return [pid for pid in descendants(root) if comm(pid) == name and comm(parent(pid)) != name]


def wait_for(condition: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the run never reached the kill point")
        time.sleep(0.005)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


class Streamed:
    """A process (a node's launcher), its output read as it comes, so that a test waits for a line instead of
    sleeping."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.pid = self.proc.pid
        self.lines: tuple[list[str], list[str]] = ([], [])
        self.readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                        for stream, lines in zip((self.proc.stdout, self.proc.stderr), self.lines)]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            lines.append(line)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait_for(self, text: str, timeout: float = 60) -> None:
        """Until ``text`` is in this node's output (stdout or stderr)."""
        deadline = time.monotonic() + timeout

        def seen() -> bool:
            return any(text in line for lines in self.lines for line in lines)

        while not seen():
            if self.proc.poll() is not None:
                for reader in self.readers:
                    reader.join(timeout=10)  # what it printed before it ended
                assert seen(), f"the node ended without {text!r}: {self.lines}"
                return
            assert time.monotonic() < deadline, f"{text!r} not within {timeout} s: {self.lines}"
            time.sleep(0.05)

    def communicate(self, timeout: float) -> tuple[str, str]:
        self.proc.wait(timeout=timeout)
        for reader in self.readers:
            reader.join(timeout=10)
        return "".join(self.lines[0]), "".join(self.lines[1])

"""One job writes a run directory at a time: a second is refused, a crashed one's lock is taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import base_env

from ddpkit.runtime.options import ConfigError
from ddpkit.train.lock import LOCK_FILE, RunLock

TRAIN = ["--dataset", "synthetic", "--synthetic-samples", "512", "--batch-size", "16", "--checkpoint-every", "4",
         "--no-progress"]


def _train(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ddpkit", "train", "--output-dir", str(out), *TRAIN, *extra],
                            env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


@pytest.mark.slow("a job, two refused ones beside it, a kill -9, then a run that takes the lock over and resumes")
def test_a_second_job_is_refused_and_a_crashed_jobs_lock_is_taken_over(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = _train(out, "--epochs", "400")  # long enough to outlive both attempts below; killed after
    try:
        _wait_for(out / "checkpoints")  # running, and holding the directory
        held = json.loads((out / LOCK_FILE).read_text())
        assert held["pid"] == first.pid
        for extra in ([], ["--resume", "--epochs", "40"]):
            second = subprocess.run([sys.executable, "-m", "ddpkit", "train", "--output-dir", str(out), *TRAIN,
                                     "--epochs", "2", *extra], env=base_env(), capture_output=True, text=True,
                                    timeout=120)
            assert second.returncode == 2, second.stderr
            assert f"is in use by another job: pid {first.pid} on " in second.stderr, second.stderr
            assert "wait for it to end, or choose another --output-dir" in second.stderr
        os.killpg(first.pid, signal.SIGKILL)  # the job and its workers, as a crash or the OOM killer
        first.wait()
        assert (out / LOCK_FILE).exists()  # a kill -9 leaves the lock, stale
        # The checkpoint of an epoch comes just before its line in metrics.jsonl: one more epoch than the lines.
        done = len((out / "metrics.jsonl").read_text().splitlines()) if (out / "metrics.jsonl").exists() else 0
        again = subprocess.run([sys.executable, "-m", "ddpkit", "train", "--output-dir", str(out), *TRAIN,
                                "--epochs", str(done + 2), "--resume"], env=base_env(), capture_output=True,
                               text=True, timeout=240)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert again.returncode == 0, again.stderr
    assert f"took over the lock of {out} from pid {first.pid} on " in again.stdout, again.stdout
    assert "which is no longer running" in again.stdout
    assert not (out / LOCK_FILE).exists()  # released at the end


def test_a_live_lock_of_another_host_is_respected_until_its_heartbeat_stops(tmp_path: Path) -> None:
    lock = RunLock(tmp_path)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "1", "job": None,
                                                  "command": "ddpkit train", "since": time.time()}))
    with pytest.raises(ConfigError, match="is in use by another job: pid 1 on elsewhere"):
        lock.acquire()
    old = time.time() - 60  # no heartbeat for a minute: that host's job is gone
    os.utime(tmp_path / LOCK_FILE, (old, old))
    assert "from pid 1 on elsewhere, which is no longer running" in lock.acquire()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_restarted_attempt_of_the_same_job_takes_its_lock_over(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DDPKIT_JOB_TOKEN", "the-job")
    earlier = RunLock(tmp_path)
    parent = os.getppid()  # a live process of this host: only the job's digest lets the attempt in
    earlier.mine["pid"] = parent
    earlier.mine["started"] = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    (tmp_path / LOCK_FILE).write_text(json.dumps({**earlier.mine}))
    lock = RunLock(tmp_path)
    assert lock.live(earlier.mine)
    assert lock.acquire() == f"took over the lock of {tmp_path} from an earlier attempt of this job"
    lock.release()

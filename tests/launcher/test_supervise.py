"""ddpkit launch with real processes: env contract, compatibility, supervision, bad input."""

from __future__ import annotations

import collections
import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import NODES_SECRET, ROOT, SCRIPTS, alive, base_env, launch, script

from ddpkit.launcher import LaunchConfig, plan_workers, resolve
from ddpkit.launcher.job import standalone_addr
from ddpkit.launcher.output import LogLayout, Pump
from ddpkit.launcher.supervise import WorkerGroup, extract_traceback
from ddpkit.runtime.process import Interrupted, SignalCatcher, free_port


def test_ddpkit_script_gets_the_torchrun_env_contract():
    done = launch("--nproc-per-node", "2", "--standalone", "--max-restarts", "3", "--prefix-output",
                  script("report_env.py"), "a", "b")
    assert done.returncode == 0, done.stderr
    reports = done.reports()
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert r["scheme"] == "env" and r["world_size"] == 2 and r["sum"] == 1.0 and r["argv"] == ["a", "b"]
        env = r["env"]
        assert env["LOCAL_RANK"] == str(r["rank"]) and env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "0"
        # torchrun's --standalone: this host's name (loopback where it does not resolve here).
        assert env["MASTER_ADDR"] == standalone_addr(None) and env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert "[rank0]: REPORT" in done.stdout and "[rank1]: REPORT" in done.stdout


def test_omp_threads_is_set_and_announced_once_when_unset():
    env = base_env()
    del env["OMP_NUM_THREADS"]
    done = launch("--nproc_per_node=2", "--standalone", script("report_env.py"), env=env)
    assert done.returncode == 0, done.stderr
    assert [r["env"]["OMP_NUM_THREADS"] for r in done.reports()] == ["1", "1"]
    assert done.stderr.count("setting OMP_NUM_THREADS=1") == 1


def test_torchrun_script_runs_unchanged_under_ddpkit_launch():
    done = launch("--nproc-per-node", "2", "--standalone", script("torchrun_style.py"))
    assert done.returncode == 0, done.stderr
    assert "TORCHRUN-STYLE rank=1 local_rank=1 world=2 sum=1" in done.stdout


@pytest.mark.slow("a job under torchrun")
def test_ddpkit_script_runs_unchanged_under_torchrun():
    pytest.importorskip("torch.distributed.run")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           script("report_env.py")], env=base_env(), capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("REPORT ") == 2 and '"sum": 1.0' in proc.stdout


def test_console_script_and_local_rank_arg():
    ddpkit_bin = Path(sys.executable).parent / "ddpkit"
    if not ddpkit_bin.exists():
        pytest.skip("console script not installed next to this interpreter")
    proc = subprocess.run([str(ddpkit_bin), "launch", "--nproc-per-node", "2", "--local-rank-arg", "--prefix-output",
                           script("legacy_launch.py"), "--tag", "t1"],
                          env=base_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "[rank0]: LEGACY local_rank=0 tag=t1" in proc.stdout
    assert "[rank1]: LEGACY local_rank=1 tag=t1" in proc.stdout


def test_module_no_prefix_and_log_dir(tmp_path):
    done = launch("--nproc-per-node", "2", "--standalone", "--no-prefix", "--log-dir", str(tmp_path),
                  "-m", "report_env", cwd=SCRIPTS)
    assert done.returncode == 0, done.stderr
    assert "[rank" not in done.stdout and done.stdout.count("REPORT ") == 2
    logs = sorted(p.name for p in (tmp_path / "attempt_0").iterdir())
    assert logs == ["rank0.log", "rank1.log"]
    assert '"rank": 1' in (tmp_path / "attempt_0" / "rank1.log").read_text()


def test_no_python_runs_a_program_that_is_not_python_with_the_role():
    done = launch("--nproc-per-node", "2", "--standalone", "--no-python", "--role", "trainer", "--prefix-output",
                  "--monitor-interval", "1", str(SCRIPTS / "print_env.sh"), "x")
    assert done.returncode == 0, done.stderr
    assert "[rank0]: SHELL-WORKER RANK=0 ROLE=trainer ARGS=x" in done.stdout
    assert "[rank1]: SHELL-WORKER RANK=1 ROLE=trainer ARGS=x" in done.stdout
    assert "ddpkit launch: --monitor-interval 1: not needed" in done.stderr


def test_crash_reports_the_root_cause_and_leaves_nothing_behind(tmp_path):
    start = time.monotonic()
    done = launch("--nproc-per-node", "2", "--standalone", script("crash.py"), str(tmp_path))
    elapsed = time.monotonic() - start
    assert done.returncode == 1
    assert elapsed < 30  # the surviving rank sleeps 120 s; it must be torn down at once
    report = done.stderr.split("Root cause: rank 1", 1)[1]
    assert "rank 1 (local rank 1) failed first: exit code 1" in done.stderr
    assert "Traceback (most recent call last):" in report
    assert "in load_shard" in report and "ValueError: shard 1 is corrupt" in report
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids), "a worker's child outlived the launcher"


@pytest.mark.slow("a launched job restarted, fresh workers each round")
def test_max_restarts_restarts_the_group_with_an_incremented_count():
    done = launch("--nproc-per-node", "2", "--standalone", "--max-restarts", "2", script("flaky.py"))
    assert done.returncode == 0, done.stderr
    assert "restarting the worker group (restart 1 of 2)" in done.stderr
    assert "RuntimeError: first attempt fails on purpose" in done.stderr
    assert "FLAKY ok rank=0 restart=1 max=2 sum=2" in done.stdout
    assert "FLAKY ok rank=1 restart=1" in done.stdout


def test_without_restarts_a_failure_is_final():
    done = launch("--nproc-per-node", "2", "--standalone", script("flaky.py"))
    assert done.returncode == 1
    assert "Root cause: rank 0" in done.stderr and "restarting" not in done.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow(
    "the same launch as SIGTERM's, for the other signal"))])
def test_a_signal_to_the_launcher_tears_the_group_down(sig):
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", "--standalone",
                             script("sleeper.py")], env=base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pids = [int(proc.stdout.readline().split()[-1]) for _ in range(2)]
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == 128 + sig
    assert f"received {sig.name}: stopping all workers" in proc.stderr.read()
    time.sleep(0.2)
    assert not any(alive(pid) for pid in pids)


@pytest.mark.slow("two launchers and their workers")
def test_two_nodes_on_one_machine_get_global_ranks():
    port = str(free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port]
    nodes = [subprocess.Popen([sys.executable, "-m", "ddpkit", "launch", *common, "--node-rank", str(n),
                               script("report_env.py")], env=base_env(DDPKIT_JOB_TOKEN=NODES_SECRET),
                              stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    outs = [n.communicate(timeout=60) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    reports = [line for out, _ in outs for line in out.splitlines() if "REPORT" in line]
    assert '"rank": 0' in reports[0] and '"node_rank": 0' in reports[0]
    assert '"rank": 1' in reports[1] and '"node_rank": 1' in reports[1] and '"world_size": 2' in reports[1]


def test_a_console_reader_that_goes_away_ends_the_job_instead_of_hanging(tmp_path):
    # `ddpkit launch ... | head -1`: torchrun's workers write to the closed pipe themselves and fail; the
    # launcher must not leave them blocked on a full pipe and wait forever.
    spew = tmp_path / "spew.py"
    spew.write_text("for i in range(1_000_000):\n    print('line', i)\n")
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", "--standalone",
                             str(spew)], env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout.readline().startswith(b"line")
    proc.stdout.close()
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 1
    assert b"Broken pipe" in err


def test_busy_master_port_is_reported_before_starting():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = launch("--nproc-per-node", "2", "--master-port", str(port), script("report_env.py"))
    assert done.returncode == 2
    assert f"--master-port {port} is busy on this node" in done.stderr


@pytest.mark.parametrize("args, message", [
    (["--nproc-per-node", "0", "x.py"], "--nproc-per-node 0 must be at least 1"),
    (["--nnodes", "2", "--node-rank", "5", "x.py"], "--node-rank 5 is out of range for --nnodes 2"),
    (["does_not_exist.py"], "script 'does_not_exist.py' does not exist"),
    (["--master-addr", "no-such-host.invalid", "--nnodes", "2", "--node-rank", "1", script("report_env.py")],
     "--master-addr 'no-such-host.invalid' does not resolve"),
])
def test_bad_arguments_fail_fast_with_the_value(args, message):
    done = launch(*args, timeout=30)
    assert done.returncode == 2
    assert message in done.stderr


def test_root_cause_is_the_first_failure_in_time_not_in_rank_order():
    # Rank 0 also fails, 30 ms after rank 1: the lower rank must not be blamed.
    done = launch("--nproc-per-node", "2", "--standalone", script("two_failures.py"))
    assert done.returncode == 1
    assert "rank 1 (local rank 1) failed first: exit code 1" in done.stderr, done.stderr
    assert "Root cause: rank 1" in done.stderr


def test_extract_traceback_keeps_the_chain_and_drops_torch_prefixes():
    lines = [
        "epoch 1 done",
        "Traceback (most recent call last):",
        '  File "a.py", line 1, in <module>',
        "KeyError: 'x'",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "a.py", line 3, in <module>',
        "[rank1]: ValueError: bad shard",
    ]
    text = extract_traceback(lines)
    assert text.startswith("Traceback (most recent call last):\n  File \"a.py\", line 1")
    assert "During handling" in text and text.endswith("ValueError: bad shard")
    assert "[rank1]" not in text and "epoch 1 done" not in text
    # An unrelated earlier traceback is not part of the last one's chain.
    assert extract_traceback(["Traceback (most recent call last):", "OSError: old", "noise", *lines[7:]]) == (
        'Traceback (most recent call last):\n  File "a.py", line 3, in <module>\nValueError: bad shard'
    )
    assert extract_traceback(["no error here"]) == ""


def test_output_pump_prefixes_every_segment_and_keeps_carriage_returns():
    src = io.BufferedReader(io.BytesIO(b"10%\r50%\r100%\nok\r\n[rank3]: already\nlast words"))
    dst, log = io.BytesIO(), io.BytesIO()
    tail: collections.deque = collections.deque()
    pump = Pump(src, dst, b"[rank3]: ", log, tail)
    pump.run()
    assert dst.getvalue() == (
        b"[rank3]: 10%\r[rank3]: 50%\r[rank3]: 100%\n[rank3]: ok\r\n[rank3]: already\n[rank3]: last words\n"
    )
    assert log.getvalue() == b"10%\r50%\r100%\nok\r\n[rank3]: already\nlast words\n"
    assert list(tail) == ["10%", "50%", "100%", "ok", "[rank3]: already", "last words"]


def test_a_signal_while_workers_start_still_stops_every_started_worker(monkeypatch, tmp_path):
    # SIGTERM lands right after the first worker is forked: the launcher must
    # finish its bookkeeping, start no more, and tear down the one it started.
    cfg = resolve(LaunchConfig(program=script("sleeper.py"), nproc_per_node=3, standalone=True))
    specs = plan_workers(cfg, master_port=free_port(), restart_count=0, base_env=base_env())
    signals = SignalCatcher()
    previous = signal.signal(signal.SIGTERM, signals)
    layout = LogLayout(cfg, "test")
    layout.start_attempt(0, 3)
    group = WorkerGroup(cfg, layout)
    real_start_one = group._start_one

    def start_one_then_signal(spec):
        real_start_one(spec)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(group, "_start_one", start_one_then_signal)
    try:
        with pytest.raises(Interrupted):
            group.start(specs, signals)
        assert len(group.procs) == 1
        group.stop(signal.SIGTERM)
        assert all(p.poll() is not None for p in group.procs)
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow("a launched job, its launcher killed")
def test_a_launcher_killed_outright_takes_its_workers_with_it():
    import os
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", script("sleeper.py")],
                            env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2:
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, proc.stderr.read()
            if line.startswith("SLEEPING"):
                pids.append(int(line.split()[1]))
        proc.send_signal(signal.SIGKILL)  # the launcher alone: it cannot stop anything now
        proc.wait()
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if os.path.exists(f"/proc/{p}")], "a worker outlived its launcher"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

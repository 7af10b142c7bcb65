"""torchrun's command lines under ddpkit launch: output flags, PET_* variables, error files, signals, bad values."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.launcher import LaunchConfig, plan_workers, resolve
from ddpkit.launcher.output import read_error_file
from ddpkit.runtime.process import free_port
from tests.procs import SCRIPTS, base_env, launch

SHELL = str(SCRIPTS / "print_env.sh")


def test_tee_redirects_filter_and_duplicates_write_torchruns_layout(tmp_path):
    done = launch("--nproc-per-node", "3", "--standalone", "--no-python", "--log-dir", str(tmp_path),
                  "--tee", "0:1", "-r", "1:1,2:1", "--local-ranks-filter", "0,1",
                  "--duplicate-stdout-filters", "RANK=2", "--rdzv-id", "job7", SHELL)
    assert done.returncode == 0, done.stderr
    # Rank 0 is teed (console, prefixed as torchrun's tee), 1 redirected, 2 redirected and filtered out.
    assert done.stdout.splitlines() == ["[default0]:SHELL-WORKER RANK=0 ROLE=default ARGS="]
    (run_dir,) = tmp_path.iterdir()
    # torchrun's --standalone replaces --rdzv-id by a fresh uuid, which names the run directory.
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}_\w+", run_dir.name), run_dir
    assert f"worker logs in {run_dir}" in done.stderr
    attempt = run_dir / "attempt_0"
    for rank in range(3):
        assert (attempt / str(rank) / "stdout.log").read_text() == f"SHELL-WORKER RANK={rank} ROLE=default ARGS=\n"
    assert (attempt / "filtered_stdout.log").read_text() == "SHELL-WORKER RANK=2 ROLE=default ARGS=\n"


def test_output_is_unprefixed_by_default_and_prefixed_on_request():
    plain = launch("--nproc-per-node", "2", "--standalone", "--no-python", SHELL)
    assert plain.returncode == 0, plain.stderr
    assert sorted(plain.stdout.splitlines()) == [f"SHELL-WORKER RANK={r} ROLE=default ARGS=" for r in range(2)]
    prefixed = launch("--nproc-per-node", "2", "--standalone", "--no-python", "--prefix-output", SHELL)
    assert sorted(prefixed.stdout.splitlines()) == [f"[rank{r}]: SHELL-WORKER RANK={r} ROLE=default ARGS="
                                                    for r in range(2)]


def test_pet_variables_set_flags_as_under_torchrun_and_flags_win():
    done = launch("--no-python", SHELL, env=base_env(PET_NPROC_PER_NODE="3", PET_STANDALONE="1", PET_ROLE="pet"))
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"SHELL-WORKER RANK={r} ROLE=pet ARGS=" for r in range(3)]
    done = launch("--nproc-per-node", "1", "--no-python", SHELL, env=base_env(PET_NPROC_PER_NODE="3"))
    assert done.stdout.splitlines() == ["SHELL-WORKER RANK=0 ROLE=default ARGS="]
    bad = launch("--no-python", SHELL, env=base_env(PET_MAX_RESTARTS="lots"))
    assert bad.returncode == 2 and "PET_MAX_RESTARTS='lots' (torchrun's variable for --max-restarts)" in bad.stderr


def test_an_unknown_flag_prints_the_launch_usage():
    done = launch("--nproc-per-node", "2", "--no-such-flag", SHELL)
    assert done.returncode == 2
    assert done.stderr.startswith("usage: ddpkit launch ") and "error: unrecognized arguments: --no-such-flag" in \
        done.stderr


@pytest.mark.parametrize("flags, message", [
    (["--rdzv-backend", "etcd"], "--rdzv-backend 'etcd' is not supported: use c10d"),
    (["--nnodes", "1:2"], "--nnodes 1:2 is a range, which needs the nodes to agree on their ranks: add "
                          "--rdzv-backend c10d"),
    (["--nnodes", "3:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h"], "--nnodes 3:2 must be N >= 1 or MIN:MAX"),
    (["--rdzv-backend", "c10d"], "--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT]"),
    (["--rdzv-endpoint", "h:99999"], "--rdzv-endpoint 'h:99999' is not HOST[:PORT]"),
    (["--rdzv-conf", "join_timeout=soon"], "--rdzv-conf join_timeout='soon' is not a valid value"),
    (["--rdzv-conf", "last_call_timeout"], "'last_call_timeout' is not KEY=VALUE"),
    (["--rdzv-conf", "keep_alive_interval=0.05,keep_alive_max_attempt=2"],
     "= 0.1 s: a node is judged gone after that long unheard, which must be at least 0.5 s"),
    (["--tee", "5"], "--tee '5': '5' is not 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"),
    (["--redirects", "4:1"], "--redirects '4:1': local rank 4 does not exist on this node (0..1)"),
    (["--local-ranks-filter", "0,x"], "--local-ranks-filter '0,x': list local ranks"),
    (["--local-ranks-filter", "2"], "local rank(s) [2] do not exist on this node (0..1)"),
    (["--signals-to-handle", "SIGTERM,SIGFOO"], "'SIGFOO' is not a signal the launcher can catch"),
    (["--signals-to-handle", "SIGKILL"], "'SIGKILL' is not a signal the launcher can catch"),
])
def test_bad_torchrun_values_name_the_flag(flags, message):
    done = launch("--nproc-per-node", "2", *flags, "--no-python", SHELL)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("ddpkit launch: error: ") and message in done.stderr, done.stderr


def test_flags_that_change_nothing_here_are_accepted_with_a_note():
    done = launch("--nproc-per-node", "1", "--standalone", "--run-path", "--numa-binding", "node",
                  "--logs-specs", "custom", "--event-log-handler", "console", "--rdzv-conf", "timeout=9,foo=1",
                  "--start-method", "fork", str(SCRIPTS / "report_env.py"))
    assert done.returncode == 0, done.stderr
    for note in ("--run-path: each worker runs the script as __main__", "--numa-binding node: not done by ddpkit",
                 "--logs-specs custom: ddpkit has no log plugins", "--event-log-handler console: ddpkit writes no",
                 "--rdzv-conf: foo not used by ddpkit's rendezvous", "--start-method fork: every worker is a new"):
        assert f"ddpkit launch: {note}" in done.stderr, done.stderr


@pytest.mark.parametrize("key", ["join_timeout", "timeout"])
def test_a_static_job_across_nodes_waits_for_node_0_as_long_as_rdzv_conf_says(key):
    # torchrun's static rendezvous reads --rdzv-conf timeout; ddpkit's took DDPKIT_TIMEOUT (300 s) whatever it said.
    start = time.monotonic()
    done = launch("--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
                  str(free_port()), "--nproc-per-node", "1", "--rdzv-conf", f"{key}=2", "--no-python", SHELL,
                  env=base_env(DDPKIT_JOB_TOKEN="0123456789abcdef0123456789abcdef"), timeout=120)
    assert done.returncode != 0 and time.monotonic() - start < 60
    assert "node 1 could not reach the rendezvous at 127.0.0.1:" in done.stderr and "within 2 s" in done.stderr
    # ddpkit's line alone: torch's client logged a C++ stack trace at each of its tries (41 lines in all)
    assert done.stderr.strip().count("\n") == 0, done.stderr


def test_an_elastic_node_that_cannot_reach_the_endpoint_says_so_in_one_line():
    done = launch("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                  "--rdzv-conf", "is_host=0,read_timeout=2", "--nproc-per-node", "1", "--no-python", SHELL,
                  env=base_env(DDPKIT_JOB_TOKEN="0123456789abcdef0123456789abcdef"), timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().startswith("ddpkit launch: error: could not reach the rendezvous at 127.0.0.1:")
    assert "within 2 s (ConnectionRefusedError)" in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr


def test_torchs_record_writes_the_error_file_the_launcher_reads(tmp_path):
    # torch's own @record is the writer: a worker whose stderr shows no traceback is still explained.
    worker = tmp_path / "recorded.py"
    worker.write_text(
        "import os, sys\n"
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "@record\n"
        "def main():\n"
        "    raise KeyError('shard 7 is missing')\n"
        "sys.stderr = open(os.devnull, 'w')\n"
        "main()\n"
    )
    error_file = tmp_path / "error.json"
    proc = subprocess.run([sys.executable, str(worker)], env=base_env(TORCHELASTIC_ERROR_FILE=str(error_file)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and json.loads(error_file.read_text())["message"]
    text = read_error_file(str(error_file))
    assert "Traceback" in text and "KeyError: 'shard 7 is missing'" in text
    assert read_error_file(str(tmp_path / "absent.json")) == ""

    own = tmp_path / "launcher_error.json"  # the launcher's own, as a scheduler (TorchX) gives torchrun
    done = launch("--nproc-per-node", "1", "--log-dir", str(tmp_path / "logs"), str(worker), cwd=tmp_path,
                  env=base_env(TORCHELASTIC_ERROR_FILE=str(own)))
    assert done.returncode == 1
    assert "Root cause: rank 0" in done.stderr and "KeyError: 'shard 7 is missing'" in done.stderr
    # torchrun's @record main copies the root cause there, its errorCode the worker's exit code
    copied = json.loads(own.read_text())["message"]
    assert copied["errorCode"] == 1 and "KeyError" in copied["message"], copied
    # --log-dir alone keeps the workers' error files in torchrun's layout, beside ddpkit's own logs
    [kept] = (tmp_path / "logs").glob("*/attempt_0/0/error.json")
    assert "shard 7 is missing" in kept.read_text()
    assert (tmp_path / "logs" / "attempt_0" / "rank0.log").is_file()


def test_a_listed_signal_is_forwarded_and_ends_the_launcher():
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", "--standalone",
                             "--signals-to-handle", "SIGTERM,SIGUSR1", str(SCRIPTS / "sleeper.py")],
                            env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        while len(pids) < 2:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            if line.startswith("SLEEPING"):
                pids.append(int(line.split()[1]))
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGUSR1
    assert "received SIGUSR1: stopping all workers" in err
    time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_virtual_local_rank_gives_each_worker_its_own_gpu_as_device_0():
    cfg = resolve(LaunchConfig(program=SHELL, no_python=True, nproc_per_node=2, virtual_local_rank=True))
    specs = plan_workers(cfg, master_port=29500, restart_count=0, base_env={"CUDA_VISIBLE_DEVICES": "4,6"})
    assert [(s.env["LOCAL_RANK"], s.env["CUDA_VISIBLE_DEVICES"], s.env["RANK"]) for s in specs] == [
        ("0", "4", "0"), ("0", "6", "1")]


def test_standalone_sets_master_addr_as_torchrun_does():
    done = launch("--nproc-per-node", "2", "--standalone", "--local-addr", "127.0.0.1", "--prefix-output",
                  str(SCRIPTS / "report_env.py"))
    assert done.returncode == 0, done.stderr
    assert {r["env"]["MASTER_ADDR"] for r in done.reports()} == {"127.0.0.1"}


def test_the_mpi_backend_is_checked_before_any_worker_starts(tmp_path, needs_mpi):
    # An mpirun of another MPI than mpi4py's would start ranks that each see a world of one: refused up front.
    from ddpkit.runtime import mpirun

    library = mpirun.library_of_mpi4py()
    other = "mpirun (Open MPI) 4.1.4" if "Open MPI" not in library else "HYDRA build details:"
    fake = tmp_path / "mpirun"
    fake.write_text(f"#!/bin/sh\necho '{other}'\n")
    fake.chmod(0o755)
    done = launch("--nproc-per-node", "2", str(SCRIPTS / "report_env.py"),
                  env=base_env(DDPKIT_BACKEND="mpi", DDPKIT_MPIRUN=str(fake)))
    assert done.returncode == 2 and "REPORT" not in done.stdout
    assert done.stderr.startswith(f"ddpkit launch: error: DDPKIT_BACKEND=mpi: {fake} is '{other}' and mpi4py "
                                  f"loads '{library}'"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_worker_command_lines_as_torchrun_builds_them(monkeypatch):
    # ${local_rank} in the arguments becomes the local rank and $$ a $; --local-rank-arg passes torch 2's
    # --local-rank=N; PYTHON_EXEC names the interpreter; TORCHELASTIC_SIGNALS_TO_HANDLE is set.
    monkeypatch.setenv("PYTHON_EXEC", "/opt/python3")
    cfg = LaunchConfig(program=str(SCRIPTS / "report_env.py"), args=["--lr=${local_rank}", "$$x", "${other}"],
                       nproc_per_node=2, local_rank_arg=True, master_port=29555)
    workers = plan_workers(resolve(cfg), master_port=29555, restart_count=0, base_env={})
    for w in workers:
        assert w.argv == ["/opt/python3", "-u", str(SCRIPTS / "report_env.py"), f"--local-rank={w.local_rank}",
                          f"--lr={w.local_rank}", "$x", "${other}"]
        assert w.env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def test_one_node_without_a_port_runs_standalone_as_torch_2_13s_torchrun(tmp_path):
    # Two such jobs at once on one machine: each takes a free port and a fresh run id (torch 2.13 does the
    # same); with --master-port given the static rendezvous and run id "none" stay.
    script = tmp_path / "ids.py"
    script.write_text("import os, time\ntime.sleep(1)\n"
                      "print('IDS', os.environ['MASTER_PORT'], os.environ['TORCHELASTIC_RUN_ID'])\n")
    procs = [subprocess.Popen([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "1", str(script)],
                              env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    ids = [out.split("IDS ")[1].split() for out, _ in outs]
    assert ids[0][0] != ids[1][0] and ids[0][1] != ids[1][1] and all(len(run) == 36 for _, run in ids)
    fixed = launch("--nproc-per-node", "1", "--master-port", "29573", str(script))
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.split("IDS ")[1].split() == ["29573", "none"]


def test_stdin_reaches_the_workers_and_background_children_outlive_a_successful_job(tmp_path):
    script = tmp_path / "w.py"
    marker = tmp_path / "marker"
    script.write_text("import os, subprocess, sys\n"
                      "print('READ', repr(sys.stdin.read()), flush=True)\n"
                      f"subprocess.Popen(['sh', '-c', 'sleep 1; touch {marker}'])\n")
    done = subprocess.run([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "1", str(script)],
                          env=base_env(), input="hello\n", capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "READ 'hello\\n'" in done.stdout
    deadline = time.monotonic() + 10
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists()  # torchrun leaves what a successful worker started in the background

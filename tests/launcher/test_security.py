"""Only the job can join: a loopback-only store for single-node jobs and a job secret (real launches)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.runtime.process import free_port
from ddpkit.runtime.rendezvous import job_keys
from tests.procs import SCRIPTS, base_env, descendants


def _listeners(port: int) -> list[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp and tcp6, like ``ss -ltn``)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, state = fields[1], fields[3]
            host, hex_port = address.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.append(host)
    return found


def _start_job(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, int]:
    job = subprocess.Popen([sys.executable, "-m", "ddpkit", "launch", *flags, "--nproc-per-node", "2", "--prefix-output",
                            str(SCRIPTS / "guarded.py"), str(tmp_path)],
                           env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "port").exists():
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline, "the job never met"
        time.sleep(0.1)
    return job, int((tmp_path / "port").read_text())


def _intruder(port: int, **env: str) -> subprocess.CompletedProcess:
    code = "import ddpkit; ddpkit.init(); print('JOINED')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=base_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       DDPKIT_TIMEOUT="10", **env))


@pytest.mark.slow("a job and a refused stranger process beside it")
def test_a_process_without_the_secret_is_refused_and_the_job_finishes(tmp_path):
    job, port = _start_job(tmp_path, "--standalone")
    try:
        # The store of a single-node job listens on loopback only.
        listening = _listeners(port)
        assert listening and all(h in ("0100007F", "00000000000000000000000001000000") for h in listening), listening
        for env, why in (({}, "presents none"), ({"DDPKIT_JOB_TOKEN": "guess"}, "is not the job's secret")):
            intruder = _intruder(port, **env)
            assert intruder.returncode == 1 and "JOINED" not in intruder.stdout
            assert "RendezvousError: rank 1 was refused by the rendezvous at 127.0.0.1:" in intruder.stderr
            assert why in intruder.stderr
        (tmp_path / "go").touch()
        out, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 0, err
    # The job's all-reduce saw its own two ranks only.
    assert out.count("[2.0, 2.0, 2.0]") == 2, out
    refused = [line for line in err.splitlines() if "the rendezvous refused a process" in line]
    assert len(refused) == 2 and all(line.startswith("[rank0]: ") for line in refused), err
    assert "claiming rank 1 without the job's secret" in refused[0] and "with another job's secret" in refused[1]


SECRET = "0123456789abcdef0123456789abcdef"
"""A secret long enough for a job across nodes (128 bits as hex)."""


@pytest.mark.slow("a launched job and its workers")
def test_the_launcher_passes_the_secret_file_and_not_the_rdzv_id(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    job, port = _start_job(tmp_path, "--rdzv-id", "job-42", "--job-secret-file", str(secret), "--master-port",
                           str(free_port()))
    try:
        guessed = _intruder(port, DDPKIT_JOB_TOKEN="job-42")  # the job's name, in every process list: not its secret
        assert guessed.returncode == 1 and "is not the job's secret" in guessed.stderr, guessed.stderr
        intruder = _intruder(port, DDPKIT_JOB_TOKEN=SECRET)
        # The right secret gets past the check; claiming a rank that is taken is then the error.
        assert intruder.returncode == 1 and "was refused" not in intruder.stderr
        assert "rank 1 is claimed by more than one process" in intruder.stderr, intruder.stderr
        (tmp_path / "go").touch()
        out, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 0, err


@pytest.mark.slow("a continuing job of two workers, and a stranger writing in its store")
def test_a_forged_done_mark_in_the_store_does_not_end_a_continuing_job_without_its_final_files(tmp_path):
    # Any client of the store (torch's TCPStore admits all) could set the mark that says the run's final files are
    # written: every member then ended, exit 0, and none wrote them (until 2026-12-02).
    from datetime import timedelta

    import torch.distributed as dist

    out, go = tmp_path / "written", tmp_path / "go"
    job = subprocess.Popen([sys.executable, "-m", "ddpkit", "launch", "--standalone", "--nproc-per-node", "2",
                            "--on-failure", "continue", str(SCRIPTS / "ft_writer.py")],
                           env=base_env(OUT=str(out), GO_FILE=str(go)), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        ports: list[int] = []
        while not ports:  # the store's port, from a worker's environment (as anyone on the machine may read it)
            assert job.poll() is None and time.monotonic() < deadline, "the job ended, or never started its workers"
            for pid in descendants(job.pid):
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                ports += [int(v.split(b"=", 1)[1]) for v in environ if v.startswith(b"MASTER_PORT=")]
            time.sleep(0.05)
        stranger = dist.TCPStore("127.0.0.1", ports[0], is_master=False, timeout=timedelta(seconds=30),
                                 wait_for_workers=False)
        arrived: list[str] = []
        while not arrived:  # the first view's group met: its keys name the membership's place in the store
            assert job.poll() is None and time.monotonic() < deadline, "the job ended, or its group never met"
            arrived = [k for k in stranger.list_keys() if "/ft/" in k and k.rsplit("/", 2)[-2] == "arrived"]
            time.sleep(0.05)
        forged = {k.rsplit("/", 3)[0] + "/final/1/done" for k in arrived}
        for key in forged:
            stranger.set(key, "done")
        go.touch()
        stdout, stderr = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert "WRITING member 0" in stdout and out.read_text() == "0 [0, 1]\n", (stdout, stderr[-2000:])


def test_job_keys_hide_the_prefix_behind_the_verifier():
    verifier, prefix = job_keys("s3cret")
    assert verifier != job_keys("other")[0] and "s3cret" not in verifier + prefix
    assert prefix.startswith("ddpkit/") and prefix[7:-1] not in verifier
    assert job_keys(None) == ("none", "ddpkit/")


def test_the_verifier_is_no_fast_hash_of_the_secret():
    # What the store shows is derived through scrypt (memory-hard), not sha256 of the secret: a dictionary of guesses
    # costs a scrypt each, as against the plain hash the store published before.
    import hashlib
    import hmac

    from ddpkit.runtime.discovery import job_key

    verifier = job_keys(SECRET)[0]
    assert verifier != hashlib.sha256(f"ddpkit verifier {SECRET}".encode()).hexdigest()
    key = hashlib.scrypt(SECRET.encode(), salt=b"ddpkit job secret v1", n=1 << 14, r=8, p=1, dklen=32)
    assert job_key(SECRET) == key and verifier == hmac.new(key, b"ddpkit verifier", "sha256").hexdigest()


@pytest.mark.parametrize("env, flags, message", [
    ({}, [], "--nnodes 2: a job across nodes needs a secret that only its launchers hold"),
    ({"DDPKIT_JOB_TOKEN": "my-job"}, [], "the job's secret has 6 characters: across nodes it needs at least 32"),
    ({}, ["--rdzv-id", "a-long-job-name-that-is-no-secret-at-all"], "a job across nodes needs a secret"),
])
def test_a_job_across_nodes_without_a_secret_of_128_bits_is_refused_in_one_line(env, flags, message):
    done = subprocess.run([sys.executable, "-m", "ddpkit", "launch", "--nnodes", "2", "--node-rank", "0",
                           "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           *flags, str(SCRIPTS / "nodes.py")], env=base_env(**env), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "secrets.token_hex(16)" in lines[0], lines


@pytest.mark.slow("a job and a refused stranger launcher beside it")
def test_a_node_with_another_secret_is_refused_before_any_worker_and_the_job_goes_on():
    import os
    import signal

    port = free_port()

    def node(rank: int, secret: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "ddpkit", "launch", "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node",
             "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-id", "job",
             str(SCRIPTS / "nodes.py"), "crash"],
            env=base_env(CRASH_RANK="9", DDPKIT_JOB_TOKEN=secret), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True)

    first = node(0, SECRET)
    procs = [first]
    try:
        time.sleep(2)
        intruder = node(1, SECRET[::-1])
        procs.append(intruder)
        out, err = intruder.communicate(timeout=60)
        assert intruder.returncode == 2, err
        assert err.strip().splitlines() == [
            f"ddpkit launch: error: the job at 127.0.0.1:{port} refused this node: it was started with another "
            "secret (DDPKIT_JOB_TOKEN, --job-secret-file): give every node the same, or choose another "
            "--master-port / --rdzv-endpoint for a job of its own"]
        assert "PID" not in out  # no worker started
        second = node(1, SECRET)
        procs.append(second)
        results = [p.communicate(timeout=120) for p in (first, second)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert first.returncode == 0 and second.returncode == 0, results
    assert "DONE 0 round 0" in results[0][0] and "DONE 1 round 0" in results[1][0]
    assert "refused a launcher on " in results[0][1] and "joining as node 1 with another job's secret" in results[0][1]


INTRUDER = """
import re, sys, time
from datetime import timedelta
import torch, torch.distributed as dist

port = int(sys.argv[1])
client = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30), wait_for_workers=False)
prefix = None
while prefix is None:  # torch's store lists every key to any client: the job's secret prefix among them
    prefix = next((m.group(1) for k in client.list_keys() if (m := re.match(r"(ddpkit/[0-9a-f]{32}/0/)/claim/0$", k))),
                  None)
    time.sleep(0.05)
print("PREFIX", prefix, flush=True)
store = dist.PrefixStore(prefix, client)
store.add("claim/1", 1)  # the census, as rank 1 would answer it
store.add("joined", 1)
dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timedelta(seconds=20))
weight = torch.zeros(4)
dist.broadcast(weight, src=0)
print("RECEIVED", weight.tolist(), flush=True)
"""

VICTIM = """
import torch, torch.distributed as dist
import ddpkit
ddpkit.init()
weight = torch.arange(4.0)
dist.broadcast(weight, src=0)
print("TRAINED", flush=True)
"""


def test_an_intruder_that_reads_the_prefix_in_the_store_joins_no_group_and_receives_nothing(tmp_path):
    # Found by a review: torch's TCPStore lists every key to any client, the job's secret prefix included; an
    # intruder without the secret claimed rank 1 of a job whose node 1 had not started yet, put its gloo address
    # in the store, and received the weights (then poisoned the gradients). Every value the job reads from the
    # store is now sealed with its secret: the forged address is refused by name, and the intruder gets nothing.
    import os
    import signal

    port = free_port()
    (tmp_path / "victim.py").write_text(VICTIM)
    node = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "launch", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1",
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-id", "job", str(tmp_path / "victim.py")],
        env=base_env(DDPKIT_JOB_TOKEN=SECRET, DDPKIT_TIMEOUT="30"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        intruder = subprocess.run([sys.executable, "-c", INTRUDER, str(port)], env=base_env(), capture_output=True,
                                  text=True, timeout=90)
        out, err = node.communicate(timeout=90)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
    assert "PREFIX ddpkit/" in intruder.stdout, intruder.stderr  # it did read the prefix
    assert "RECEIVED" not in intruder.stdout and intruder.returncode != 0
    assert "TRAINED" not in out and node.returncode != 0
    assert "RendezvousError: rank 0: the value under the job's key '" in err, err  # (gloo's key of rank 1's address)
    assert "' was not written by a process holding the job's secret" in err, err


@pytest.mark.parametrize("mode, said", [(0o600, False), (0o620, False), (0o640, True), (0o644, True)])
def test_a_secret_file_other_users_can_read_is_said_in_one_line(tmp_path, capsys, mode: int, said: bool):
    # ssh refuses such a private key; a shared cluster file system may need a group to read it: said, not refused.
    from ddpkit.launcher.job import job_token
    from ddpkit.launcher.launch_config import LaunchConfig
    from ddpkit.launcher.settings import resolve

    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(mode)
    config = LaunchConfig(program=str(SCRIPTS / "nodes.py"), nnodes="2", node_rank=0, master_addr="127.0.0.1",
                          master_port=1, job_secret_file=secret)
    assert job_token(resolve(config)) == SECRET
    err = capsys.readouterr().err
    assert (f"--job-secret-file {secret} can be read by other users of this machine (mode {mode:04o}): whoever of "
            f"them reaches it and the job's ports can join the job; chmod 600 {secret}" in err) is said, err


@pytest.mark.slow("two launchers and their workers, a stranger writing in their store, a crash")
def test_a_stranger_raising_the_failure_counter_does_not_hide_the_first_failure_from_the_other_nodes(tmp_path):
    # The first failure of a round was claimed by a counter, which any client of the store could raise: the node
    # that failed then took another's claim for granted, wrote nothing, and the other node named its own worker's
    # broken connection as the root cause (until 2026-12-02).
    from tests.launcher.test_node_failures import _finish, _node

    port, go = free_port(), tmp_path / "go"
    procs = [_node(n, port, "crash", CRASH_RANK="1", GO_FILE=str(go)) for n in (0, 1)]
    try:
        stranger, place = _launchers_store(port, procs)
        stranger.add(place + "failed/0/count", 1)
        stranger.add(place + "failed/0/count", 1)
        go.touch()
    finally:
        outs = _finish(procs, timeout=90)
    (_, err0), (_, err1) = outs
    assert "RuntimeError: deliberate failure on rank 1" in err1 and "Root cause: rank 1" in err1, err1[-2000:]
    assert "node 1, rank 1, failed first: exit code 1" in err0, err0[-3000:]


@pytest.mark.slow("two launchers and their workers, a stranger writing in their store, a node killed")
def test_a_forged_done_mark_does_not_hide_a_killed_node_from_the_others(tmp_path):
    # A node that said it was done is not judged silent: any client of the store could make that mark (its key
    # existing sufficed), and the killed node's silence then went unnoticed (until 2026-12-02).
    import os
    import signal

    from tests.launcher.test_node_failures import _finish, _node

    port = free_port()
    procs = [_node(n, port, "long", DDPKIT_TIMEOUT="60") for n in (0, 1)]
    try:
        procs[0].wait_for("TRAINING 0 round 0")
        stranger, place = _launchers_store(port, procs)
        stranger.set(place + "done/0/1", "ok")
        worker = int(subprocess.run(["pgrep", "-f", "-P", str(procs[1].pid), "nodes.py"], capture_output=True,
                                    text=True).stdout.split()[0])
        os.killpg(procs[1].pid, signal.SIGKILL)
        os.killpg(worker, signal.SIGKILL)
        _, err0 = procs[0].communicate(timeout=60)
    finally:
        _finish(procs, timeout=1)
    assert procs[0].returncode == 1
    assert "node 1 failed first: its launcher stopped answering" in err0, err0[-3000:]


def _launchers_store(port: int, procs: list) -> tuple[object, str]:
    """A client of the launchers' store at ``port`` (as any process that reaches it), and the launchers' place in it
    (read from the keys of the first round, as anyone may list them)."""
    from datetime import timedelta

    import torch.distributed as dist

    stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)
    deadline, joined = time.monotonic() + 60, []
    while not joined:
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "the job never met"
        joined = [k for k in stranger.list_keys() if k.endswith("joined/0/0")]
        time.sleep(0.05)
    return stranger, joined[0][: -len("joined/0/0")]


def test_a_heartbeat_deleted_or_put_back_older_is_not_believed():
    # A node was judged by the heartbeat the store held: a store client that deleted a dead node's hid it (never
    # judged silent), and one that put back an older sealed beat had a live node judged silent (until 2026-12-02).
    from ddpkit.launcher.node_rendezvous import NodeRendezvous

    port = free_port()
    common = {"host": "127.0.0.1", "port": port, "nnodes": 2, "token": SECRET, "timeout_s": 10.0, "beat_s": 60.0}
    node0 = NodeRendezvous(node=0, stale_s=0.5, **common)
    node1 = NodeRendezvous(node=1, **common)
    try:
        node0.begin(0)
        node1.begin(0)
        stranger, place = _launchers_store(port, [])
        old = stranger.get(place + "alive/1")  # sealed, as the store holds it
        assert node0.silent_nodes(0) == []
        time.sleep(0.6)
        node1.begin(0)  # a beat newer than the old one, as a live node's (its thread beats once a minute here)
        assert node0.silent_nodes(0) == []
        stranger.set(place + "alive/1", old)  # put back: it opens under the secret, but node 0 read a newer one
        assert node0.silent_nodes(0) == []
        stranger.delete_key(place + "alive/1")  # node 1 beats no more: dead, and its heartbeat hidden
        time.sleep(0.6)
        assert [n for n, _ in node0.silent_nodes(0)] == [1]
    finally:
        node1.close()
        node0.close()

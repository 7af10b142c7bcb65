"""Launch planning and configuration, pure: no process is started.

What was typed is a ``LaunchConfig`` (checked on its own); what the launch runs with is ``resolve(config)``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpkit.launcher import LaunchConfig, plan_workers, resolve
from ddpkit.runtime.options import ConfigError

SCRIPT = __file__


def test_multi_node_ranks_and_env_contract():
    cfg = LaunchConfig(program=SCRIPT, args=["--lr", "0.1"], nproc_per_node=4, nnodes=3, node_rank=2,
                       master_addr="node0", master_port=1234, max_restarts=2)
    workers = plan_workers(resolve(cfg), master_port=1234, restart_count=1, base_env={"PATH": "/bin"})
    assert [w.rank for w in workers] == [8, 9, 10, 11]
    env = workers[1].env
    assert env["RANK"] == "9" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "12"
    assert env["LOCAL_WORLD_SIZE"] == "4" and env["GROUP_RANK"] == "2" and env["GROUP_WORLD_SIZE"] == "3"
    assert env["MASTER_ADDR"] == "node0" and env["MASTER_PORT"] == "1234"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "1" and env["TORCHELASTIC_MAX_RESTARTS"] == "2"
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == "/bin"
    assert workers[1].argv[-3:] == [SCRIPT, "--lr", "0.1"]


def test_workers_get_the_torchelastic_variables_torchrun_sets():
    cfg = LaunchConfig(program=SCRIPT, nproc_per_node=2)
    env = plan_workers(resolve(cfg), master_port=1, restart_count=0, base_env={}, run_id="job7", job_token="s")[0].env
    assert env["TORCHELASTIC_RUN_ID"] == "job7" and env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["DDPKIT_JOB_TOKEN"] == "s"
    many = plan_workers(resolve(cfg), master_port=1, restart_count=0, base_env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"},
                        agent_store=True)[0].env
    # torch compares with str(True): a raw torch script then connects to the launchers' store.
    assert many["TORCHELASTIC_USE_AGENT_STORE"] == "True" and many["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert many["TORCHELASTIC_RUN_ID"] == "none"


def test_user_thread_setting_is_kept_and_single_worker_untouched():
    cfg = LaunchConfig(program=SCRIPT, nproc_per_node=2)
    assert plan_workers(resolve(cfg), master_port=1, restart_count=0, base_env={"OMP_NUM_THREADS": "4"})[0].env[
        "OMP_NUM_THREADS"] == "4"
    one = LaunchConfig(program=SCRIPT, nproc_per_node=1)
    assert "OMP_NUM_THREADS" not in plan_workers(resolve(one), master_port=1, restart_count=0, base_env={})[0].env


def test_local_rank_arg_and_module_argv():
    cfg = LaunchConfig(program=SCRIPT, args=["x"], nproc_per_node=2, local_rank_arg=True)
    argv = plan_workers(resolve(cfg), master_port=1, restart_count=0, base_env={})[1].argv
    assert argv[-3:] == [SCRIPT, "--local-rank=1", "x"]  # torch 2 spelling, as torch.distributed.launch
    mod = LaunchConfig(program="json.tool", module=True)
    assert plan_workers(resolve(mod), master_port=1, restart_count=0, base_env={})[0].argv[-2:] == ["-m", "json.tool"]


def test_nproc_words_count_as_torchrun_does():
    import os

    import torch
    from torch.distributed.run import determine_local_world_size

    cores = len(os.sched_getaffinity(0))
    assert resolve(LaunchConfig(program=SCRIPT, nproc_per_node="cpu")).nproc == cores
    for word in ("cpu", "auto"):
        assert resolve(LaunchConfig(program=SCRIPT, nproc_per_node=word)).nproc == determine_local_world_size(word)
    if torch.cuda.is_available():
        assert resolve(LaunchConfig(program=SCRIPT, nproc_per_node="gpu")).nproc == torch.cuda.device_count()
    else:
        with pytest.raises(ConfigError, match="--nproc-per-node gpu: CUDA is not available"):
            resolve(LaunchConfig(program=SCRIPT, nproc_per_node="gpu"))


def test_standalone_binds_loopback():
    assert resolve(LaunchConfig(program=SCRIPT, standalone=True, master_addr="10.0.0.1")).master_addr == "127.0.0.1"
    # One node with no port and no endpoint runs as --standalone (torch 2.13's torchrun); the config keeps
    # what was typed.
    typed = LaunchConfig(program=SCRIPT, nproc_per_node="auto")
    assert typed.standalone is False and typed.nproc_per_node == "auto" and resolve(typed).standalone is True


@pytest.mark.parametrize("kwargs, message", [
    ({"nproc_per_node": 0}, "--nproc-per-node 0 must be at least 1"),
    ({"nproc_per_node": "many"}, "--nproc-per-node 'many' is not a number"),
    ({"nnodes": 2, "node_rank": 2}, "--node-rank 2 is out of range for --nnodes 2: use 0..1"),
    ({"nnodes": 0}, "--nnodes 0"),
    ({"max_restarts": -1}, "--max-restarts -1"),
    ({"master_port": 0}, "--master-port 0"),
    ({"standalone": True, "nnodes": 2}, "--standalone runs this node alone"),
    ({"program": "no/such/script.py"}, "script 'no/such/script.py' does not exist"),
    ({"program": "no_such_module_xyz", "module": True}, "module 'no_such_module_xyz' cannot be found"),
])
def test_bad_configuration_names_the_value_and_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve(LaunchConfig(**{"program": SCRIPT, **kwargs}))


def test_the_typed_config_does_no_io():
    # A script that is not there, a word that needs torch to count GPUs: the typed config takes both, and
    # only resolve() looks at the machine.
    cfg = LaunchConfig(program="no/such/script.py", nproc_per_node="gpu")
    with pytest.raises(ConfigError, match="no/such/script.py|CUDA is not available"):
        resolve(cfg)


def test_torchrun_flags_no_python_role_shutdown_timeout_and_accepted_ones():
    sh = str(Path(__file__).parents[1] / "scripts" / "print_env.sh")
    cfg = LaunchConfig(program=sh, args=["a"], no_python=True, role="trainer", grace_period_s=2.5, nproc_per_node=2)
    launch = resolve(cfg)
    worker = plan_workers(launch, master_port=1, restart_count=0, base_env={})[1]
    assert worker.argv == [sh, "a"] and worker.env["ROLE_NAME"] == "trainer"
    assert launch.grace_period_s == 2.5 and launch.notes() == []
    noted = resolve(LaunchConfig(program=SCRIPT, monitor_interval=5, start_method="fork")).notes()
    assert noted[0].startswith("--monitor-interval 5: not needed") and noted[1].startswith("--start-method fork:")
    for kwargs, message in (({"no_python": True, "module": True}, "--no-python and -m cannot go together"),
                            ({"monitor_interval": 0}, "--monitor-interval 0 must be a positive"),
                            ({"grace_period_s": -1}, "--shutdown-timeout -1 must be a finite number of seconds, 0 or "
                                                     "more"),
                            # infinite: accepted until 2026-12-02 (a keep-alive's beat thread then died of it)
                            ({"monitor_interval": float("inf")}, "--monitor-interval inf must be a positive, finite"),
                            ({"grace_period_s": float("inf")}, "--shutdown-timeout inf must be a finite number"),
                            ({"rdzv_conf": "keep_alive_interval=inf"},
                             "--rdzv-conf keep_alive_interval=inf must be a positive, finite number of seconds"),
                            ({"role": " "}, "--role is empty")):
        with pytest.raises(ConfigError, match=message):
            resolve(LaunchConfig(program=SCRIPT, **kwargs))
    # torchrun's grace: TORCH_ELASTIC_SHUTDOWN_TIMEOUT when the flag is not given, else 30 s.
    assert resolve(LaunchConfig(program=SCRIPT)).grace_period_s == 30
    assert resolve(LaunchConfig(program=SCRIPT), {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}).grace_period_s == 7
    assert resolve(LaunchConfig(program=SCRIPT, grace_period_s=2.5), {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}) \
        .grace_period_s == 2.5
    with pytest.raises(ConfigError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon' is not a number of seconds"):
        resolve(LaunchConfig(program=SCRIPT), {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"})
    with pytest.raises(ConfigError, match="neither a file nor a command on PATH"):
        resolve(LaunchConfig(program="no-such-binary-xyz", no_python=True))
    assert resolve(LaunchConfig(program="true", no_python=True)).config.program == "true"


def test_a_program_is_checked_as_the_workers_will_start_it(tmp_path, monkeypatch):
    # --no-python: a file in the working directory given without ./ and a file without the execute bit passed the
    # check and failed in Popen with the launcher's own traceback. A folder holding __main__.py (python runs it,
    # torchrun's workers do) was refused as a script that "does not exist".
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.sh").write_text("#!/bin/sh\necho hi\n")
    with pytest.raises(ConfigError, match="'run.sh' is in .* but not a command on PATH: give ./run.sh"):
        resolve(LaunchConfig(program="run.sh", no_python=True))
    with pytest.raises(ConfigError, match=r"'./run.sh' is not executable: chmod \+x ./run.sh"):
        resolve(LaunchConfig(program="./run.sh", no_python=True))
    (tmp_path / "run.sh").chmod(0o755)
    assert resolve(LaunchConfig(program="./run.sh", no_python=True)).no_python
    (tmp_path / "app").mkdir()
    with pytest.raises(ConfigError, match="script 'app' does not exist"):
        resolve(LaunchConfig(program="app"))
    (tmp_path / "app" / "__main__.py").write_text("print('main')\n")
    assert resolve(LaunchConfig(program="app")).config.program == "app"


def test_a_module_is_found_without_running_its_package_in_the_launcher(tmp_path, monkeypatch):
    # torchrun never imports the program; find_spec("pkg.mod") imports pkg, whose __init__ ran in the launcher.
    pkg = tmp_path / "sideeffect_pkg"
    (pkg / "inner").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\n")
    (pkg / "inner" / "__init__.py").write_text("")
    (pkg / "inner" / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    for name in ("sideeffect_pkg.inner.train", "sideeffect_pkg.inner", "sideeffect_pkg"):
        resolve(LaunchConfig(program=name, module=True))
    assert not (tmp_path / "ran").exists()
    # (a name not in its packages' folders is looked for once more through the import system, which imports them:
    # a package may extend its path when imported)
    for name in ("sideeffect_pkg.inner.nope", "sideeffect_pkg.nope.train", "sideeffect_pkg.inner.train.x"):
        with pytest.raises(ConfigError, match=f"module '{name}' cannot be found"):
            resolve(LaunchConfig(program=name, module=True))


@pytest.mark.parametrize("value, serves", [("yes", True), ("Y", True), ("t", True), ("1", True), ("TRUE", True),
                                           ("no", False), ("n", False), ("F", False), ("0", False)])
def test_is_host_takes_torchs_spellings(value, serves):
    assert resolve(LaunchConfig(program=SCRIPT, rdzv_conf=f"is_host={value}")).conf["is_host"] is serves


def test_the_servers_channel_port_on_one_node_is_never_the_rendezvous_port(monkeypatch: pytest.MonkeyPatch):
    # The rendezvous port is found free before rank 0 serves it: a second search may return it again (the OS
    # picks from the free ones). The plan takes two ports at once and keeps one that is not the rendezvous'.
    from ddpkit.launcher import plan

    cfg = LaunchConfig(program=SCRIPT, nproc_per_node=2, num_servers=1)
    monkeypatch.setattr(plan, "free_ports", lambda count: [4321, 4322][:count])
    for master_port, channel in ((4321, "4322"), (4322, "4321"), (5000, "4321")):
        envs = [w.env for w in plan_workers(resolve(cfg), master_port=master_port, restart_count=0, base_env={})]
        assert {env["DDPKIT_PS_PORT"] for env in envs} == {channel}, master_port
    given = plan_workers(resolve(cfg), master_port=4321, restart_count=0, base_env={"DDPKIT_PS_PORT": "4321"})
    assert given[0].env["DDPKIT_PS_PORT"] == "4321"  # the user's word stands (and their error is theirs to see)

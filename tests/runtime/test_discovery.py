"""Environment discovery for every launcher scheme, without starting processes."""

import pytest

from ddpkit.runtime.discovery import DEFAULT_PORT, discover, expand_nodelist


def test_no_environment_is_a_world_of_one():
    p = discover({})
    assert (p.rank, p.world_size, p.local_rank, p.local_world_size, p.scheme) == (0, 1, 0, 1, "single")


def test_torchrun_env():
    p = discover({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                  "GROUP_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "1234"})
    assert (p.rank, p.world_size, p.local_rank, p.local_world_size, p.node_rank) == (5, 8, 1, 4, 1)
    assert (p.master_addr, p.master_port, p.scheme) == ("node0", 1234, "env")


def test_openmpi_env_single_node_defaults_to_loopback_and_default_port():
    p = discover({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                  "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (p.rank, p.world_size, p.local_rank, p.scheme) == (1, 2, 1, "openmpi")
    assert (p.master_addr, p.master_port) == ("127.0.0.1", DEFAULT_PORT)


def test_openmpi_multi_node_needs_master_addr():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        discover(env)
    assert discover(env, master_needed=False).master_addr == "127.0.0.1"  # the mpi backend meets over MPI
    p = discover({**env, "MASTER_ADDR": "host0", "MASTER_PORT": "4000"})
    assert (p.node_rank, p.master_addr, p.master_port) == (1, "host0", 4000)


def test_pmi_env():
    p = discover({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
                  "MASTER_ADDR": "h0"})
    assert (p.rank, p.world_size, p.local_rank, p.local_world_size, p.node_rank, p.scheme) == (2, 4, 0, 2, 1, "pmi")


def test_slurm_env_takes_master_from_compressed_nodelist():
    p = discover({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
                  "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_NODELIST": "gpu[07-10],cpu1", "SLURM_STEP_ID": "0"})
    assert (p.rank, p.world_size, p.local_rank, p.local_world_size, p.node_rank) == (5, 8, 1, 2, 2)
    assert (p.master_addr, p.master_port, p.scheme) == ("gpu07", DEFAULT_PORT, "slurm")


def test_slurm_uneven_tasks_per_node():
    p = discover({"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
                  "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_NODELIST": "n1", "SLURM_STEPID": "3",
                  "MASTER_ADDR": "explicit"})
    assert (p.local_world_size, p.master_addr) == (1, "explicit")


def test_slurm_batch_shell_without_step_is_single_process():
    # sbatch sets SLURM_PROCID/NTASKS in the batch shell too; only srun started the tasks.
    assert discover({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]"}).scheme == "single"


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
    ("single", ["single"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0"}, "WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, "RANK is not"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "rank 2 is outside the world of 2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR is not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT 70000"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h"},
     "local rank 3"),
])
def test_bad_environment_names_the_value(env, message):
    with pytest.raises(ValueError, match=message):
        discover(env)

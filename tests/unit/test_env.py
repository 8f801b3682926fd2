"""The job environment model: one mapping from launcher, torchrun, Slurm or local variables."""
import pytest

from hpcft.env import in_allocation, job_env, port_for_job, tasks_per_node
from hpcft.errors import ConfigError

SLURM_STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "n[1-3]",
    "SLURM_STEP_NODELIST": "n[1-3]",
    "SLURMD_NODENAME": "n3",
    "SLURM_PROCID": "4",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "2",
    "SLURM_NTASKS": "5",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
    "SLURM_RESTART_COUNT": "1",
}


def test_slurm_step():
    env = job_env(SLURM_STEP)
    assert (env.source, env.job_id, env.rank, env.world_size, env.node_rank) == ("slurm", "4242", 4, 5, 2)
    assert env.local_world_size == 1 and env.restart_count == 1
    assert env.nodelist == ["n1", "n2", "n3"] and env.master_addr == "n1"
    assert env.master_port == port_for_job("4242")


def test_hpcft_launcher_overrides_slurm():
    # The launcher owns the slot layout: a spare in slot 0 keeps rank 0 whatever SLURM_PROCID says.
    env = job_env({**SLURM_STEP, "HPCFT_RANK": "0", "HPCFT_WORLD_SIZE": "5", "HPCFT_JOB_ID": "4242",
                   "HPCFT_NODELIST": "n5,n2,n3", "MASTER_ADDR": "n5", "MASTER_PORT": "31000"})
    assert (env.source, env.rank, env.master_addr, env.master_port) == ("hpcft", 0, "n5", 31000)
    assert env.nodelist == ["n5", "n2", "n3"]


def test_torchrun():
    env = job_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                   "MASTER_ADDR": "h0", "MASTER_PORT": "1234", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert (env.source, env.rank, env.local_rank, env.node_rank, env.restart_count) == ("torchrun", 3, 1, 1, 2)


def test_local():
    env = job_env({})
    assert (env.source, env.rank, env.world_size, env.job_id) == ("local", 0, 1, "local")
    assert not in_allocation({}) and in_allocation(SLURM_STEP)


def test_tasks_per_node():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("8") == [8]
    with pytest.raises(ConfigError, match="tasks per node"):
        tasks_per_node("2(y3)")


def test_bad_integer_is_named():
    with pytest.raises(ConfigError, match="SLURM_PROCID"):
        job_env({**SLURM_STEP, "SLURM_PROCID": "four"})


def test_port_is_stable_and_in_range():
    assert port_for_job("17") == port_for_job("17")
    assert 20000 <= port_for_job("x-local") < 40000

"""SLURM host lists and torchrun-style variables from a SLURM step."""

from __future__ import annotations

import os

import pytest

from loom.config import ConfigError
from loom.runtime.env import env_from_slurm, expand_nodelist, expand_tasks_per_node, init_distributed

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("node[1-2]", ["node1", "node2"]),
        ("a,b", ["a", "b"]),
        ("single", ["single"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("x[3],y[1-2]", ["x3", "y1", "y2"]),
        ("rack[1-2]-gpu[1-2]", ["rack1-gpu1", "rack1-gpu2", "rack2-gpu1", "rack2-gpu2"]),
        ("gpu[1-2]-ib,cpu", ["gpu1-ib", "gpu2-ib", "cpu"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("4") == [4]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def slurm(**extra) -> dict[str, str]:
    """The variables ``srun --ntasks-per-node 4`` sets for task 6 of 8 on the second of two nodes."""
    env = {
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "PATH": "/usr/bin",
    }
    env.update(extra)
    return env


def test_env_from_slurm():
    assert env_from_slurm(slurm()) == {
        "RANK": "6",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(20000 + 123456 % 20000),
    }


def test_env_from_slurm_prefers_the_step_and_explicit_master():
    env = env_from_slurm(
        slurm(
            SLURM_STEP_NODELIST="gpu[08,11]",
            SLURM_STEP_NUM_TASKS="5",
            SLURM_STEP_TASKS_PER_NODE="3,2",
            MASTER_ADDR="head",
            MASTER_PORT="29400",
        )
    )
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("head", "29400")
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("5", "2")  # node 1 of the step runs 2 tasks


def test_existing_rank_wins_and_no_slurm_means_nothing():
    assert env_from_slurm(slurm(RANK="0", WORLD_SIZE="2")) == {}  # torchrun inside an allocation
    assert env_from_slurm({"PATH": "/usr/bin", "SLURM_JOB_ID": "5"}) == {}  # salloc shell, not a task


@pytest.fixture
def clean_env(monkeypatch):
    """Remove (and restore afterwards) every variable these tests or init_distributed may set."""
    for var in TORCHRUN_VARS + tuple(k for k in os.environ if k.startswith("SLURM_")):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_init_distributed_from_a_one_task_slurm_step(clean_env):
    for k, v in slurm(
        SLURM_PROCID="0",
        SLURM_NTASKS="1",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
        SLURM_TASKS_PER_NODE="1",
        SLURM_JOB_NODELIST="localhost",
    ).items():
        clean_env.setenv(k, v)
    env = init_distributed("cpu", "auto")
    assert (env.rank, env.local_rank, env.world_size, env.device.type) == (0, 0, 1, "cpu")
    assert (os.environ["RANK"], os.environ["MASTER_ADDR"]) == ("0", "localhost")


def test_cli_precheck_uses_the_slurm_world_size(clean_env):
    """``srun -n 2 loom train ...``: each task checks the batch against 2 data-parallel ranks."""
    from loom.cli.preflight import load_config, precheck
    from loom.runtime.launch import env_world_size

    for k, v in slurm(SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_NODEID="0").items():
        clean_env.setenv(k, v)
    assert env_world_size() == 2
    cfg, _ = load_config(["--training.global_batch_size", "6", "--training.micro_batch_size", "3"])
    precheck(cfg, env_world_size())  # 6 = 3 x 2 x 1: fine
    cfg, _ = load_config(["--training.global_batch_size", "6", "--training.micro_batch_size", "2"])
    with pytest.raises(ConfigError, match=r"2 x 2 = 4"):
        precheck(cfg, env_world_size())


def test_cuda_device_without_cuda_is_a_config_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(ConfigError, match="run.device = 'cuda': no CUDA device is visible"):
        init_distributed("cuda", "auto")

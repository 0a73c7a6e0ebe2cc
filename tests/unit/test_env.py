"""SLURM host lists, and torchrun-style variables from a SLURM step or from mpirun's ranks (Open MPI, MPICH)."""

from __future__ import annotations

import os

import pytest

from loom.config import ConfigError
from loom.runtime.env import (
    env_from_launcher,
    env_from_mpi,
    env_from_slurm,
    expand_nodelist,
    expand_tasks_per_node,
    init_distributed,
)

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
    prefixes = ("SLURM_", "OMPI_COMM_WORLD_", "PMI_", "MPI_LOCAL")
    for var in TORCHRUN_VARS + tuple(k for k in os.environ if k.startswith(prefixes)):
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


# ---- mpirun's ranks ------------------------------------------------------------------------------------------


def openmpi(rank: int, world: int, local: int, local_world: int, **extra) -> dict[str, str]:
    """The variables Open MPI's ``mpirun -np WORLD`` gives one rank."""
    env = {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(world),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_world),
        "OMPI_COMM_WORLD_NODE_RANK": str(rank // local_world),
        "PATH": "/usr/bin",
    }
    return {**env, **extra}


def test_env_from_openmpi_on_two_hosts_takes_the_users_master():
    env = env_from_mpi(openmpi(5, 8, 1, 4, MASTER_ADDR="gpu01", MASTER_PORT="29400"))
    assert env == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu01",
        "MASTER_PORT": "29400",
    }
    # several hosts and no MASTER_ADDR: nothing is guessed (init_distributed says what to pass)
    assert "MASTER_ADDR" not in env_from_mpi(openmpi(5, 8, 1, 4))


def test_env_from_openmpi_on_one_host_meets_locally():
    env = env_from_mpi(openmpi(1, 2, 1, 2))
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "2", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29500")


def test_env_from_mpich_and_intel_mpi():
    # MPICH's hydra / Intel MPI: PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
    hydra = {
        "PMI_RANK": "3",
        "PMI_SIZE": "4",
        "MPI_LOCALRANKID": "1",
        "MPI_LOCALNRANKS": "2",
        "MASTER_ADDR": "h0",
    }
    env = env_from_mpi(hydra)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "3",
        "4",
        "1",
        "2",
    )
    assert env["MASTER_ADDR"] == "h0" and "MASTER_PORT" not in env
    # PMI_LOCAL_RANK (Cray PALS and others) where MPI_LOCALRANKID is absent; no local rank at all: the rank
    pals = {"PMI_RANK": "2", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "0", "PMI_LOCAL_SIZE": "2"}
    assert (env_from_mpi(pals)["LOCAL_RANK"], env_from_mpi(pals)["LOCAL_WORLD_SIZE"]) == ("0", "2")
    bare = env_from_mpi({"PMI_RANK": "2", "PMI_SIZE": "4"})
    assert bare["LOCAL_RANK"] == "2" and "LOCAL_WORLD_SIZE" not in bare


def test_mpi_ranks_win_over_slurms_and_torchruns_win_over_both():
    # mpirun inside an allocation: the ranks inherit SLURM_PROCID of the node's task, not their own rank
    inside = {**slurm(SLURM_PROCID="1", SLURM_NTASKS="2"), **openmpi(6, 8, 2, 4, MASTER_ADDR="gpu07")}
    assert env_from_launcher(inside)["RANK"] == "6"
    assert env_from_launcher(slurm())["RANK"] == "6"  # SLURM alone
    assert env_from_mpi(openmpi(1, 2, 1, 2, RANK="0")) == {}  # torchrun's worker
    assert env_from_mpi({"PATH": "/usr/bin", "PMI_RANK": "0"}) == {}  # no size: not a rank of mpirun's


def test_cli_world_size_from_mpirun(clean_env):
    """``mpirun -np 2 loom train ...``: each rank plans for 2 ranks, both on this host."""
    from loom.runtime.launch import env_world_size, local_ranks

    for k, v in openmpi(1, 2, 1, 2).items():
        clean_env.setenv(k, v)
    assert (env_world_size(), local_ranks(2)) == (2, 2)


def test_mpirun_on_several_hosts_without_master_addr_is_one_line(clean_env):
    from loom.config.errors import UserError

    for k, v in openmpi(5, 8, 1, 4).items():
        clean_env.setenv(k, v)
    with pytest.raises(
        UserError, match=r"MASTER_ADDR and MASTER_PORT not set: rank 5 of 8 .*mpirun -x MASTER_"
    ):
        init_distributed("cpu", "gloo")


def test_backend_mpi_without_mpi_is_refused(clean_env):
    """This PyTorch (the PyPI wheels) has no MPI: parallel.backend = mpi is one line naming why and what to use,
    from the config checks (before any worker starts) and from the group's start alike."""
    import torch.distributed as dist

    from loom.cli.preflight import load_config
    from loom.resolve import check_machine

    if dist.is_mpi_available():
        pytest.skip("this PyTorch has MPI")
    cfg, _ = load_config(["--parallel.backend", "mpi"])
    with pytest.raises(
        ConfigError, match=r"parallel.backend = 'mpi': this PyTorch build has no MPI .*auto \| nccl"
    ):
        check_machine(cfg, "cpu")
    for k, v in openmpi(0, 2, 0, 2).items():
        clean_env.setenv(k, v)
    with pytest.raises(ConfigError, match="this PyTorch build has no MPI"):
        init_distributed("cpu", "mpi")


def test_backend_mpi_runs_data_parallel_replicas_only():
    from loom.cli.preflight import load_config
    from loom.parallel.dims import ParallelDims
    from loom.resolve import check_mpi_layout

    cfg, _ = load_config(["--parallel.backend", "mpi"])
    with pytest.raises(ConfigError, match=r"data-parallel replicas only .* this layout has dp_shard = 4"):
        check_mpi_layout(cfg, ParallelDims.from_config(cfg.parallel, 4))  # FSDP by default
    cfg, _ = load_config(
        ["--parallel.backend", "mpi", "--parallel.dp_replicate", "4", "--parallel.dp_shard", "1"]
    )
    check_mpi_layout(cfg, ParallelDims.from_config(cfg.parallel, 4))  # DDP: all-reduce and broadcast


# ---- Ray's ranks (loom launch --ray) -----------------------------------------------------------------------------


def test_ray_rank_envs_number_ranks_node_by_node():
    from loom.cli.ray_launch import rank_envs

    envs = rank_envs(["n1", "n2", "n1", "n2"], "10.0.0.1", 40000)
    assert [e["RANK"] for e in envs] == ["0", "2", "1", "3"]  # n1's actors are ranks 0, 1
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "1", "1"]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"} and {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("10.0.0.1", "40000")}
    assert rank_envs(["a", "b", "b"], "h", 1)[0]["RANK"] == "0"  # actor 0 is always rank 0 (the rendezvous)
    # GPUs: a rank sees its node's job GPUs, its own at its local rank (pick_device takes LOCAL_RANK's)
    envs = rank_envs(["n1", "n1", "n2"], "h", 1, gpus=["3", "1", "0"])
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,1", "3,1", "0"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0"]
    assert "CUDA_VISIBLE_DEVICES" not in rank_envs(["n1"], "h", 1)[0]


def test_launch_ray_without_ray_or_nproc_is_one_line():
    from loom.cli.launch import main

    with pytest.raises(ConfigError, match=r"--nproc: --ray needs it"):
        main(["--ray"])
    with pytest.raises(ConfigError, match=r"--max-restarts = 2: --ray restarts nothing"):
        main(["--ray", "--nproc", "2", "--max-restarts", "2"])
    try:
        import ray  # noqa: F401
    except ImportError:
        from loom.config.errors import UserError

        with pytest.raises(
            UserError, match=r"loom launch --ray needs the 'ray' package \(pip install 'loom-train\[ray\]'\)"
        ):
            main(["--ray", "--nproc", "2"])

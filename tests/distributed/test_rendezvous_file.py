"""The ``file`` rendezvous backend (loom.runtime.rendezvous): two elastic agents on this machine, each started
with ``--nnodes 2 --nproc-per-node 1 --rdzv-backend file --rdzv-endpoint PATH``, form one 2-rank job through a
FileStore alone. One test trains the tiny run (``-m loom.train``) and compares its losses with one process; the
other checks what the workers are handed and trains the same run in a process group formed over the FileStore
with MASTER_ADDR / MASTER_PORT removed (its workers run this module: ``-m tests.distributed.test_rendezvous_file``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.distributed.test_launch import CONFIG, assert_matches, cache, cli_args, losses_of, single  # noqa: F401

# an agent: register the backend in this process, then torch's launcher (torchrun's main) parses the rest
AGENT = (
    "import sys; from loom.runtime.rendezvous import register_file_rendezvous; register_file_rendezvous(); "
    "from torch.distributed.run import main; main(sys.argv[1:])"
)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_agents(endpoint: str, module_args: list[str], cwd, job: str) -> list[subprocess.CompletedProcess]:
    """Two agents of one 2-node job (1 worker each) on the file backend; both are waited for."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        )
    }
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                AGENT,
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "file",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                job,
                "--rdzv-conf",
                "join_timeout=120",
                "--monitor-interval",
                "0.2",
                *module_args,
            ],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_two_agents_train_over_a_file_store(tmp_path, cache, single):
    agents = start_agents(
        str(tmp_path / "rdzv"), ["-m", "loom.train", *cli_args(tmp_path / "run", cache)], tmp_path, "train"
    )
    for a in agents:
        assert a.returncode == 0, a.stderr[-3000:]
    out = "".join(a.stdout for a in agents)
    assert "FSDP (world 2: dp_shard=2)" in out
    assert_matches(losses_of(tmp_path / "run"), single)


def test_process_group_over_the_file_store(tmp_path, cache, single):
    """Each worker is handed the process group's FileStore prefix; with MASTER_ADDR / MASTER_PORT removed, loom's
    worker body (loom.runtime.env.init_distributed) forms the group over that store: the same losses."""
    out = tmp_path / "out"
    out.mkdir()
    agents = start_agents(
        str(tmp_path / "rdzv"),
        ["-m", "tests.distributed.test_rendezvous_file", str(out), *cli_args(tmp_path / "run", cache)],
        ROOT,
        "pg",
    )
    for a in agents:
        assert a.returncode == 0, a.stderr[-3000:]
    seen = [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]
    assert seen[0]["store"] == seen[1]["store"] and seen[0]["store"].endswith("@" + str(tmp_path / "rdzv"))
    # what torch's agent still hands the workers: node 0's address and a port, which this group did not use
    assert seen[0]["master"] == seen[1]["master"] and seen[0]["master"][1].isdigit()
    assert {s["agent_store"] for s in seen} == {"False"}  # no agent serves a TCPStore
    assert_matches(losses_of(tmp_path / "run"), single)


def _worker(out_dir: str, argv: list[str]) -> None:
    from loom.cli.train import run_worker
    from loom.runtime.rendezvous import PG_STORE_ENV

    master = [os.environ.pop("MASTER_ADDR"), os.environ.pop("MASTER_PORT")]
    rank = int(os.environ["RANK"])
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as fh:
        json.dump(
            {
                "store": os.environ[PG_STORE_ENV],
                "master": master,
                "agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"],
            },
            fh,
        )
    run_worker(argv)  # forms the group over the FileStore: there is no address to reach


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])

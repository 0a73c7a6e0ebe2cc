"""``loom launch --hostfile``: two "hosts" that are both this machine (``--launcher-cmd "bash -c {cmd}"`` in place
of ssh), one slot each, form one 2-rank job (c10d rendezvous) whose losses equal one process's; every line is
prefixed with its host. When one host fails, the launcher stops the other and exits with the failure's code."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.distributed.harness import rendezvous_store
from tests.distributed.test_launch import CONFIG, assert_matches, cache, cli_args, losses_of, single  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launch(tmp_path, hostfile: str, launcher: str, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "hosts"
    path.write_text(hostfile)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))
    store = rendezvous_store()  # served while the launcher runs
    cmd = [
        sys.executable,
        "-m",
        "loom",
        "launch",
        "--hostfile",
        str(path),
        "--launcher-cmd",
        launcher,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(store.port),
        "--grace-s",
        "30",
        *args,
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_two_local_hosts_train_one_job(tmp_path, cache, single):
    proc = launch(
        tmp_path,
        "# both are this machine\n127.0.0.1 slots=1\nlocalhost slots=1\n",
        "bash -c {cmd}",
        *cli_args(tmp_path / "run", cache),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("loom launch: 2 hosts, 2 workers, rendezvous c10d at 127.0.0.1:")
    # rank 0 prints the layout; which host's agent holds it is the rendezvous's choice
    assert any(
        line.startswith(("[127.0.0.1] ", "[localhost] ")) and "FSDP (world 2: dp_shard=2)" in line
        for line in lines
    ), proc.stdout[-3000:]
    assert all(line.startswith(("[127.0.0.1] ", "[localhost] ")) for line in lines[1:])
    assert_matches(losses_of(tmp_path / "run"), single)


def test_a_failed_host_stops_the_others(tmp_path, cache):
    """Host ``bad`` exits 3 at once; the good host's agent, waiting at the rendezvous for it, is stopped."""
    launcher = "bash -c 'test {host} != bad || exit 3; eval \"$1\"' _ {cmd}"
    proc = launch(tmp_path, "good slots=1\nbad slots=1\n", launcher, *cli_args(tmp_path / "run", cache))
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loom launch: bad: stopping the other hosts" in proc.stderr
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")

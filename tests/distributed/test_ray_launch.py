"""``loom launch --ray``: a job of 2 Ray actors (a local Ray instance of 2 CPUs) trains the debug model with the
losses of one process; both layouts, FSDP (loom's default) and DDP, in one Ray session. Slow (Ray's start-up and two
worker processes that import torch): run by hand with ``--slow`` where Ray is installed (``loom-train[ray]``)."""

from __future__ import annotations

import json
import os

import pytest

from tests.distributed.harness import run_one
from tests.tiny import tiny_args, tiny_overrides

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")

CONFIG = {"run.seed": 5, "optimizer.lr": 3e-3}


def losses_of(run_dir) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line)["loss"] for line in fh]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    yield
    ray.shutdown()


def test_two_ray_workers_give_one_process_losses(tmp_path, local_ray):
    from loom.cli.main import main

    cache = tmp_path / "cache"
    single = run_one(tiny_overrides(tmp_path / "single", cache, **CONFIG))
    ref = [r["loss"] for r in single]
    layouts = {"fsdp": {}, "ddp": {"parallel.dp_replicate": 2, "parallel.dp_shard": 1}}
    for name, layout in layouts.items():
        run_dir = tmp_path / name
        args = tiny_args(run_dir, cache, **CONFIG, **layout)
        assert main(["launch", "--ray", "--nproc", "2", *args]) == 0
        got = losses_of(run_dir)
        assert len(got) == len(ref) == 4
        assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) < 1e-5, (name, got, ref)


def test_a_user_error_on_the_ranks_is_one_line_and_exit_2(tmp_path, local_ray, capsys):
    """A config every rank refuses only once it runs (here: the data source, found missing on the workers) stops
    the job with the first rank's line; the driver's own checks pass it on (a path may exist on the nodes only)."""
    from loom.cli.ray_launch import run

    missing = tmp_path / "nowhere.txt"
    code = run(tiny_args(tmp_path / "run", tmp_path / "cache", **{"data.source": str(missing)}), 2)
    err = capsys.readouterr().err
    assert code == 2 and "nowhere.txt" in err

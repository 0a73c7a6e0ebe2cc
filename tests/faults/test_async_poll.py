"""Async saves on 2 ranks whose polls disagree (rank 0 sees each save done, rank 1 never): ``wait`` must still
pair the ranks' collectives. Before the fix, rank 1 alone ran a barrier and both ranks hung after step 4."""

from __future__ import annotations

import os
import subprocess
import sys

from loom.checkpoint.manager import list_complete
from tests.faults.inject import kill_tree
from tests.tiny import tiny_args
from tests.unit.test_checkpoint_recovery import LOOM, REPO, env

SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "uneven_poll")


def test_async_saves_finish_when_the_ranks_polls_disagree(tmp_path):
    run = tmp_path / "run"
    e = dict(env(), PYTHONPATH=SITE + os.pathsep + REPO)
    cmd = [
        sys.executable,
        "-c",
        LOOM,
        "train",
        "--nproc-per-node",
        "2",
        *tiny_args(
            run,
            tmp_path / "cache",
            **{
                "run.seed": 3,
                "training.steps": 8,
                "training.global_batch_size": 4,
                "optimizer.warmup_steps": None,
                "checkpoint.every": 2,
                "checkpoint.keep": 0,
                "checkpoint.async_save": "true",
                "checkpoint.at_end": None,
            },
        ),
    ]
    proc = subprocess.Popen(
        cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=240)  # far above the run's own time: a hang fails here
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        raise AssertionError(f"hung; checkpoints: {os.listdir(run / 'checkpoints')}") from None
    assert proc.returncode == 0, err[-3000:]
    assert [s for s, _ in list_complete(str(run / "checkpoints"))] == [2, 4, 6, 8]

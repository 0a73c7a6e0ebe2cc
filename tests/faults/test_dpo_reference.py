"""A SIGKILL while DPO's cached reference is being written (issue 49): the next start finds no reference (only the
temporary file, which it replaces), computes it again, and the run's losses equal an uninterrupted run's bitwise;
the cache it leaves is the uninterrupted run's, byte for byte."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import torch

from tests.faults.driver import AUTOLOAD
from tests.tiny import tiny_args
from tests.unit.test_checkpoint_recovery import LOOM, env

WORDS = "the cat sat on a warm mat while two dogs ran past".split()


def dpo(run_dir, cache, source, fault: str | None = None) -> subprocess.CompletedProcess:
    e = env()
    e["PYTHONPATH"] = AUTOLOAD + os.pathsep + e["PYTHONPATH"]
    e.pop("LOOM_FAULT", None)
    if fault:
        e["LOOM_FAULT"] = fault
    args = tiny_args(
        run_dir,
        cache,
        **{
            "training.objective": "dpo",
            "training.steps": 2,
            "training.seq_len": 64,
            "data.source": str(source),
            "data.val_fraction": 0.0,
            "run.seed": 3,
            "run.deterministic": "true",
        },
    )
    return subprocess.run(
        [sys.executable, "-c", LOOM, "train", *args], env=e, capture_output=True, text=True, timeout=300
    )


def losses(run_dir) -> list[tuple]:
    with open(os.path.join(str(run_dir), "metrics.jsonl")) as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in recs if "loss" in r]


def test_a_kill_while_writing_the_cached_reference_leaves_none_and_the_rerun_is_bitwise(tmp_path):
    source = tmp_path / "pairs.jsonl"
    source.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": " ".join(WORDS[i % 5 : i % 5 + 3]),
                    "chosen": WORDS[i % 12],
                    "rejected": WORDS[(i + 5) % 12] + " no",
                }
            )
            + "\n"
            for i in range(16)
        )
    )
    cache = tmp_path / "cache"
    whole = dpo(tmp_path / "whole", cache, source)
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = dpo(tmp_path / "run", cache, source, fault="dpo_reference:1")
    assert killed.returncode == -9 and "loom-fault: SIGKILL at dpo_reference" in killed.stderr, killed.stderr[
        -2000:
    ]
    refs = tmp_path / "run" / "dpo_reference"
    assert glob.glob(str(refs / "*.pt")) == [] and len(glob.glob(str(refs / "*.pt.tmp"))) == 1
    again = dpo(tmp_path / "run", cache, source)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "reusing" not in again.stdout
    assert losses(tmp_path / "run") == losses(tmp_path / "whole")
    (kept,) = glob.glob(str(refs / "*"))  # the temporary file is gone: replaced by the finished one
    (reference,) = glob.glob(str(tmp_path / "whole" / "dpo_reference" / "*.pt"))
    assert os.path.basename(kept) == os.path.basename(reference)
    assert torch.equal(torch.load(kept), torch.load(reference))

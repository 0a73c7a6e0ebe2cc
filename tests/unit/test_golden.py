"""Golden losses: the default model family, data and optimizer on CPU must keep training exactly as they did
when tests/golden/debug_losses.json was written. Layout invariance compares layouts with each other; this
catches a change that moves every layout together (init, data order, tokenizer, optimizer, schedule, loss).

A deliberate change of the numbers regenerates the file, and the commit says why:

    python -m tests.unit.test_golden
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest
import torch

GOLDEN = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden", "debug_losses.json"
)
# the debug flavor on the embedded corpus with the default optimizer and schedule; fp32, deterministic
OVERRIDES = {
    "run.seed": "0",
    "run.deterministic": "true",
    "run.device": "cpu",
    "training.steps": "30",
    "training.seq_len": "64",
    "training.global_batch_size": "8",
    "training.micro_batch_size": "4",
    "metrics.every": "1",
    "metrics.tensorboard": "false",
    "checkpoint.at_end": "false",
}
# CPU kernels may sum in a different order on another processor: far below what a real change moves
RTOL = 1e-3


def golden_losses(run_dir: str) -> list[float]:
    from loom.config import build_config
    from loom.train.trainer import Trainer

    cfg = build_config(None, {**OVERRIDES, "run.dir": run_dir})
    return [row["loss"] for row in Trainer(cfg).fit()]


@pytest.mark.slow  # 30 steps: the default run (CI) has it, the quick loop does not
def test_losses_match_the_golden_file(tmp_path):
    with open(GOLDEN) as f:
        golden = json.load(f)
    assert golden["overrides"] == OVERRIDES, "the golden file was written for other settings: regenerate it"
    losses = golden_losses(str(tmp_path / "run"))
    assert len(losses) == len(golden["losses"])
    for step, (got, want) in enumerate(zip(losses, golden["losses"]), start=1):
        assert abs(got - want) <= RTOL * abs(want), f"step {step}: loss {got:.6f}, golden {want:.6f}"


def write() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        losses = golden_losses(os.path.join(tmp, "run"))
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    with open(GOLDEN, "w") as f:
        json.dump(
            {
                "overrides": OVERRIDES,
                "torch": torch.__version__,
                "python": sys.version.split()[0],
                "losses": losses,
            },
            f,
            indent=1,
        )
    print(f"wrote {GOLDEN}: {len(losses)} losses, last {losses[-1]:.4f}")


if __name__ == "__main__":
    write()

"""On a GPU, a reward model trains and scores as on the CPU: from the same weights (an exported reward model: each
device's generator draws its own seeded weights), a training.objective reward run on CUDA (loom's CUDA kernels
chosen by auto) follows the CPU run's losses and pair statistics in float32 and stays close in bfloat16 (with
torch.compile too); scoring its checkpoint on CUDA gives the CPU's rewards."""

from __future__ import annotations

import pytest
import torch

from loom.cli.main import main as loom_main
from loom.infer.reward import score
from loom.train.trainer import Trainer
from tests.unit.test_reward import reward_run, write_pairs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def run(tmp_path, name, source, **extra):
    return Trainer(
        reward_run(
            tmp_path / name,
            tmp_path / "cache",
            source,
            **{"training.steps": 4, "checkpoint.at_end": "true", **extra},
        )
    ).fit()


def start(tmp_path, source) -> str:
    """A one-step CPU reward run exported as a LlamaForSequenceClassification folder: the runs' common start."""
    run(tmp_path, "start", source, **{"run.device": "cpu", "training.steps": 1})
    folder = str(tmp_path / "start_hf")
    assert (
        loom_main(
            [
                "convert",
                "--from",
                str(tmp_path / "start" / "checkpoints" / "step_00000001"),
                "--to-hf",
                folder,
            ]
        )
        == 0
    )
    return folder


@pytest.mark.parametrize(
    "dtype,compile_,tol",
    [("float32", "false", 1e-4), ("bfloat16", "false", 2e-2), ("bfloat16", "true", 2e-2)],
)
def test_a_cuda_run_follows_the_cpu_run(tmp_path, dtype, compile_, tol):
    source = write_pairs(tmp_path / "pairs.jsonl")
    init = {"model.init_from": start(tmp_path, source)}
    cpu = run(tmp_path, "cpu", source, **{"run.device": "cpu", **init})
    gpu = run(
        tmp_path,
        "gpu",
        source,
        **{"run.device": "cuda", "training.dtype": dtype, "training.compile": compile_, **init},
    )
    for a, b in zip(gpu, cpu):
        assert a["loss"] == pytest.approx(b["loss"], rel=tol), (a, b)
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], abs=tol)
    items = [[5, 6, 7, 8], list(range(1, 60))]
    ckpt = str(tmp_path / "gpu" / "checkpoints" / "step_00000004")
    on_cuda, on_cpu = score(ckpt, items, device="cuda"), score(ckpt, items)
    assert on_cuda == pytest.approx(on_cpu, abs=1e-4)

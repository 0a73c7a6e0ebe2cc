"""GPU checks of fine-tuning paths the CPU suite cannot reach: the DPO reference copy under bf16 autocast and
torch.compile against the cached reference, and an SFT step without targets skipped on the device (loom's Triton
AdamW, PyTorch's fused AdamW: the host learns the verdict a step late). Skipped without CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from loom.train.trainer import Trainer
from tests.tiny import tiny_config
from tests.unit.test_dpo import rows, write_jsonl
from tests.unit.test_sft_empty_steps import masked, same, sft, snapshot, write_chats

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("compile_", ["false", "true"])
def test_dpo_reference_copy_matches_the_cached_reference_on_cuda(tmp_path, compile_):
    source = write_jsonl(tmp_path / "p.jsonl", rows(80))
    losses = {}
    for reference in ("cached", "copy"):
        cfg = tiny_config(
            tmp_path / reference,
            tmp_path / "cache",
            **{
                "run.device": "cuda",
                "training.dtype": "bfloat16",
                "training.compile": compile_,
                "training.objective": "dpo",
                "data.source": source,
                "dpo.reference": reference,
                "dpo.beta": 0.5,
                "training.seq_len": 128,
                "training.global_batch_size": 8,
                "training.micro_batch_size": 4,
                "training.steps": 6,
                "optimizer.lr": 3e-3,
                "data.val_fraction": 0.0,
            },
        )
        losses[reference] = [r["loss"] for r in Trainer(cfg).fit()]
    assert all(math.isfinite(x) for x in losses["copy"])
    # bf16: the reference log-probabilities are the same model's, batched differently (rounding only)
    assert max(abs(a - b) / b for a, b in zip(losses["copy"], losses["cached"])) < 2e-2, losses


@pytest.mark.parametrize("impl", ["triton", "fused"])
def test_a_step_without_targets_is_skipped_on_the_device(tmp_path, capsys, impl):
    source = write_chats(tmp_path / "chat.jsonl", 60, 6)
    trainer = Trainer(
        sft(
            tmp_path,
            source,
            **{
                "run.device": "cuda",
                "training.dtype": "bfloat16",
                "optimizer.implementation": impl,
                "training.steps": 4,
            },
        )
    )
    assert trainer.optimizer.skips_on_device
    trainer.train_step(trainer.loader.next_step().micro_batches)
    trainer.step = 1
    assert trainer._settle() == "ok"
    before, epoch = snapshot(trainer), trainer.scheduler.schedulers[0].last_epoch
    out = trainer.train_step(masked(trainer.loader.next_step().micro_batches))
    trainer.step = 2
    assert trainer._settle() == "ok" and float(out["loss"]) == 0.0
    assert same(snapshot(trainer), before) and trainer.scheduler.schedulers[0].last_epoch == epoch
    assert trainer.guard.skipped == 0 and "step 2: warning: nothing to train on" in capsys.readouterr().out

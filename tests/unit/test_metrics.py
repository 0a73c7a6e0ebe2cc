"""Model FLOPs / MFU against the peak table, and what a training run records (metrics.jsonl, TensorBoard)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from loom.metrics.flops import flops_per_token, matmul_params, mfu, peak_flops
from loom.metrics.logger import format_line, strict_json
from loom.models.llama import FLAVORS, Llama
from tests.distributed.harness import run_one
from tests.tiny import tiny_overrides

H100 = "NVIDIA H100 80GB HBM3"


def llama_1b():
    return FLAVORS["1B"].with_(vocab_size=128256)


def test_reference_point_llama_3_2_1b_on_h100():
    """Llama-3.2-1B shape, seq 2048, 48.0k tokens/s on one H100 SXM in bf16 = 39.9% MFU."""
    args = llama_1b()
    assert matmul_params(args) == 1_235_746_816  # 1.236B: 16 blocks + the (tied) output head
    assert flops_per_token(args, 2048) == 6 * 1_235_746_816 + 12 * 16 * 32 * 64 * 2048
    value = mfu(48_000.0, args, 2048, peak_flops(H100, "bfloat16"))
    assert round(100 * value, 1) == 39.9


def test_lora_flops_count_no_weight_gradient_for_the_frozen_base():
    """LoRA rank 16 on every linear of the 1B shape: the base costs forward + input gradient (4 per weight), the
    11.3M adapter weights all three matmuls (6 per weight); attention is unchanged (its backward is input gradients)."""
    from loom.config.sections import LoraConfig
    from loom.train.trainer import count_params

    args = llama_1b()
    adapters = count_params(args, LoraConfig(rank=16))[1]
    assert adapters == 16 * 16 * ((2048 + 2048) * 2 + (2048 + 512) * 2 + (2048 + 8192) * 3)
    attention = 12 * 16 * 32 * 64 * 2048
    assert flops_per_token(args, 2048, adapters) == 4 * 1_235_746_816 + 6 * adapters + attention


@pytest.mark.parametrize("flavor,vocab", [("1B", 128256), ("debug", 384)])
def test_matmul_params_match_the_model(flavor, vocab):
    """Every 2-D weight except the input embedding takes part in a matmul (a tied head counts once, as the head)."""
    args = FLAVORS[flavor].with_(vocab_size=vocab)
    with torch.device("meta"):
        model = Llama(args)
    matrices = sum(p.numel() for p in model.parameters() if p.ndim == 2)
    embedding = 0 if args.tie_embeddings else vocab * args.dim
    assert matmul_params(args) == matrices - embedding


@pytest.mark.parametrize(
    "name,dtype,tflops",
    [
        (H100, "bfloat16", 989.0),
        ("NVIDIA H100 80GB HBM3", "float16", 989.0),
        ("NVIDIA H200", "bfloat16", 989.0),
        ("NVIDIA H200 NVL", "bfloat16", 835.0),
        ("NVIDIA GH200 480GB", "bfloat16", 989.0),
        ("NVIDIA H100 PCIe", "bfloat16", 756.0),
        ("NVIDIA H100 NVL", "bfloat16", 835.0),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312.0),
        ("NVIDIA A100 80GB PCIe", "float32", 19.5),  # FP32, not TF32: loom leaves TF32 off
        ("NVIDIA H100 80GB HBM3", "float32", 67.0),
        ("nvidia h100 80gb hbm3", "bfloat16", 989.0),
    ],
)
def test_peak_table(name, dtype, tflops):
    assert peak_flops(name, dtype) == tflops * 1e12


def test_unknown_device_has_no_peak_and_no_mfu():
    assert peak_flops("NVIDIA GeForce GTX 1080", "bfloat16") is None
    assert mfu(1e6, llama_1b(), 2048, None) is None


def test_strict_json_and_console_line():
    rec = {
        "step": 3,
        "loss": 2.5,
        "grad_norm": math.inf,
        "lr": 1e-3,
        "tokens_per_s": 1234.0,
        "tokens_per_s_per_device": 617.0,
        "mfu": 0.4,
        "mem_gib": 1.5,
        "val_loss": math.nan,
        "skipped_steps": 1,
    }
    assert strict_json(rec)["grad_norm"] is None and strict_json(rec)["val_loss"] is None
    assert strict_json(rec)["loss"] == 2.5
    assert format_line(rec, 10) == (
        "step  3/10 | loss 2.5000 | val nan | gnorm inf | lr 1.00e-03 | "
        "tok/s 1.2k (617/dev) | mfu 40.0% | mem 1.50GiB | skipped 1"
    )


REQUIRED = {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "mfu", "mem_gib", "val_loss"}


def test_each_method_chooses_its_console_fields():
    """The console line shows the objective's own fields (its ``console``), in its order, where the record has them:
    DPO its accuracy and margin, GRPO its warm-up, reward and its parts, accuracy and KL; the LM none."""
    from loom.methods.dpo import DirectPreference
    from loom.methods.grpo import GroupRelative
    from loom.train.objective import LanguageModeling

    base = {
        "step": 3,
        "loss": 0.5,
        "val_loss": None,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens_per_s": 10.0,
        "tokens_per_s_per_device": 10.0,
        "mfu": None,
        "mem_gib": 1.0,
    }
    rl = {
        **base,
        "reward": 0.75,
        "reward_std": 0.1,
        "rewards/exact_answer": 0.5,
        "rewards/digit_match": 0.5,
        "rewards/digit_match_std": 0.2,
        "kl": 0.0125,
        "eval/accuracy": 0.25,
    }
    line = format_line(rl, 10, GroupRelative.console)
    assert "| reward 0.750 | acc 0.500 | digit_match 0.500 | eval acc 0.250 | kl 0.0125 | gnorm" in line, line
    assert "_std" not in line and "warm-up" not in line
    assert "| warm-up | gnorm" in format_line({**base, "grpo/warmup": 1.0}, 10, GroupRelative.console)
    dpo = {**base, "rewards/accuracy": 0.625, "rewards/margins": 0.125, "rewards/chosen": 1.0}
    assert "| loss 0.5000 | acc 0.625 | margin 0.125 | gnorm" in format_line(
        dpo, 10, DirectPreference.console
    )
    assert format_line(rl, 10, LanguageModeling.console) == format_line(base, 10)  # the LM: no method fields


def job(tmp_path, name, **extra):
    return tiny_overrides(
        tmp_path / name,
        tmp_path / "cache",
        **{"training.global_batch_size": 4, "metrics.every": None, **extra},
    )


def read_jsonl(path):
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    with open(path) as fh:
        return [json.loads(line, parse_constant=reject) for line in fh]


def test_metrics_jsonl_records(tmp_path):
    records = run_one(job(tmp_path, "run", **{"training.eval_every": 2, "metrics.every": 3}))
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in lines] == [2, 3, 4]  # eval steps 2 and 4, metrics.every 3
    assert lines == [strict_json(r) for r in records]
    for r in lines:
        assert REQUIRED <= set(r)
        assert r["mfu"] is None  # CPU: no peak
        assert r["mem_gib"] > 0 and r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and r["lr"] > 0
        assert r["tokens"] == r["step"] * 4 * 32
    assert [r["val_loss"] is not None for r in lines] == [True, False, True]
    assert all(0 < r["val_loss"] < 10 for r in lines if r["val_loss"] is not None)
    assert not os.path.exists(tmp_path / "run" / "tensorboard")  # disabled


def test_a_run_ends_with_a_validation_loss_by_default(tmp_path):
    """training.eval_every 0 (the default) still validates at the last step (training.eval_at_end); the pass
    after the last step changes no training loss."""
    records = run_one(job(tmp_path, "run", **{"training.steps": 3}))
    assert [r["step"] for r in records] == [3] and 0 < records[-1]["val_loss"] < 10
    off = run_one(job(tmp_path, "off", **{"training.steps": 3, "training.eval_at_end": "false"}))
    assert off[-1]["val_loss"] is None and off[-1]["loss"] == records[-1]["loss"]


def test_tensorboard_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = run_one(job(tmp_path, "tb", **{"metrics.tensorboard": "true", "metrics.every": 1}))
    tb_dir = tmp_path / "tb" / "tensorboard"
    assert any(f.startswith("events.out.tfevents.") for f in os.listdir(tb_dir))
    events = EventAccumulator(str(tb_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "mem_gib"} <= tags
    assert "mfu" not in tags and "step" not in tags  # None is not written; step is the x axis
    losses = events.Scalars("loss")
    assert [e.step for e in losses] == [1, 2, 3, 4]
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in records], rel=1e-6)


def test_docs_peak_table_matches_the_code():
    from loom.metrics.flops import PEAK_TFLOPS

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "metrics.md")
    with open(path) as fh:
        rows = [line.split("|")[1:-1] for line in fh if line.startswith("| `")]
    table = [
        (cells[0].strip().split("`")[1], [float(c) for c in cells[1:4]]) for cells in rows if len(cells) == 4
    ]
    assert table == [(name, [t["bfloat16"], t["float16"], t["float32"]]) for name, t in PEAK_TFLOPS]


def test_a_logged_record_reads_the_steps_figures_from_its_host_copy(tmp_path, monkeypatch):
    """A logged step's loss, gradient norm, count and statistics come from the copy its verdict made before the
    update was queued (loom.runtime.guard.StepCheck), not from the device: a scalar read there would wait for the
    update and leave the GPU idle while the host logs and queues the next step. The same values as the device's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from loom.train.loop import Loop

    class ScalarReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                ScalarReads.count += 1
            return func(*args, **(kwargs or {}))

    record, seen = Loop._record, []

    def watched(self, out, *args):
        with ScalarReads():
            rec = record(self, out, *args)
        seen.append((rec, float(out["loss"]), float(out["grad_norm"]), float(out["tokens"])))
        return rec

    monkeypatch.setattr(Loop, "_record", watched)
    run_one(job(tmp_path, "run", **{"training.steps": 3, "metrics.every": 1}))
    assert len(seen) == 3 and ScalarReads.count == 0
    for rec, loss, norm, tokens in seen:
        assert (rec["loss"], rec["grad_norm"], rec["targets"]) == (loss, norm, tokens)

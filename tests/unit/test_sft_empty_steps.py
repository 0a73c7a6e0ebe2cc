"""A step whose global batch holds no target (SFT windows without an assistant token): loss 0, zero gradients, no
update (weights, AdamW state, its step count and the LR schedule unchanged; the data advances), a one-line warning
naming the step and ``targets 0`` in the metrics, never counted as non-finite; a genuinely non-finite loss still
meets training.nonfinite. Each optimizer implementation: foreach decides on the host, loom's Triton AdamW (its
reference on CPU) and PyTorch's fused AdamW skip on the device and the host takes back the counts."""

from __future__ import annotations

import json
import random

import pytest
import torch

from loom.data.loader import MicroBatch
from loom.numerics import IGNORE
from loom.train.trainer import Trainer
from tests.tiny import tiny_config

WORDS = "the cat sat on a warm mat while two dogs ran past quickly and one bird sang".split()


def write_chats(path, n: int, prompt_words: int, seed: int = 0) -> str:
    """``n`` conversations: a user message of ``prompt_words`` words and a short assistant answer."""
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."
    with open(path, "w") as fh:
        for _ in range(n):
            fh.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": say(prompt_words)},
                            {"role": "assistant", "content": say(3)},
                        ]
                    }
                )
                + "\n"
            )
    return str(path)


def sft(tmp_path, source, **extra):
    return tiny_config(
        tmp_path / "run",
        tmp_path / "cache",
        **{
            "training.objective": "sft",
            "data.source": source,
            "training.seq_len": 32,
            "run.seed": 2,
            "optimizer.lr": 1e-2,
            "optimizer.warmup_steps": 0,
            **extra,
        },
    )


def masked(mbs: list[MicroBatch]) -> list[MicroBatch]:
    """The micro-batches with every label IGNORE: nothing to train on."""
    return [
        MicroBatch(mb.inputs, torch.full_like(mb.labels, IGNORE), mb.positions, mb.document_ids) for mb in mbs
    ]


def snapshot(trainer) -> tuple[dict, list]:
    params = {n: p.detach().clone() for n, p in trainer.parts[0].named_parameters()}
    state = [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for opt in trainer.optimizer.optimizers
        for s in opt.state.values()
    ]
    return params, state


def same(a: tuple[dict, list], b: tuple[dict, list]) -> bool:
    (pa, sa), (pb, sb) = a, b
    eq = lambda x, y: torch.equal(x, y) if torch.is_tensor(x) else x == y
    return (
        pa.keys() == pb.keys()
        and all(torch.equal(pa[k], pb[k]) for k in pa)
        and len(sa) == len(sb)
        and all(s.keys() == t.keys() and all(eq(s[k], t[k]) for k in s) for s, t in zip(sa, sb))
    )


@pytest.mark.parametrize("impl", ["foreach", "triton", "fused"])
def test_a_step_without_targets_has_loss_0_and_makes_no_update(tmp_path, capsys, impl):
    source = write_chats(tmp_path / "chat.jsonl", 60, 6)
    trainer = Trainer(sft(tmp_path, source, **{"optimizer.implementation": impl, "training.steps": 4}))
    trainer.train_step(
        trainer.loader.next_step().micro_batches
    )  # AdamW has moments: a zero-gradient step would move
    trainer.step = 1
    assert trainer._settle() == "ok"
    before, lr = snapshot(trainer), trainer.optimizer.param_groups[0]["lr"]
    epoch = trainer.scheduler.schedulers[0].last_epoch
    out = trainer.train_step(masked(trainer.loader.next_step().micro_batches))
    trainer.step = 2
    assert float(out["loss"]) == 0.0 and float(out["tokens"]) == 0.0 and float(out["grad_norm"]) == 0.0
    assert trainer._settle() == "ok"
    assert same(snapshot(trainer), before)
    assert (
        trainer.scheduler.schedulers[0].last_epoch == epoch and trainer.optimizer.param_groups[0]["lr"] == lr
    )
    assert trainer.guard.skipped == 0 and trainer.guard.streak == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "targets 0" in line]
    assert (
        len(lines) == 1
        and lines[0].startswith("step 2: warning: nothing to train on")
        and "no update" in lines[0]
    )
    # the next step with targets trains as if the empty one had not been there: AdamW's third step is its second
    out = trainer.train_step(trainer.loader.next_step().micro_batches)
    trainer.step = 3
    assert trainer._settle() == "ok" and float(out["loss"]) > 0 and not same(snapshot(trainer), before)
    assert trainer.scheduler.schedulers[0].last_epoch == epoch + 1


@pytest.mark.parametrize("impl", ["foreach", "triton", "fused"])
def test_a_non_finite_loss_still_meets_training_nonfinite(tmp_path, capsys, impl):
    source = write_chats(tmp_path / "chat.jsonl", 60, 6)
    trainer = Trainer(sft(tmp_path, source, **{"optimizer.implementation": impl, "training.steps": 4}))
    with torch.no_grad():
        trainer.parts[0].norm.weight.fill_(float("nan"))
    out = trainer.train_step(trainer.loader.next_step().micro_batches)
    trainer.step = 1
    assert not torch.isfinite(out["loss"]) and float(out["tokens"]) > 0
    assert trainer._settle() == "skip" and trainer.guard.skipped == 1
    printed = capsys.readouterr().out
    assert "step 1: non-finite loss nan" in printed and "targets 0" not in printed


def test_runs_log_targets_and_empty_steps_are_not_non_finite(tmp_path, capsys):
    """Long prompts, short answers, windows of 32 bytes: most steps of 2 windows hold no assistant token. Each such
    step logs loss 0 and targets 0 with one warning naming it; the others train; nothing is counted non-finite."""
    source = write_chats(tmp_path / "chat.jsonl", 30, 40)
    records = Trainer(
        sft(
            tmp_path,
            source,
            **{"training.steps": 12, "training.global_batch_size": 2, "training.micro_batch_size": 1},
        )
    ).fit()
    printed = capsys.readouterr().out
    empty = [r["step"] for r in records if r["targets"] == 0]
    assert len(records) == 12 and 0 < len(empty) < 12, [r["targets"] for r in records]
    assert all(r["loss"] == 0.0 for r in records if r["targets"] == 0)
    assert all(r["loss"] > 0.0 for r in records if r["targets"] > 0)
    assert all(r["nonfinite_steps"] == 0 for r in records)
    warned = [
        int(line.split()[1].rstrip(":")) for line in printed.splitlines() if "nothing to train on" in line
    ]
    assert warned == empty


def test_validation_without_targets_reports_no_loss(tmp_path, capsys):
    source = write_chats(tmp_path / "chat.jsonl", 30, 40, seed=2)
    trainer = Trainer(
        sft(
            tmp_path,
            source,
            **{
                "training.steps": 2,
                "training.eval_every": 1,
                "training.eval_batches": 1,
                "training.global_batch_size": 2,
                "training.micro_batch_size": 1,
                "data.val_fraction": 0.1,
            },
        )
    )
    (held_out,) = trainer.loader.validation(1)
    assert bool((held_out.labels == IGNORE).all())  # this source's first held-out window is all prompt
    assert trainer.evaluate() is None
    assert "the validation batches hold nothing to evaluate (targets 0)" in capsys.readouterr().out

"""Layout invariance of SFT: conversations packed with per-document attention and a loss mask (only the assistant's
tokens count) give the single-process loss at every step under DDP x2, FSDP2 x2 with accumulation and TP x2, and
FSDP2 x4 with accumulation (slow) (fp32, within 1e-5 relative over 6 steps), and the same global batches. In the
same process groups, knowledge distillation on the same conversations from a wider, deeper teacher (a Hugging Face
folder, sharded as the student is) under DDP x2, FSDP2 x2 with accumulation and TP x2, under LoRA from the student
with its adapters off under FSDP2 x2 with accumulation, and with TRL's generalized JSD under TP x2, against their
single processes."""

from __future__ import annotations

import json
import random

import pytest

from tests.distributed.harness import losses, run_jobs
from tests.tiny import tiny_overrides

STEPS, GLOBAL = 6, 8
WORDS = "the cat sat on a warm mat while two dogs ran past quickly and one bird sang".split()


def write_conversations(path, n: int = 300, seed: int = 0) -> str:
    """Multi-turn conversations (a system message, 1-3 exchanges) of random lengths: many per window, some
    across windows."""
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."
    with open(path, "w") as fh:
        for _ in range(n):
            conv = [{"role": "system", "content": say(3)}]
            for _ in range(rng.randint(1, 3)):
                conv += [
                    {"role": "user", "content": say(rng.randint(2, 8))},
                    {"role": "assistant", "content": say(rng.randint(2, 12))},
                ]
            fh.write(json.dumps({"messages": conv}) + "\n")
    return str(path)


def write_teacher(folder) -> str:
    """A Hugging Face folder of a Llama wider and deeper than the student (the `debug` flavor), same vocabulary."""
    import torch

    from loom.checkpoint.hf.export import export_hf
    from loom.models.llama import Llama
    from loom.models.registry import all_flavors

    args = all_flavors()["debug"].with_(
        vocab_size=384, dim=96, n_layers=3, n_heads=6, n_kv_heads=2, ffn_dim=192
    )
    torch.manual_seed(1)
    export_hf(Llama(args).state_dict(), args, str(folder))
    return str(folder)


def job(tmp, source, name, mb, teacher=None, lora=False, jsd=None, **parallel):
    """An SFT run; with ``teacher`` (a folder, or '' = the initial student) distillation on the same conversations
    (the KLs mixed, or with ``jsd`` TRL's generalized JSD at that beta); ``lora``: LoRA adapters (the default
    teacher is then the student with its adapters off)."""
    extra = {"lora.rank": 4, "optimizer.lr": 3e-2} if lora else {}
    if teacher is not None:
        divergence = (
            {"distill.reverse_kl": 0.3} if jsd is None else {"distill.divergence": "jsd", "distill.beta": jsd}
        )
        extra |= {
            "training.objective": "distill",
            "distill.teacher": teacher,
            "distill.data": "sft",
            "distill.temperature": 2.0,
            **divergence,
            "data.document_positions": "true",
        }
    return tiny_overrides(
        f"{tmp}/{name}",
        f"{tmp}/cache",
        **{
            "training.objective": "sft",
            "data.source": source,
            "run.seed": 5,
            "training.steps": STEPS,
            "training.seq_len": 48,
            "training.global_batch_size": GLOBAL,
            "training.micro_batch_size": mb,
            "optimizer.warmup_steps": 2,
            "optimizer.lr": 3e-3,
            **extra,
            **{f"parallel.{k}": v for k, v in parallel.items()},
        },
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft_layouts")
    source = write_conversations(tmp / "chat.jsonl")
    teacher = write_teacher(tmp / "teacher")
    singles = [
        job(tmp, source, "single", GLOBAL),
        job(tmp, source, "distill", GLOBAL, teacher),
        job(tmp, source, "distill-lora", GLOBAL, "", lora=True),
        job(tmp, source, "distill-jsd", GLOBAL, "", jsd=0.3),
    ]
    reference, distill, distill_lora, distill_jsd = run_jobs(1, singles, str(tmp))
    names = ["ddp2", "fsdp2-acc2", "tp2", "distill-ddp2", "distill-fsdp2-acc2", "distill-lora-fsdp2-acc2"]
    names += ["distill-tp2", "distill-jsd-tp2"]
    jobs = [
        job(tmp, source, "ddp2", GLOBAL // 2, dp_replicate=2, dp_shard=1),
        job(tmp, source, "fsdp2-acc2", GLOBAL // 4, dp_shard=2),
        job(tmp, source, "tp2", GLOBAL, tp=2, dp_shard=1),
        job(tmp, source, "distill-ddp2", GLOBAL // 2, teacher, dp_replicate=2, dp_shard=1),
        job(tmp, source, "distill-fsdp2-acc2", GLOBAL // 4, teacher, dp_shard=2),
        job(tmp, source, "distill-lora-fsdp2-acc2", GLOBAL // 4, "", lora=True, dp_shard=2),
        job(tmp, source, "distill-tp2", GLOBAL, teacher, tp=2, dp_shard=1),
        job(tmp, source, "distill-jsd-tp2", GLOBAL, "", jsd=0.3, tp=2, dp_shard=1, loss_parallel="false"),
    ]
    results = dict(zip(names, run_jobs(2, jobs, str(tmp))))
    singles = {"lora": distill_lora, "jsd": distill_jsd}
    distills = {n: (singles.get(n.split("-")[1], distill), results[n]) for n in names[3:]}
    return reference, {n: results[n] for n in names[:3]}, distills


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    """FSDP2 x4, one sequence per micro-batch: 2 micro-batches accumulated per rank."""
    tmp = tmp_path_factory.mktemp("sft_layouts4")
    source = write_conversations(tmp / "chat.jsonl")
    return run_jobs(4, [job(tmp, source, "fsdp4-acc2", GLOBAL // 8, dp_shard=4)], str(tmp))[0]


def test_sft_losses_match_single_process(results):
    reference, layouts, _ = results
    ref = losses(reference)
    assert len(ref) == STEPS and ref[-1] < ref[0]
    report = []
    for name, res in layouts.items():
        got = losses(res)
        dev = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
        report.append(f"{name}: max rel deviation {dev:.2e}")
        assert len(got) == STEPS and dev < 1e-5, "\n".join(report)
    print("\n".join(report))


def test_sft_global_batches_are_layout_independent(results):
    reference, layouts, _ = results
    hashes = {tuple(r["batch_hash"] for r in res["records"]) for res in [reference, *layouts.values()]}
    assert len(hashes) == 1 and all(hashes.pop())


def test_distill_losses_match_single_process(results):
    """Distillation from a wider, deeper teacher (FSDP2 shards it as it shards the student; TP x2 shards both heads
    by vocabulary, the loss parallel), under LoRA from the student with its adapters off, and TRL's generalized JSD
    from the initial student under TP x2 with gathered logits (parallel.loss_parallel false): the loss, its KD and
    CE terms at every step equal one process's."""
    report = []
    for name, (reference, res) in results[2].items():
        ref = losses(reference)
        assert len(ref) == STEPS and ref[-1] < ref[0]
        assert (
            reference["records"][-1]["kd_loss"] > 0
        )  # the student moved away from its teacher, or never was it
        dev = max(abs(a - b) / abs(b) for a, b in zip(losses(res), ref))
        for key in ("kd_loss", "ce_loss"):
            got, want = [r[key] for r in res["records"]], [r[key] for r in reference["records"]]
            dev = max(dev, *(abs(a - b) / max(abs(b), 1e-3) for a, b in zip(got, want)))
        report.append(f"{name}: max rel deviation {dev:.2e}")
        assert len(res["records"]) == STEPS and dev < 1e-5, "\n".join(report)
    print("\n".join(report))


@pytest.mark.exhaustive  # 4 ranks: the widest matrix, run by hand (pytest --exhaustive)
def test_sft_under_fsdp2_x4_with_accumulation_matches_single_process(results, results4):
    reference, _, _ = results
    ref, got = losses(reference), losses(results4)
    dev = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    print(f"fsdp4-acc2: max rel deviation {dev:.2e}")
    assert len(got) == STEPS and dev < 1e-5
    assert [r["batch_hash"] for r in results4["records"]] == [r["batch_hash"] for r in reference["records"]]

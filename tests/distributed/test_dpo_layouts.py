"""Layout invariance of DPO: pairs of padded sequences, per-pair losses over the global batch's pairs, and the
cached reference computed per pair on whichever rank, give the single-process loss and rewards at every step under
DDP x2, FSDP2 x2 with accumulation and TP x2 (fp32, within 1e-5 relative over 5 steps), with the same global
batches; LoRA with dpo.reference adapters_off likewise under FSDP2 x2."""

from __future__ import annotations

import json
import random

import pytest

from tests.distributed.harness import losses, run_jobs
from tests.tiny import tiny_overrides

STEPS, GLOBAL = 5, 8
WORDS = "the cat sat on a warm mat while two dogs ran past quickly and one bird sang".split()


def write_pairs(path, n: int = 120, seed: int = 0) -> str:
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."
    with open(path, "w") as fh:
        for _ in range(n):
            fh.write(json.dumps({"prompt": say(rng.randint(2, 6)), "chosen": say(rng.randint(2, 8)),
                                 "rejected": say(rng.randint(2, 8))}) + "\n")
    return str(path)


def job(tmp, source, name, mb, lora=False, **parallel):
    extra = {"lora.rank": 4, "dpo.reference": "adapters_off", "optimizer.lr": 3e-2} if lora else {}
    return tiny_overrides(f"{tmp}/{name}", f"{tmp}/cache", **{
        "training.objective": "dpo", "data.source": source, "run.seed": 5, "training.steps": STEPS,
        "training.seq_len": 96, "training.global_batch_size": GLOBAL, "training.micro_batch_size": mb,
        "optimizer.warmup_steps": 1, "optimizer.lr": 3e-3, "dpo.beta": 0.5, **extra,
        **{f"parallel.{k}": v for k, v in parallel.items()}})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo_layouts")
    source = write_pairs(tmp / "pairs.jsonl")
    single = run_jobs(1, [job(tmp, source, "single", GLOBAL), job(tmp, source, "lora", GLOBAL, lora=True)], str(tmp))
    names = ["ddp2", "fsdp2-acc2", "tp2", "lora-fsdp2"]
    jobs = [job(tmp, source, "ddp2", GLOBAL // 2, dp_replicate=2, dp_shard=1),
            job(tmp, source, "fsdp2-acc2", GLOBAL // 4, dp_shard=2),
            job(tmp, source, "tp2", GLOBAL, tp=2, dp_shard=1),
            job(tmp, source, "lora-fsdp2", GLOBAL // 2, lora=True, dp_shard=2)]
    return single, dict(zip(names, run_jobs(2, jobs, str(tmp))))


def deviation(got: list[float], ref: list[float], floor: float = 1e-3) -> float:
    """The largest relative difference; ``floor`` bounds the denominator (a first step's margins are about 0)."""
    return max(abs(a - b) / max(abs(b), floor) for a, b in zip(got, ref))


def test_dpo_losses_match_single_process(results):
    (reference, lora), layouts = results
    report = []
    for name, res in layouts.items():
        base = lora if name.startswith("lora") else reference
        ref, got = losses(base), losses(res)
        assert len(ref) == STEPS and len(got) == STEPS, res
        margins = [r["rewards/margins"] for r in res["records"]]
        dev = max(deviation(got, ref), deviation(margins, [r["rewards/margins"] for r in base["records"]], 1.0))
        report.append(f"{name}: max rel deviation {dev:.2e}")
        assert dev < 1e-5, "\n".join(report)
    for res in (reference, lora):  # the policy moves away from its reference (random pairs: no trend to expect)
        assert abs(losses(res)[-1] - losses(res)[0]) > 1e-3
    print("\n".join(report))


def test_dpo_global_batches_are_layout_independent(results):
    (reference, lora), layouts = results
    hashes = {tuple(r["batch_hash"] for r in res["records"]) for res in [reference, lora, *layouts.values()]}
    assert len(hashes) == 1 and all(hashes.pop())

"""Layout invariance of the reward model (training.objective reward): padded pairs, the Bradley-Terry loss summed
per pair and divided by the global count of pairs give the single-process loss, pairwise accuracy, margin and
validation statistics at every step under DDP x2 and FSDP2 x2 with accumulation, for full fine-tuning and LoRA (the
head trained, the base frozen) (fp32, within 1e-5 relative over 5 steps, the same global batches); the score head
saved from every layout equals the single process's."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import losses, run_jobs
from tests.tiny import tiny_overrides
from tests.unit.test_reward import write_pairs

STEPS, GLOBAL = 5, 8


def job(tmp, source, name, mb, lora=False, **parallel):
    extra = {"lora.rank": 4, "optimizer.lr": 1e-2} if lora else {}
    # the same 16 held-out pairs in every layout (eval_batches global batches)
    return tiny_overrides(
        f"{tmp}/{name}",
        f"{tmp}/cache",
        **{
            "training.objective": "reward",
            "data.source": source,
            "run.seed": 5,
            "training.steps": STEPS,
            "training.seq_len": 96,
            "training.global_batch_size": GLOBAL,
            "training.micro_batch_size": mb,
            "optimizer.warmup_steps": 1,
            "optimizer.lr": 3e-3,
            "reward.center_coefficient": 0.01,
            "data.val_fraction": 0.2,
            "training.eval_every": STEPS,
            "training.eval_batches": 16 // GLOBAL,
            "checkpoint.at_end": "true",
            **extra,
            **{f"parallel.{k}": v for k, v in parallel.items()},
        },
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reward_layouts")
    source = write_pairs(tmp / "pairs.jsonl", 120)
    single = run_jobs(
        1, [job(tmp, source, "single", GLOBAL), job(tmp, source, "lora", GLOBAL, lora=True)], str(tmp)
    )
    names = ["ddp2", "fsdp2-acc2", "lora-ddp2", "lora-fsdp2-acc2"]
    jobs = [
        job(tmp, source, "ddp2", GLOBAL // 2, dp_replicate=2, dp_shard=1),
        job(tmp, source, "fsdp2-acc2", GLOBAL // 4, dp_shard=2),
        job(tmp, source, "lora-ddp2", GLOBAL // 2, lora=True, dp_replicate=2, dp_shard=1),
        job(tmp, source, "lora-fsdp2-acc2", GLOBAL // 4, lora=True, dp_shard=2),
    ]
    return tmp, single, dict(zip(names, run_jobs(2, jobs, str(tmp))))


def deviation(got: list[float], ref: list[float], floor: float = 1e-3) -> float:
    return max(abs(a - b) / max(abs(b), floor) for a, b in zip(got, ref))


STATS = ("rewards/accuracy", "rewards/margins", "rewards/chosen", "rewards/rejected")


def test_reward_losses_and_statistics_match_single_process(results):
    _, (reference, lora), layouts = results
    report = []
    for name, res in layouts.items():
        base = lora if name.startswith("lora") else reference
        ref, got = losses(base), losses(res)
        assert len(ref) == STEPS and len(got) == STEPS, res
        devs = [deviation(got, ref)]
        for key in STATS:
            devs.append(deviation([r[key] for r in res["records"]], [r[key] for r in base["records"]], 1.0))
            devs.append(
                deviation([res["records"][-1]["val_" + key]], [base["records"][-1]["val_" + key]], 1.0)
            )
        devs.append(deviation([res["records"][-1]["val_loss"]], [base["records"][-1]["val_loss"]]))
        report.append(f"{name}: max rel deviation {max(devs):.2e} (loss {devs[0]:.2e})")
        assert max(devs) < 1e-5, "\n".join(report)
        assert [r["batch_hash"] for r in res["records"]] == [r["batch_hash"] for r in base["records"]]
    for res in (reference, lora):  # the model trains (random pairs: no trend to expect, but it moves)
        assert abs(losses(res)[-1] - losses(res)[0]) > 1e-3
    print("\n".join(report))


def test_the_saved_head_is_the_single_process_one(results):
    """The score head trained under each layout (sharded by FSDP2 or replicated by DDP) is saved whole and equals
    the single process's."""
    from loom.infer.reward import load_reward_model

    tmp, _, layouts = results
    ckpt = lambda name: str(tmp / name / "checkpoints" / f"step_{STEPS:08d}")
    head = {
        name: load_reward_model(ckpt(name)).model.output.weight.detach()
        for name in ["single", "lora", *layouts]
    }
    for name in layouts:
        base = head["lora" if name.startswith("lora") else "single"]
        torch.testing.assert_close(head[name], base, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(head["single"], head["lora"])

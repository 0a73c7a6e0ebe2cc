"""Layout invariance of DPO: pairs of padded sequences, per-pair losses over the global batch's pairs, and the
cached reference computed per pair on whichever rank, give the single-process loss and rewards at every step under
DDP x2, FSDP2 x2 with accumulation and TP x2 (fp32, within 1e-5 relative over 5 steps), with the same global
batches; LoRA with dpo.reference adapters_off likewise under FSDP2 x2; dpo.reference copy (a frozen copy of the
policy in its layout) under DDP x2, FSDP2 x2 with accumulation and TP x2 against its single process; FSDP2 x4 with
accumulation (slow) for the cached reference, the copy and LoRA with adapters_off. In the same process groups, the
other preference methods against their single process: KTO (its KL estimate over the global batch), ORPO (its NLL
token mean over the global batch) and SimPO under DDP x2, FSDP2 x2 with accumulation and TP x2 (sequence parallel,
loss parallel: the defaults), and under LoRA with FSDP2 x2 and accumulation (KTO's reference the adapters off)
against their own LoRA single process. The default run covers each method and the copy under each layout kind at
least once; ``--slow`` adds the rest of the method x layout grid (``BROAD``) to the same process groups."""

from __future__ import annotations

import functools
import json
import random

import pytest

from tests.distributed.harness import losses, run_fn, run_jobs
from tests.tiny import tiny_overrides

STEPS, GLOBAL = 5, 8
WORDS = "the cat sat on a warm mat while two dogs ran past quickly and one bird sang".split()


def write_pairs(path, n: int = 120, seed: int = 0) -> str:
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."
    with open(path, "w") as fh:
        for _ in range(n):
            fh.write(
                json.dumps(
                    {
                        "prompt": say(rng.randint(2, 6)),
                        "chosen": say(rng.randint(2, 8)),
                        "rejected": say(rng.randint(2, 8)),
                    }
                )
                + "\n"
            )
    return str(path)


def write_examples(pairs: str, path, n: int = 40) -> str:
    """KTO's unpaired examples from the first ``n`` pairs (enough for the steps; a short cached reference pass):
    chosen desirable, rejected undesirable."""
    with open(pairs) as src, open(path, "w") as fh:
        for line in list(src)[:n]:
            row = json.loads(line)
            for key, label in (("chosen", True), ("rejected", False)):
                fh.write(json.dumps({"prompt": row["prompt"], "completion": row[key], "label": label}) + "\n")
    return str(path)


# the other preference methods' sections (the dpo section stays at its defaults under them)
METHOD_EXTRA = {
    "kto": {"kto.beta": 0.5, "kto.undesirable_weight": 1.3},
    "orpo": {"orpo.beta": 0.5},
    "simpo": {"simpo.beta": 2.0, "simpo.gamma": 0.3, "simpo.cpo_alpha": 0.5},
}


# under LoRA, each method's reference: DPO's and KTO's the policy with its adapters off; ORPO and SimPO have none
LORA_REFERENCE = {"dpo": {"dpo.reference": "adapters_off"}, "kto": {"kto.reference": "adapters_off"}}


def job(tmp, source, name, mb, lora=False, copy=False, objective="dpo", **parallel):
    extra = {"lora.rank": 4, **LORA_REFERENCE.get(objective, {}), "optimizer.lr": 3e-2} if lora else {}
    extra.update({"dpo.reference": "copy"} if copy else {})
    extra.update(METHOD_EXTRA.get(objective, {"dpo.beta": 0.5}))
    return tiny_overrides(
        f"{tmp}/{name}",
        f"{tmp}/cache",
        **{
            "training.objective": objective,
            "data.source": source,
            "run.seed": 5,
            "training.steps": STEPS,
            "training.seq_len": 96,
            "training.global_batch_size": GLOBAL,
            "training.micro_batch_size": mb,
            "optimizer.warmup_steps": 1,
            "optimizer.lr": 3e-3,
            **extra,
            **{f"parallel.{k}": v for k, v in parallel.items()},
        },
    )


# the grid's other cells (--slow): each method and the copy are covered above under DDP, FSDP2 with accumulation,
# TP and LoRA at least once each; these complete every method x layout pair in the same process groups
BROAD = {"copy-fsdp2-acc2", "orpo-lora-fsdp2-acc2", "simpo-lora-fsdp2-acc2", "kto-ddp2", "orpo-ddp2"}
BROAD |= {"simpo-fsdp2-acc2"}


@pytest.fixture(scope="module")
def results(tmp_path_factory, request):
    broad = request.config.getoption("--slow") or "slow" in (request.config.getoption("markexpr") or "")
    tmp = tmp_path_factory.mktemp("dpo_layouts")
    source = write_pairs(tmp / "pairs.jsonl")
    examples = write_examples(source, tmp / "examples.jsonl")
    single = run_jobs(
        1,
        [
            job(tmp, source, "single", GLOBAL),
            job(tmp, source, "lora", GLOBAL, lora=True),
            job(tmp, source, "copy", GLOBAL, copy=True),
            job(tmp, examples, "kto", GLOBAL, objective="kto"),
            job(tmp, source, "orpo", GLOBAL, objective="orpo"),
            job(tmp, source, "simpo", GLOBAL, objective="simpo"),
            job(tmp, examples, "kto-lora", GLOBAL, lora=True, objective="kto"),
            *(
                [
                    job(tmp, source, "orpo-lora", GLOBAL, lora=True, objective="orpo"),
                    job(tmp, source, "simpo-lora", GLOBAL, lora=True, objective="simpo"),
                ]
                if broad
                else []
            ),
        ],
        str(tmp),
    )
    names = ["ddp2", "fsdp2-acc2", "tp2", "lora-fsdp2", "copy-ddp2", "copy-fsdp2-acc2", "copy-tp2"]
    names += ["kto-fsdp2-acc2", "orpo-fsdp2-acc2", "simpo-ddp2", "kto-tp2", "orpo-tp2", "simpo-tp2"]
    names += ["kto-lora-fsdp2-acc2", "orpo-lora-fsdp2-acc2", "simpo-lora-fsdp2-acc2"]
    names += ["kto-ddp2", "orpo-ddp2", "simpo-fsdp2-acc2"]
    jobs = [
        job(tmp, source, "ddp2", GLOBAL // 2, dp_replicate=2, dp_shard=1),
        job(tmp, source, "fsdp2-acc2", GLOBAL // 4, dp_shard=2),
        job(tmp, source, "tp2", GLOBAL, tp=2, dp_shard=1),
        job(tmp, source, "lora-fsdp2", GLOBAL // 2, lora=True, dp_shard=2),
        job(tmp, source, "copy-ddp2", GLOBAL // 2, copy=True, dp_replicate=2, dp_shard=1),
        job(tmp, source, "copy-fsdp2-acc2", GLOBAL // 4, copy=True, dp_shard=2),
        job(tmp, source, "copy-tp2", GLOBAL, copy=True, tp=2, dp_shard=1),
        job(tmp, examples, "kto-fsdp2-acc2", GLOBAL // 4, objective="kto", dp_shard=2),
        job(tmp, source, "orpo-fsdp2-acc2", GLOBAL // 4, objective="orpo", dp_shard=2),
        job(tmp, source, "simpo-ddp2", GLOBAL // 2, objective="simpo", dp_replicate=2, dp_shard=1),
        job(tmp, examples, "kto-tp2", GLOBAL, objective="kto", tp=2, dp_shard=1),
        job(tmp, source, "orpo-tp2", GLOBAL, objective="orpo", tp=2, dp_shard=1),
        job(tmp, source, "simpo-tp2", GLOBAL, objective="simpo", tp=2, dp_shard=1),
        job(tmp, examples, "kto-lora-fsdp2-acc2", GLOBAL // 4, lora=True, objective="kto", dp_shard=2),
        job(tmp, source, "orpo-lora-fsdp2-acc2", GLOBAL // 4, lora=True, objective="orpo", dp_shard=2),
        job(tmp, source, "simpo-lora-fsdp2-acc2", GLOBAL // 4, lora=True, objective="simpo", dp_shard=2),
        job(tmp, examples, "kto-ddp2", GLOBAL // 2, objective="kto", dp_replicate=2, dp_shard=1),
        job(tmp, source, "orpo-ddp2", GLOBAL // 2, objective="orpo", dp_replicate=2, dp_shard=1),
        job(tmp, source, "simpo-fsdp2-acc2", GLOBAL // 4, objective="simpo", dp_shard=2),
    ]
    keep = [i for i, n in enumerate(names) if broad or n not in BROAD]
    names, jobs = [names[i] for i in keep], [jobs[i] for i in keep]
    return single, dict(zip(names, run_jobs(2, jobs, str(tmp))))


# the single-process runs, in order (the last two only with --slow)
SINGLE = ("single", "lora", "copy", "kto", "orpo", "simpo", "kto-lora", "orpo-lora", "simpo-lora")


def base_of(name: str, single: list[dict]) -> dict:
    """The single-process run a layout's run is compared with: the longest one its name starts with ('kto-lora'
    for 'kto-lora-fsdp2-acc2'), else 'single'."""
    runs = dict(zip(SINGLE, single))
    match = max((s for s in SINGLE if name.startswith(f"{s}-")), key=len, default="single")
    return runs[match]


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    """FSDP2 x4, one pair per micro-batch: 2 micro-batches accumulated per rank."""
    tmp = tmp_path_factory.mktemp("dpo_layouts4")
    source = write_pairs(tmp / "pairs.jsonl")
    names = ["fsdp4-acc2", "lora-fsdp4-acc2", "copy-fsdp4-acc2"]
    jobs = [
        job(tmp, source, "fsdp4-acc2", GLOBAL // 8, dp_shard=4),
        job(tmp, source, "lora-fsdp4-acc2", GLOBAL // 8, lora=True, dp_shard=4),
        job(tmp, source, "copy-fsdp4-acc2", GLOBAL // 8, copy=True, dp_shard=4),
    ]
    return dict(zip(names, run_jobs(4, jobs, str(tmp))))


def deviation(got: list[float], ref: list[float], floor: float = 1e-3) -> float:
    """The largest relative difference; ``floor`` bounds the denominator (a first step's margins are about 0)."""
    return max(abs(a - b) / max(abs(b), floor) for a, b in zip(got, ref))


def test_dpo_losses_match_single_process(results):
    single, layouts = results
    reference, copy, report = single[0], single[2], []
    for name, res in layouts.items():
        base = base_of(name, single)
        ref, got = losses(base), losses(res)
        assert len(ref) == STEPS and len(got) == STEPS, res
        margins = [r["rewards/margins"] for r in res["records"]]
        dev = max(
            deviation(got, ref), deviation(margins, [r["rewards/margins"] for r in base["records"]], 1.0)
        )
        report.append(f"{name}: max rel deviation {dev:.2e}")
        assert dev < 1e-5, "\n".join(report)
    for res in single:  # the policy moves away from its reference (random pairs: no trend to expect)
        assert abs(losses(res)[-1] - losses(res)[0]) > 1e-3
    # the copy's log-probabilities are the cached ones, batched differently (float rounding)
    assert deviation(losses(copy), losses(reference)) < 1e-5
    print("\n".join(report))


@pytest.mark.exhaustive  # 4 ranks: the widest matrix, run by hand (pytest --exhaustive)
def test_dpo_under_fsdp2_x4_with_accumulation_matches_single_process(results, results4):
    report = []
    for name, res in results4.items():
        base = base_of(name, results[0])
        assert len(losses(res)) == STEPS
        margins = [r["rewards/margins"] for r in res["records"]]
        dev = max(
            deviation(losses(res), losses(base)),
            deviation(margins, [r["rewards/margins"] for r in base["records"]], 1.0),
        )
        report.append(f"{name}: max rel deviation {dev:.2e}")
        assert dev < 1e-5, "\n".join(report)
        assert [r["batch_hash"] for r in res["records"]] == [r["batch_hash"] for r in base["records"]]
    print("\n".join(report))


def test_dpo_global_batches_are_layout_independent(results):
    runs = [*results[0], *results[1].values()]
    names = [*SINGLE[: len(results[0])], *results[1]]
    runs = [r for name, r in zip(names, runs) if not name.startswith("kto")]  # other data
    hashes = {tuple(r["batch_hash"] for r in res["records"]) for res in runs}
    assert len(hashes) == 1 and all(hashes.pop())


def copy_under_fsdp(tmp: str, source: str, rank: int, world: int) -> dict:
    """dpo.reference copy under FSDP2 x2 on this rank: the copy's parameters are sharded as the policy's (same
    placements, same local shards at the start), take no gradient, stay sharded between steps (the root's gathered
    weights are released after each reference forward) and bitwise unchanged by training."""
    import torch
    from torch.distributed.tensor import DTensor

    from loom.config import build_config
    from loom.train.trainer import Trainer

    overrides = job(tmp, source, "copy-sharding", GLOBAL // 2, copy=True, dp_shard=2)
    trainer = Trainer(build_config(None, {k: str(v) for k, v in overrides.items()}))
    policy = dict(trainer.parts[0].named_parameters())
    ref = dict(trainer.objective.reference_model.named_parameters())
    same = all(
        isinstance(r, DTensor)
        and r.placements == policy[n].placements
        and torch.equal(r.to_local(), policy[n].to_local())
        for n, r in ref.items()
    )
    before = {n: r.to_local().clone() for n, r in ref.items()}
    full = {n: r.full_tensor() for n, r in ref.items()}
    trainer.fit()
    after = dict(
        trainer.objective.reference_model.named_parameters()
    )  # FSDP2 registers the sharded ones back
    return {
        "names": sorted(ref) == sorted(policy),
        "sharded_as_policy": same,
        "frozen": all(not r.requires_grad and r.grad is None for r in after.values()),
        "resharded": all(
            isinstance(r, DTensor) and r.to_local().shape == before[n].shape for n, r in after.items()
        ),
        "unchanged": all(
            torch.equal(r.full_tensor() if isinstance(r, DTensor) else r, full[n]) for n, r in after.items()
        ),
    }


def test_reference_copy_is_sharded_as_the_policy_under_fsdp2(tmp_path):
    source = write_pairs(tmp_path / "pairs.jsonl")
    got = run_fn(2, functools.partial(copy_under_fsdp, str(tmp_path), source), str(tmp_path))
    assert got == dict.fromkeys(["names", "sharded_as_policy", "frozen", "resharded", "unchanged"], True), got

"""The DeepSeek-V3 and Qwen3-MoE families are layout-invariant: FSDP2 x 2, EP2 (FSDP2 over the rest), TP2 + SP with
tensor-parallel experts (ETP2; DeepSeek's shared experts and MTP module sharded too), PP2 (1F1B, DualPipeV; DeepSeek's
MTP module on the last stage with its own copy of the embedding, untied: summed with the first stage's gradient over
the two ranks, or on one rank under DualPipeV) and CP2 (DeepSeek's latent attention through the all-gather path, its
MTP module included) give one process's loss and grad norm at every step (fp32), with DeepSeek's shared experts,
group-limited sigmoid routing, its aux-loss-free selection bias moving each step (the same max / mean expert load as
one process, and the bias equal on every rank: ``moe_bias_spread`` 0); all in one world-2 job group, where a DualPipeV
run also resumes the 1F1B run's checkpoint (the embedding written once, restored into both of its copies).
Slow (``BROAD``): etp 1, TP with accumulation, the other pipeline schedules (with MTP, the head tied where the
schedule allows; pipedream_2bw with the selection bias frozen), ring CP, LoRA on the latent attention and on Qwen3-MoE's; and on 4 ranks (``FOUR``) EP x FSDP (both families),
EP x TP x DP, CP x TP, PP x TP and PP x EP."""

from __future__ import annotations

import pytest

from tests.distributed.harness import losses, run_jobs
from tests.distributed.test_model_parallel import SAVE_AT, STEPS, ckpt, job, tail

FLAVORS = {
    "ds": {"model.flavor": "deepseek_v3_debug", "model.moe_bias_speed": 0.01},
    "q": {"model.flavor": "qwen3_moe_debug"},
    # untied head: under a pipeline the MTP module's embedding is a copy of the first stage's on the last stage
    "dsu": {
        "model.flavor": "deepseek_v3_debug",
        "model.moe_bias_speed": 0.01,
        "model.tie_embeddings": "false",
    },
    # pipedream_2bw (its reference: the delayed rule on one rank), the selection bias frozen (a moving one is refused
    # under a 2BW pipeline: loom.resolve.check_bias_under_2bw)
    "ds2bw": {
        "model.flavor": "deepseek_v3_debug",
        "model.moe_bias_speed": 0,
        "parallel.pp_schedule": "pipedream_2bw",
    },
    # LoRA on the latent attention's five linears and the shared experts (the rest frozen; the selection bias still
    # moves)
    "dsl": {
        "model.flavor": "deepseek_v3_debug",
        "model.moe_bias_speed": 0.01,
        "lora.rank": 4,
        "lora.targets": "q_a,q_b,kv_a,kv_b,o,shared_gate,shared_up,shared_down",
    },
    # LoRA on Qwen3-MoE's attention (gate, up, down are refused: its MoE blocks have no dense feed-forward)
    "ql": {"model.flavor": "qwen3_moe_debug", "lora.rank": 4, "lora.targets": "q,k,v,o"},
}


def family_job(tmp, name: str, **kw) -> dict:
    return {**job(tmp, name, **kw), **FLAVORS[name.split("-")[0]]}


# the default run's layouts (world 2)
CORE = {
    "ds-fsdp2": dict(dp=2, dp_shard=2),
    "ds-ep2": dict(dp=2, dp_shard=2, ep=2),
    "q-fsdp2": dict(dp=2, dp_shard=2),
    "q-ep2": dict(dp=2, dp_shard=2, ep=2),
    # tensor + sequence parallel with the experts sharded over tp by width; DeepSeek's shared experts column /
    # row-parallel like a dense MLP, its MTP module's projection and norms on the sequence slices
    "ds-tp2-etp2": dict(tp=2, dp_shard=1, etp=2),
    "q-tp2-etp2": dict(tp=2, dp_shard=1, etp=2),
    # pipelines: the dense first block and the MoE blocks split over two stages, 1F1B and DualPipeV, the MTP module
    # on the last stage embedding with its copy of the first stage's embedding (the other rank's, or its own)
    "dsu-pp2-1f1b": dict(m=2, pp=2, dp_shard=1, pp_schedule="1f1b"),
    "dsu-pp2-dualpipev": dict(m=4, pp=2, dp_shard=1, pp_schedule="dualpipev"),
    "q-pp2-1f1b": dict(m=2, pp=2, dp_shard=1, pp_schedule="1f1b"),
    "q-pp2-dualpipev": dict(m=4, pp=2, dp_shard=1, pp_schedule="dualpipev"),
    # context parallel: DeepSeek's latent attention through the all-gather path, its MTP module reading the tokens
    # past each rank's chunks from the other rank
    "ds-cp2": dict(cp=2, dp_shard=1),
    "q-cp2": dict(cp=2, dp_shard=1),
}
# slow (world 2): the experts replicated over tp (etp 1), TP with accumulation, the other pipeline schedules, the
# ring method of context parallelism, LoRA on the latent attention (its PEFT names: tests/unit/test_moe_families.py)
BROAD = {
    "ds-tp2": dict(tp=2, dp_shard=1),
    "q-tp2": dict(tp=2, dp_shard=1),
    "ds-tp2-etp2-m2": dict(m=2, tp=2, dp_shard=1, etp=2),
    **{
        f"{f}-pp2-{s}-m{m}": dict(m=m, pp=2, dp_shard=1, pp_schedule=s)
        for s, m in (
            ("gpipe", 2),
            ("interleaved_1f1b", 2),
            ("looped_bfs", 2),
            ("interleaved_zb", 2),
            ("zbv", 4),
        )
        # DeepSeek's MTP with a tied head under the first three, untied under the two that split the backward
        for f in ("ds" if s in ("gpipe", "interleaved_1f1b", "looped_bfs") else "dsu", "q")
    },
    "ds2bw-pp2": dict(m=2, pp=2, dp_shard=1),
    "ds-cp2-ring": dict(cp=2, dp_shard=1, cp_method="ring"),
    "q-cp2-ring": dict(cp=2, dp_shard=1, cp_method="ring"),
    # under TP the adapters of the replicated compressions (q_a, kv_a) are replicated, the others split
    "dsl-tp2-etp2": dict(tp=2, dp_shard=1, etp=2),
    "dsl-fsdp2": dict(dp=2, dp_shard=2),
    "ql-tp2-etp2": dict(tp=2, dp_shard=1, etp=2),
}


# slow (world 4): compositions of two or three axes. EP2 inside FSDP2 x 4 (two ranks per expert shard); EP2 x TP2
# with tensor-parallel experts over DP2 (DeepSeek's shared experts and MTP module under TP, its routed experts split
# by ep and by width); CP2 x TP2 with DeepSeek's MTP module; pipelines over TP2 and over EP2 (1F1B, DeepSeek's MTP
# module on the last stage)
FOUR = {
    "ds-fsdp4-ep2": dict(dp=4, dp_shard=4, ep=2),
    "q-fsdp4-ep2": dict(dp=4, dp_shard=4, ep=2),
    "ds-dp2-ep2-tp2-etp2": dict(dp=2, dp_shard=2, tp=2, ep=2, etp=2),
    "ds-cp2-tp2": dict(cp=2, tp=2, dp_shard=1),
    "q-dp2-ep2-tp2-etp2": dict(dp=2, dp_shard=2, tp=2, ep=2, etp=2),
    "q-pp2-tp2-1f1b": dict(m=2, pp=2, tp=2, dp_shard=1, pp_schedule="1f1b"),
    "ds-pp2-tp2-1f1b": dict(m=2, pp=2, tp=2, dp_shard=1, pp_schedule="1f1b"),
    "ds-pp2-ep2-1f1b": dict(m=2, dp=2, pp=2, dp_shard=2, ep=2, pp_schedule="1f1b"),
}


@pytest.mark.parametrize("broad", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["core", "broad"])
def test_moe_families_match_single_process(tmp_path, broad):
    layouts = {**BROAD, **FOUR} if broad else CORE
    families = [f for f in FLAVORS if any(n.split("-")[0] == f for n in layouts)]
    ref = dict(
        zip(families, run_jobs(1, [family_job(tmp_path, f"{f}-single") for f in families], str(tmp_path)))
    )
    jobs = {name: family_job(tmp_path, name, **layout) for name, layout in layouts.items()}
    if not broad:
        # the 1F1B run saves at step SAVE_AT; a DualPipeV run resumes it (after it, in the same group)
        jobs["dsu-pp2-1f1b"].update({"checkpoint.every": SAVE_AT, "checkpoint.keep": 0})
        jobs["dsu-pp2-dualpipev-resumed"] = {
            **family_job(tmp_path, "dsu-pp2-dualpipev-resumed", **CORE["dsu-pp2-dualpipev"]),
            "checkpoint.resume": ckpt(str(tmp_path / "dsu-pp2-1f1b"), SAVE_AT),
        }
    by_world = [[n for n in jobs if (n in FOUR) == (world == 4)] for world in (2, 4)]
    results = {
        name: res
        for world, names in zip((2, 4), by_world)
        if names
        for name, res in zip(names, run_jobs(world, [jobs[n] for n in names], str(tmp_path)))
    }
    report, bad = [], []
    resumed = results.pop("dsu-pp2-dualpipev-resumed", None)
    if resumed is not None:
        got, want = tail(resumed), tail(results["dsu-pp2-1f1b"])
        if [s for s, _, _ in got] != list(range(SAVE_AT + 1, STEPS + 1)) or any(
            ha != hb or abs(a - b) / b >= 1e-5 for (_, a, ha), (_, b, hb) in zip(got, want)
        ):
            bad.append(f"dsu-pp2-dualpipev-resumed: {got} where the uninterrupted 1F1B run has {want}")
    for name, res in results.items():
        want = ref[name.split("-")[0]]["records"]
        got = losses(res)
        dev = max(abs(a - b["loss"]) / b["loss"] for a, b in zip(got, want))
        gdev = max(
            abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(res["records"], want)
        )
        report.append(f"{name}: loss {dev:.1e}, grad norm {gdev:.1e}")
        if len(got) != STEPS or not (dev < 1e-5 and gdev < 1e-4):
            bad.append(report[-1])
        if name.startswith("ds") and not name.startswith("ds2bw"):  # its logged loads are not one process's
            if [r["moe_max_load"] for r in res["records"]] != [r["moe_max_load"] for r in want]:
                bad.append(f"{name}: max / mean expert load differs from one process's")
            if any(r["moe_bias_spread"] != 0 for r in res["records"]):
                bad.append(f"{name}: the selection bias differs between ranks")
    print("\n".join(report))
    assert not bad, "\n".join(bad + report)
    assert all(r["records"][-1]["loss"] < r["records"][0]["loss"] for r in ref.values())  # they train

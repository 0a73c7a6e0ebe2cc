"""The planner's estimates next to the GPU runs in bench/results (the table in docs/planner.md).

    PYTHONPATH=. python bench/plan_accuracy.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from loom.plan.hardware import GPUS  # noqa: E402
from loom.plan.planner import estimate  # noqa: E402
from tests.unit.test_plan import MEASURED, MOE_MEASURED, _cfg, _measured  # noqa: E402

EXTRA = [  # runs outside the test's tolerance, shown with the rest: (file, row, overrides, world, GPU)
    ("parallel_2gpu_1b_h200.json", "tp2", dict(MEASURED[0][2], training__global_batch_size=16, parallel__tp=2,
                                                parallel__dp_shard=1), 2, "H200"),
    ("parallel_2gpu_1b_async_tp_h200.json", "tp2_compile", dict(MEASURED[0][2], training__global_batch_size=16,
                                                                 parallel__tp=2, parallel__dp_shard=1,
                                                                 training__compile="true"), 2, "H200"),
    ("train_1b_adamw_h100.json", None, dict(model__flavor="1B", training__seq_len=2048, training__dtype="bfloat16",
                                            training__global_batch_size=4, training__micro_batch_size=4,
                                            training__compile="true"), 1, "H100"),
    # predicted before they were measured (with the planner of 36fc19e), here with the current one
    ("plan_check_3b_h100.json", "fsdp1", dict(model__flavor="3B", training__seq_len=4096, training__dtype="bfloat16",
                                              training__global_batch_size=2, training__micro_batch_size=1,
                                              training__compile="true", training__activation_checkpointing="full",
                                              model__attention="sdpa"), 1, "H100"),
    ("plan_check_1b_h100.json", "fsdp1", dict(model__flavor="1B", training__seq_len=4096, training__dtype="bfloat16",
                                              training__global_batch_size=2, training__micro_batch_size=2,
                                              training__activation_checkpointing="op", model__attention="sdpa"),
     1, "H100"),
    # predicted at 91750cf before they were measured (plan_predictions_91750cf.json), here with the current planner
    ("plan_check2_1b_eager_h100.json", "fsdp1", dict(model__flavor="1B", training__seq_len=2048,
                                                     training__dtype="bfloat16", training__global_batch_size=2,
                                                     training__micro_batch_size=2, model__attention="sdpa"), 1, "H100"),
    ("plan_check2_1b_seq8192_h100.json", "fsdp1", dict(model__flavor="1B", training__seq_len=8192,
                                                       training__dtype="bfloat16", training__global_batch_size=2,
                                                       training__micro_batch_size=1, model__attention="sdpa",
                                                       training__activation_checkpointing="full"), 1, "H100"),
    ("plan_check2_1b_compile_h100.json", "fsdp1", dict(model__flavor="1B", training__seq_len=2048,
                                                       training__dtype="bfloat16", training__global_batch_size=8,
                                                       training__micro_batch_size=4, model__attention="sdpa",
                                                       training__compile="true"), 1, "H100"),
    ("plan_check2_3b_compile_h100.json", "fsdp1", dict(model__flavor="3B", training__seq_len=4096,
                                                       training__dtype="bfloat16", training__global_batch_size=1,
                                                       training__micro_batch_size=1, model__attention="sdpa",
                                                       training__compile="true",
                                                       training__activation_checkpointing="op"), 1, "H100"),
    # mixture of experts (1B shape, 8 experts of 2048, top 2), measured before the planner modelled MoE
    ("moe_1b_8x2048_grouped_h100.json", "fsdp1", dict(MOE_MEASURED[0][1]), 1, "H100"),
    ("moe_1b_8x2048_compile_h100.json", "fsdp1", dict(MOE_MEASURED[1][1]), 1, "H100"),
    ("moe_1b_8x2048_compile_acfull_h100.json", "fsdp1",
     dict(MOE_MEASURED[1][1], training__activation_checkpointing="full"), 1, "H100"),
    # predicted at f465c7e (plan_predictions_moe_f465c7e.json): 16 experts of 1024, top 4, eager, op-level AC
    ("plan_check_moe_a_h100.json", "fsdp1", dict(MOE_MEASURED[0][1], model__moe_experts=16, model__moe_ffn_dim=1024,
                                                  model__moe_top_k=4, training__seq_len=4096,
                                                  training__global_batch_size=2, training__micro_batch_size=2,
                                                  training__activation_checkpointing="op"), 1, "H100"),
    # predicted at dc1b8aa with the MoE terms, before they were measured (plan_predictions_moe_dc1b8aa.json)
    ("plan_check3_moe_p1_h100.json", "fsdp1", dict(MOE_MEASURED[1][1], model__moe_experts=16, model__moe_ffn_dim=1024,
                                                    model__moe_top_k=4), 1, "H100"),
    ("plan_check3_moe_p2_h100.json", "fsdp1", dict(MOE_MEASURED[0][1], training__seq_len=4096,
                                                    training__global_batch_size=2, training__micro_batch_size=2,
                                                    training__activation_checkpointing="full"), 1, "H100"),
    ("plan_check3_moe_p3_h100.json", "fsdp1", dict(MOE_MEASURED[1][1], model__moe_experts=32, model__moe_ffn_dim=512,
                                                    model__moe_top_k=8, training__activation_checkpointing="op"),
     1, "H100"),
]


def measured_row(name, row):
    if row is not None:
        return _measured(name, row)
    import json

    with open(os.path.join(os.path.dirname(__file__), "results", name)) as f:
        r = json.load(f)["results"][0]
    return {"peak_reserved_gib_max_rank": r["peak_reserved_gib"], "tokens_per_s_per_gpu": r["tokens_per_s"]}


def main() -> None:
    print("| run (bench/results) | GPUs | peak GiB measured / estimated | tokens/s per GPU measured / estimated |")
    print("|---|---|---|---|")
    for name, row, over, world, *gpu in [m + ("H200",) for m in MEASURED] + EXTRA:
        run = measured_row(name, row)
        est = estimate(_cfg(**over), world, GPUS[gpu[0]])
        peak = run.get("peak_reserved_gib_max_rank") or run.get("peak_gib_max_rank")
        tps = run["tokens_per_s_per_gpu"]
        mem = est.memory.total / 2**30
        print(f"| {name[:-5]} {row or ''} | {world}x{gpu[0]} | {peak:.1f} / {mem:.1f} ({mem / peak - 1:+.0%}) | "
              f"{tps:,.0f} / {est.tokens_per_s_per_gpu:,.0f} ({est.tokens_per_s_per_gpu / tps - 1:+.0%}) |")


if __name__ == "__main__":
    main()

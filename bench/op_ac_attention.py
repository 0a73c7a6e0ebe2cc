"""Op-level activation checkpointing with loom's attention saved (what the policy does) against the same run with
the attention recomputed in the backward (what it did before the fix): tokens/s and peak memory, one GPU.

    LOOM_COMMIT=<sha> python bench/op_ac_attention.py --flavor 1B --seq 8192 --steps 12 \
        --out bench/results/op_ac_attention.json

Each variant runs in its own process (the policy's save list is patched before the model is built); tokens/s is
the median over the steps after ``--warmup``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ("saved", "recompute")


def run_variant(variant: str, flavor: str, seq: int, steps: int, warmup: int) -> dict:
    import torch

    import loom.parallel.activation_checkpoint as ac
    from tests.distributed.harness import run_one

    if variant == "recompute":
        ac._SAVE_OPS.discard(torch.ops.loom.flash_attn.default)
    cfg = {"run.dir": f"/tmp/op_ac_attention_{variant}", "run.device": "cuda", "training.steps": steps,
           "training.seq_len": seq, "training.global_batch_size": 1, "training.micro_batch_size": 1,
           "optimizer.warmup_steps": 2, "metrics.every": 1, "checkpoint.at_end": "false",
           "metrics.tensorboard": "false", "training.dtype": "bfloat16", "data.document_positions": "true",
           "model.flavor": flavor, "model.attention": "flash", "training.compile": "true",
           "training.activation_checkpointing": "op"}
    recs = run_one(cfg)
    tps = [r["tokens_per_s"] for r in recs[warmup:]]
    return {"variant": variant, "flavor": flavor, "seq": seq, "median_tok_s": statistics.median(tps), "tok_s": tps,
            "mem_gib": recs[-1]["mem_gib"], "losses": [r["loss"] for r in recs]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS, help="run one variant and print its JSON (used internally)")
    p.add_argument("--flavor", default="1B")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--out", default="bench/results/op_ac_attention.json")
    p.add_argument("--commit", default=os.environ.get("LOOM_COMMIT", "unknown"))
    a = p.parse_args()
    if a.variant:
        print("RESULT " + json.dumps(run_variant(a.variant, a.flavor, a.seq, a.steps, a.warmup)), flush=True)
        return
    from bench.train_1b import environment

    results = []
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--flavor", a.flavor, "--seq",
                              str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup)],
                             capture_output=True, text=True, check=True).stdout
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
        print(variant, round(results[-1]["median_tok_s"]), "tok/s", results[-1]["mem_gib"], "GiB", flush=True)
    doc = {"benchmark": "op_ac_attention", "environment": environment(a.commit, " ".join(sys.argv)),
           "results": results, "ratios": {"saved_over_recompute": results[0]["median_tok_s"] / results[1]["median_tok_s"]}}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()

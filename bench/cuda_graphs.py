"""training.cuda_graphs against the same compiled run without it, on one GPU: tokens/s and peak memory of small
flavors, where the host's kernel launches bound the step. Each variant runs in its own process on the same batches.

    python -m bench.cuda_graphs --flavors debug,125M --out bench/results/cuda_graphs_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from bench.common import command, default_commit, environment, run_children, time_steps, write_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"compiled": {}, "compiled_graphs": {"training.cuda_graphs": "true"}}


def run_variant(
    variant: str, flavor: str, micro_batch: int, seq: int, steps: int, warmup: int, run_dir: str
) -> dict:
    import torch

    from loom.config import build_config
    from loom.train.trainer import Trainer

    torch.manual_seed(0)
    cfg = build_config(
        None,
        {
            "model.flavor": flavor,
            "training.seq_len": str(seq),
            "training.global_batch_size": str(micro_batch),
            "training.micro_batch_size": str(micro_batch),
            "training.dtype": "bfloat16",
            "training.steps": "1000",
            "training.compile": "true",
            "checkpoint.at_end": "false",
            "run.dir": os.path.join(run_dir, variant),
            "metrics.tensorboard": "false",
            **VARIANTS[variant],
        },
    )
    trainer = Trainer(cfg)
    batches = [trainer.loader.next_step().micro_batches for _ in range(warmup + steps)]
    torch.cuda.reset_peak_memory_stats()
    times, losses, first_step_s, gpus = time_steps(trainer.train_step, batches, warmup)
    return {
        "variant": variant,
        "flavor": flavor,
        "micro_batch": micro_batch,
        "seq_len": seq,
        "step_ms_median": 1e3 * statistics.median(times),
        "tokens_per_s": micro_batch * seq / statistics.median(times),
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "first_step_s": first_step_s,
        "gpus": gpus,
        "losses": losses,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--flavor", default="debug")
    p.add_argument("--flavors", default="debug,125M")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--out", default="bench/results/cuda_graphs.json")
    p.add_argument("--commit", default=default_commit())
    p.add_argument("--run-dir", default="/tmp/loom_bench_graphs")
    a = p.parse_args()
    if a.variant:  # child: one variant, result as the last stdout line
        res = run_variant(a.variant, a.flavor, a.micro_batch, a.seq, a.steps, a.warmup, a.run_dir)
        print("RESULT " + json.dumps(res), flush=True)
        return
    results, ratios = [], {}
    for flavor in a.flavors.split(","):
        child = [
            "--flavor",
            flavor,
            "--micro-batch",
            str(a.micro_batch),
            "--seq",
            str(a.seq),
            "--steps",
            str(a.steps),
            "--warmup",
            str(a.warmup),
            "--run-dir",
            a.run_dir,
        ]
        got = run_children("bench.cuda_graphs", list(VARIANTS), child, ROOT)
        results += got
        by = {r["variant"]: r for r in got if "error" not in r}
        if len(by) == 2:
            ratios[flavor] = {
                "tokens_per_s": by["compiled_graphs"]["tokens_per_s"] / by["compiled"]["tokens_per_s"],
                "max_loss_diff": max(
                    abs(x - y) for x, y in zip(by["compiled_graphs"]["losses"], by["compiled"]["losses"])
                ),
            }
    write_result(
        a.out,
        {
            "benchmark": "cuda_graphs",
            "environment": environment(a.commit, command()),
            "results": results,
            "ratios": ratios,
        },
    )
    for r in results:
        print(
            r["variant"],
            r.get("flavor"),
            r.get("error", "")[-800:]
            or f"{r['tokens_per_s']:.0f} tok/s, {r['step_ms_median']:.2f} ms, {r['peak_reserved_gib']:.2f} GiB",
        )
    print("ratios:", json.dumps(ratios))


if __name__ == "__main__":
    main()

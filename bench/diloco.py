"""DiLoCo against synchronous data parallelism on the same tokens: the validation loss at the end and the bytes
each rank sends across the replica groups, for several H (``parallel.diloco_inner_steps``).

Every run is a ``loom train`` job on ``--groups`` processes (one replica group each: ``parallel.dp_replicate =
groups``, ``dp_shard = 1``), the same model, data order, global batch, steps and inner AdamW schedule; the
synchronous run is DDP. Validation runs once, at the last step, which is a multiple of every H, so each DiLoCo run
is scored on its outer (synchronized) weights; with ``--fragments`` > 1 or ``--overlap`` > 0 (streaming DiLoCo, its
overlapped reductions) only some fragments are in sync at that step, and the validation loss is the mean of the
groups' losses on their own weights. Bytes: a DiLoCo run logs its all-reduce payload per rank
(``diloco_bytes``); DDP all-reduces each fp32 gradient every step, 4 bytes a parameter a step (the parameter count
is read back from a DiLoCo run's payload).

The reference point: Douillard et al. 2023 ("DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08105) report that with 8 replicas and H = 500 DiLoCo reaches about the perplexity of synchronous data
parallelism on the same tokens (C4, 150M to 400M parameters) while communicating 500 times less. This benchmark's
default is a small model on CPU ranks, far below the paper's scale and token count (few rounds at H = 500): it
checks the mechanics and shows the trend, it does not reproduce the paper's figure.

    nice -n 10 python -m bench.diloco --out bench/results/diloco_cpu.json            # 4 gloo ranks, CPU
    nice -n 10 python -m bench.diloco --hs 50 --fragments 5 --overlap 2 --out bench/results/diloco_overlap_cpu.json
    python -m bench.diloco --device cuda --flavor 125M --steps 3000 --seq 512 --global-batch 64 \\
        --hs 1,50,500 --out bench/results/diloco_4gpu_h100.json                      # 4 GPUs
"""

from __future__ import annotations

import argparse
import os
import tempfile

from bench.common import (
    command,
    config_rejection,
    default_commit,
    environment,
    failure,
    metrics,
    run_train,
    write_result,
)


def job(args, run_dir: str, cache: str, h: int) -> dict:
    cfg = {
        "run.dir": run_dir,
        "run.device": args.device,
        "run.seed": args.seed,
        "data.cache_dir": cache,
        "model.flavor": args.flavor,
        "parallel.dp_replicate": args.groups,
        "parallel.dp_shard": 1,
        "training.steps": args.steps,
        "training.seq_len": args.seq,
        "training.global_batch_size": args.global_batch,
        "training.micro_batch_size": args.global_batch // args.groups,
        "training.eval_every": args.steps,
        "training.eval_batches": args.eval_batches,
        "optimizer.lr": args.lr,
        "optimizer.warmup_steps": max(1, args.steps // 20),
        "metrics.every": max(1, args.steps // 20),
        "metrics.tensorboard": "false",
        "metrics.progress": "false",
        "checkpoint.at_end": "false",
    }
    if h:
        cfg.update(
            {
                "parallel.diloco_inner_steps": h,
                "parallel.diloco_outer_lr": args.outer_lr,
                "parallel.diloco_outer_momentum": args.outer_momentum,
                "parallel.diloco_bf16": str(args.bf16).lower(),
                "parallel.diloco_fragments": args.fragments,
                "parallel.diloco_overlap_steps": args.overlap,
                "parallel.diloco_overlap_alpha": args.alpha,
            }
        )
    return cfg


def variant(args, h: int) -> str:
    if not h:
        return "sync"
    return (
        f"diloco_h{h}"
        + (f"_f{args.fragments}" if args.fragments > 1 else "")
        + (f"_tau{args.overlap}" if args.overlap else "")
    )


def run_one(args, root: str, h: int) -> dict:
    name = variant(args, h)
    run_dir = os.path.join(root, name)
    proc, cmd, wall = run_train(job(args, run_dir, os.path.join(root, "cache"), h), args.groups, args.timeout)
    row = {"variant": name, "inner_steps": h, "command": cmd, "wall_s": wall}
    if proc.returncode:
        row["error"] = config_rejection(proc) or failure(proc)
        return row
    records = metrics(run_dir)
    last = records[-1]
    row.update(val_loss=last["val_loss"], train_loss=last["loss"], steps=last["step"], tokens=last["tokens"])
    if h:
        row["bytes_per_rank"] = last["diloco_bytes"]
        row["synchronizations"] = args.steps // h
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=4, help="replica groups (one process each)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--flavor", default="debug")
    p.add_argument("--steps", type=int, default=1000, help="a multiple of every H")
    p.add_argument("--hs", default="1,50,500", help="comma-separated H values")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW peak LR (cosine schedule)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="the paper's 0.7")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="the paper's Nesterov 0.9")
    p.add_argument("--bf16", action="store_true", help="all-reduce the pseudo-gradients in bfloat16")
    p.add_argument("--fragments", type=int, default=1, help="streaming DiLoCo: fragments synchronized apart")
    p.add_argument(
        "--overlap",
        type=int,
        default=0,
        help="tau: each fragment's all-reduce overlaps this many inner steps (0 = blocking)",
    )
    p.add_argument(
        "--alpha", type=float, default=0.5, help="with --overlap: the local weights' share after a merge"
    )
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--commit", default=default_commit())
    p.add_argument("--out", default="bench/results/diloco_cpu.json")
    args = p.parse_args()
    hs = [int(h) for h in args.hs.split(",")]
    bad = [h for h in hs if h <= 0 or args.steps % h]
    if bad:
        p.error(f"--steps {args.steps} must be a multiple of every H (not of {bad})")
    bad = [h for h in hs if args.fragments > h or args.overlap >= h]
    if bad:
        p.error(f"every H needs --fragments <= H and --overlap < H (not {bad})")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for h in [0] + hs:
            rows.append(run_one(args, root, h))
            print(rows[-1], flush=True)
    params = next(
        (
            r["bytes_per_rank"] / (r["synchronizations"] * (2 if args.bf16 else 4))
            for r in rows
            if r.get("bytes_per_rank")
        ),
        None,
    )
    for r in rows:
        if r["inner_steps"] == 0 and "error" not in r and params:
            r["bytes_per_rank"] = int(4 * params * args.steps)  # DDP: every fp32 gradient, every step
    sync = next((r for r in rows if r["inner_steps"] == 0 and "error" not in r), None)
    for r in rows:
        if sync and "error" not in r and r.get("bytes_per_rank"):
            r["val_loss_vs_sync"] = r["val_loss"] - sync["val_loss"]
            r["bytes_vs_sync"] = r["bytes_per_rank"] / sync["bytes_per_rank"]
    doc = {
        "environment": environment(args.commit, command()),
        "settings": vars(args),
        "parameters": params,
        "reference": "Douillard et al. 2023 (arXiv:2311.08105): 8 replicas, H = 500 reach about the synchronous "
        "baseline's perplexity on the same tokens with 500x less communication",
        "results": rows,
    }
    write_result(args.out, doc)
    print(f"{'variant':<20} {'val_loss':>9} {'vs sync':>8} {'bytes/rank':>14} {'vs sync':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<20} error: {r['error'][:200]}")
            continue
        print(
            f"{r['variant']:<20} {r['val_loss']:>9.4f} {r.get('val_loss_vs_sync', 0):>+8.4f} "
            f"{r.get('bytes_per_rank', 0):>14,} {r.get('bytes_vs_sync', 1):>9.4f}"
        )


if __name__ == "__main__":
    main()

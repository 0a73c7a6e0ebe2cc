"""Two-GPU layouts against one GPU, same run: 1 GPU, FSDP2 x2, TP x2, PP x2 (1F1B and interleaved 1F1B; PipeDream-2BW
with ``--layouts pp2_1f1b,pp2_2bw``, without ``--compile``).

Each layout is a real ``loom train`` job (``--nproc-per-node``), bf16 compute over fp32 master weights,
fused AdamW, seq 2048, at the same tokens per optimizer step per GPU (``--seqs-per-gpu`` sequences).
From each job's metrics.jsonl (the first logged interval, which holds start-up, is dropped):
tokens/s per GPU (median over logged intervals), MFU, peak reserved memory (the largest rank), scaling
efficiency = tokens/s per GPU / the 1-GPU run's, and for pipelines the measured idle fraction per
stage (device events around every forward/backward chunk) next to the schedule's theoretical bubble.

    python -m bench.parallel_2gpu --flavors 1B,3B --out bench/results/parallel_2gpu_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics

from bench.common import command, default_commit, environment, failure, metrics, run_train

SEQ = 2048
# layout -> (GPUs, parallel overrides); micro-batch size chosen in overrides()
LAYOUTS = {
    "single": (1, {}),
    "fsdp2": (2, {"parallel.dp_shard": 2}),
    "tp2": (2, {"parallel.tp": 2, "parallel.dp_shard": 1}),
    "pp2_1f1b": (2, {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "1f1b"}),
    "pp2_interleaved": (
        2,
        {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "interleaved_1f1b"},
    ),
    # PipeDream-2BW: no flush between steps (1-step-delayed weights, so its loss is not the others'): its bubble
    # against pp2_1f1b's (without --compile: loom refuses compile with it)
    "pp2_2bw": (2, {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "pipedream_2bw"}),
    "fsdp2_noreshard": (2, {"parallel.dp_shard": 2, "parallel.reshard_after_forward": "false"}),
    "single_compile": (1, {"training.compile": "true"}),
    # asynchronous (micro-pipelined) TP against plain TP, both compiled (the pass runs in Inductor)
    "tp2_compile": (2, {"parallel.tp": 2, "parallel.dp_shard": 1, "training.compile": "true"}),
    "tp2_async": (
        2,
        {"parallel.tp": 2, "parallel.dp_shard": 1, "training.compile": "true", "parallel.async_tp": "true"},
    ),
}
DEFAULT_LAYOUTS = ("single", "fsdp2", "tp2", "pp2_1f1b", "pp2_interleaved")


def overrides(flavor: str, layout: str, a, run_dir: str) -> dict:
    gpus, par = LAYOUTS[layout]
    micro = a.pp_micro_batch if layout.startswith("pp") else a.micro_batch
    cfg = {
        "model.flavor": flavor,
        "training.seq_len": SEQ,
        "training.dtype": "bfloat16",
        "training.global_batch_size": a.seqs_per_gpu * gpus,
        "training.micro_batch_size": micro,
        "training.steps": a.steps,
        "training.compile": str(a.compile).lower(),
        "training.activation_checkpointing": a.ac,
        "optimizer.lr": 3e-4,
        "optimizer.implementation": "fused",
        "metrics.every": a.every,
        "checkpoint.at_end": "false",
        "metrics.tensorboard": "false",
        "run.dir": run_dir,
        "data.cache_dir": os.path.join(a.run_dir, "cache"),
        "run.device": "cuda",
        # pinned: `auto` times the backends on each layout's per-rank shape, so layouts could differ in kernels
        "model.attention": "sdpa",
    }
    cfg.update(par)
    cfg.update(dict(kv.split("=", 1) for kv in a.set))
    return cfg


def run_layout(flavor: str, layout: str, a, index: int) -> dict:
    gpus, _ = LAYOUTS[layout]
    run_dir = os.path.join(a.run_dir, f"{index:02d}_{flavor}_{layout}")
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh metrics.jsonl (a repeated layout must not append)
    cfg = overrides(flavor, layout, a, run_dir)
    proc, _, wall = run_train(cfg, gpus, a.timeout)
    out = {"flavor": flavor, "layout": layout, "gpus": gpus, "config": cfg, "wall_s": wall}
    if proc.returncode:
        out["error"] = failure(proc)
        return out
    recs = metrics(run_dir)[1:]  # the first interval holds start-up and warm-up
    tps = [r["tokens_per_s_per_device"] for r in recs]
    out.update(
        {
            "log": [ln for ln in proc.stdout.splitlines() if ln.startswith(("loom:", "pipeline"))],
            "intervals": len(recs),
            "tokens_per_s_per_gpu": statistics.median(tps),
            "tokens_per_s_per_gpu_all": tps,
            "mfu": statistics.median(r["mfu"] for r in recs),
            "peak_reserved_gib_max_rank": max(r.get("mem_gib_max_rank", r["mem_gib"]) for r in recs),
            "final_loss": recs[-1]["loss"],
        }
    )
    if layout.startswith("pp"):
        from loom.config.sections import ParallelConfig
        from loom.parallel.pipeline import stages_per_rank, theoretical_bubble

        schedule = cfg["parallel.pp_schedule"]
        per_rank = stages_per_rank(ParallelConfig(pp=2, pp_schedule=schedule))
        m = cfg["training.global_batch_size"] // cfg["training.micro_batch_size"]
        idle = [statistics.median(r["pp_idle"][i] for r in recs) for i in range(2)]
        out.update(
            {
                "microbatches": m,
                "stages_per_rank": per_rank,
                # pipedream_2bw: over the run's steps (filled and drained once)
                "bubble_theoretical": theoretical_bubble(schedule, 2, m, per_rank, cfg["training.steps"]),
                "idle_measured_per_stage": idle,
                "idle_measured_mean": sum(idle) / len(idle),
            }
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--flavors", default="1B,3B")
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--seqs-per-gpu", type=int, default=8, help="sequences per optimizer step per GPU")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument(
        "--pp-micro-batch", type=int, default=2, help="pipelines: micro-batch size (m = global / this)"
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--compile", action="store_true")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra loom config for every layout, e.g. parallel.pp_layers_per_stage=[9,7]",
    )
    p.add_argument("--ac", default="none")
    p.add_argument("--timeout", type=int, default=420)
    p.add_argument("--run-dir", default="/tmp/loom_parallel_bench")
    p.add_argument("--out", default="bench/results/parallel_2gpu.json")
    p.add_argument("--commit", default=default_commit())
    a = p.parse_args()
    results = []
    doc = {"benchmark": "parallel_2gpu", "environment": environment(a.commit, command()), "results": results}
    for flavor in a.flavors.split(","):
        for layout in a.layouts.split(","):
            res = run_layout(flavor, layout, a, len(results))
            base = next(
                (
                    r
                    for r in results
                    if r["flavor"] == flavor and r["layout"] == "single" and "error" not in r
                ),
                None,
            )
            if base and "error" not in res:
                res["scaling_efficiency"] = res["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
            plain = next(
                (
                    r
                    for r in results
                    if r["flavor"] == flavor and r["layout"] == "tp2_compile" and "error" not in r
                ),
                None,
            )
            if layout == "tp2_async" and plain and "error" not in res:
                res["async_vs_plain_tp"] = res["tokens_per_s_per_gpu"] / plain["tokens_per_s_per_gpu"]
            results.append(res)
            print(
                json.dumps(
                    {k: v for k, v in res.items() if k not in ("config", "log", "tokens_per_s_per_gpu_all")}
                ),
                flush=True,
            )
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as fh:  # written after every layout: a timeout keeps what finished
                json.dump(doc, fh, indent=1)
    print(
        f"\n{'flavor':<5} {'layout':<16} {'tok/s/GPU':>10} {'eff':>6} {'MFU':>6} {'GiB':>6} {'bubble th/meas':>15}"
    )
    for r in results:
        if "error" in r:
            print(f"{r['flavor']:<5} {r['layout']:<16} ERROR {r['error'][-400:]}")
            continue
        eff = f"{100 * r['scaling_efficiency']:.1f}%" if "scaling_efficiency" in r else "-"
        bub = (
            f"{100 * r['bubble_theoretical']:.1f}/{100 * r['idle_measured_mean']:.1f}%"
            if "bubble_theoretical" in r
            else "-"
        )
        print(
            f"{r['flavor']:<5} {r['layout']:<16} {r['tokens_per_s_per_gpu']:>10.0f} {eff:>6} "
            f"{100 * (r['mfu'] or 0):>5.1f}% {r['peak_reserved_gib_max_rank']:>6.1f} {bub:>15}"
        )


if __name__ == "__main__":
    main()

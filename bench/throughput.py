"""Training throughput of one flavor on N GPUs, one ``loom train`` job per layout: tokens/s per GPU, MFU,
peak memory, next to published reference points for the same model (context, not a bar: other GPUs,
other software).

Layouts are named by their degrees, joined by ``_``: ``fsdp8``, ``ddp2``, ``hsdp2x4`` (replicate x shard),
``tp2``, ``pp2``, then a pipeline schedule where there is a pipeline, e.g. ``fsdp4_tp2``,
``fsdp2_tp2_pp2_interleaved_1f1b``. Every layout runs the same global batch (``--global-batch``
sequences of ``--seq`` tokens per optimizer step), bf16 compute over fp32 master weights, loom's default
optimizer for the device; tokens/s per GPU is the median of the logged intervals after the first (which
holds compilation and warm-up).

    python -m bench.throughput --gpus 8 --flavor 8B --seq 8192 --layouts fsdp8 --compile --ac op \\
        --out bench/results/throughput_8b_8gpu_h200.json

``--cp-method allgather,ring`` runs every context-parallel layout once per ``parallel.cp_method`` (its rows named
``cp2 (ring)``), so the two sit side by side: peak memory per GPU and tokens/s, e.g. at 64k tokens on 2 GPUs
(op-level checkpointing, where all-gather keeps every layer's gathered K/V; under full checkpointing neither
keeps any, and at cp <= 4 the ring's fp32 dK/dV accumulators make it the larger: docs/parallelism.md)

    python -m bench.throughput --gpus 2 --flavor 8B --seq 65536 --layouts cp2 --cp-method allgather,ring \\
        --global-batch 1 --ac op --out bench/results/throughput_8b_cp_2gpu_h200.json

``--plan FILE`` measures the fastest layout of a ``loom plan --search --json FILE`` instead of ``--layouts``
(its layout, micro-batch size and activation checkpointing), so that a run measures what the planner proposed.

The JSON (and a markdown table beside it) is rewritten after every layout, so a command cut short keeps
what finished; ``--resume`` skips layouts already there. Before each job, ``loom plan``'s estimate of the same
config on this GPU kind is recorded beside it (``predicted``), so every measurement sits next to its prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics

from bench.common import command, config_rejection, default_commit, environment, failure, metrics, run_train

# published figures for context: (flavor, seq) -> list of references
REFERENCES = {
    ("8B", 8192): [
        {
            "source": "torchtitan docs/performance.md Table 1: Llama 3.1 8B, 8x H100 (96 GB HBM2e, 500 W), FSDP, "
            "local batch 2, selective AC, eager",
            "tokens_per_s_per_gpu": 5762,
        },
        {
            "source": "torchtitan docs/performance.md Table 1: same, FSDP + torch.compile",
            "tokens_per_s_per_gpu": 6667,
        },
    ],
}
_AXES = {"fsdp": "dp_shard", "ddp": "dp_replicate", "tp": "tp", "pp": "pp", "cp": "cp"}
CP_METHODS = ("allgather", "ring")  # parallel.cp_method's choices


def parse_layout(name: str) -> dict:
    """``fsdp2_tp2_pp2_1f1b`` -> {"dp_shard": 2, "tp": 2, "pp": 2, "pp_schedule": "1f1b"}; dp_shard is 1
    unless named (loom's default would take every GPU left over)."""
    degrees: dict = {"dp_shard": 1}
    parts = name.split("_")
    while parts:
        m = re.fullmatch(r"(fsdp|ddp|tp|pp|cp)(\d+)", parts[0]) or re.fullmatch(r"hsdp(\d+)x(\d+)", parts[0])
        if not m:
            break
        if parts[0].startswith("hsdp"):
            degrees["dp_replicate"], degrees["dp_shard"] = int(m.group(1)), int(m.group(2))
        else:
            degrees[_AXES[m.group(1)]] = int(m.group(2))
        parts.pop(0)
    if parts:
        if degrees.get("pp", 1) == 1:
            raise SystemExit(
                f"--layouts {name}: '{'_'.join(parts)}' is not a degree (fsdpN, ddpN, hsdpRxS, tpN, "
                "ppN, cpN) and there is no pipeline for it to be a schedule of"
            )
        degrees["pp_schedule"] = "_".join(parts)
    return degrees


def layout_name(layout: dict) -> str:
    """A planner layout dict (``loom plan --json``) -> the name ``parse_layout`` reads (fsdp8, hsdp2x4, fsdp4_tp2,
    fsdp2_pp2_1f1b)."""
    rep, shard = layout["dp_replicate"], layout["dp_shard"]
    parts = (
        [f"hsdp{rep}x{shard}"]
        if rep > 1 and shard > 1
        else [f"ddp{rep}"]
        if rep > 1
        else [f"fsdp{shard}"]
        if shard > 1
        else []
    )
    parts += [f"{axis}{layout[axis]}" for axis in ("tp", "pp", "cp") if layout[axis] > 1]
    if layout.get("ep", 1) > 1 or layout.get("etp", 1) > 1:
        raise SystemExit("bench.throughput has no expert-parallel or tensor-parallel-expert layouts")
    if layout["pp"] > 1:
        parts.append(layout["pp_schedule"])
    name = "_".join(parts) or "fsdp1"
    parsed = parse_layout(name)
    for axis in ("dp_replicate", "dp_shard", "tp", "pp", "cp"):  # the name must say the planner's degrees
        if parsed.get(axis, 1) != layout[axis]:
            raise SystemExit(f"layout {layout} was named {name}, which reads back as {parsed}")
    return name


def cp_methods(text: str) -> list[str]:
    """``--cp-method`` ("allgather,ring") -> the methods, each one of parallel.cp_method's choices."""
    methods = text.split(",")
    bad = [m for m in methods if m not in CP_METHODS]
    if bad or len(set(methods)) != len(methods):
        raise SystemExit(f"--cp-method {text}: expected a comma-separated subset of {', '.join(CP_METHODS)}")
    return methods


def jobs(names: list[str], methods: list[str]) -> list[tuple[str, str | None]]:
    """(layout name, parallel.cp_method) of every job: a context-parallel layout once per method, any other
    once (None: the method does not apply)."""
    return [
        (name, method)
        for name in names
        for method in (methods if parse_layout(name).get("cp", 1) > 1 else [None])
    ]


def label(name: str, cp_method: str | None) -> str:
    """A row's name: the layout, with its cp method where it has one (``cp2 (ring)``)."""
    return name if cp_method is None else f"{name} ({cp_method})"


def planned(path: str) -> tuple[str, int, str]:
    """(layout name, micro-batch size, activation checkpointing) of the fastest layout a ``loom plan --search
    --json`` wrote."""
    with open(path) as fh:
        best = json.load(fh)["search"]["best"][0]["layout"]
    return layout_name(best), best["micro_batch_size"], best["activation_checkpointing"]


def world(degrees: dict) -> int:
    n = 1
    for axis in ("dp_replicate", "dp_shard", "tp", "pp", "cp"):
        n *= degrees.get(axis, 1)
    return n


def job_config(degrees: dict, a, run_dir: str) -> dict:
    cfg = {
        "model.flavor": a.flavor,
        "training.seq_len": a.seq,
        "training.dtype": "bfloat16",
        "training.global_batch_size": a.global_batch,
        "training.micro_batch_size": a.micro_batch,
        "training.steps": a.steps,
        "training.compile": str(a.compile).lower(),
        "training.activation_checkpointing": a.ac,
        "optimizer.lr": 3e-4,
        "metrics.every": a.every,
        "metrics.tensorboard": "false",
        "checkpoint.at_end": "false",
        "run.device": a.device,
        "run.dir": run_dir,
        "data.cache_dir": os.path.join(a.run_dir, "cache"),
        # what `auto` picks on H100/H200 when it times the backends at start-up (docs/kernels.md), pinned so
        # that start-up skips the timing (inside the 10-minute limit) and runs compare with earlier ones
        "model.attention": "sdpa",
    }
    cfg.update({f"parallel.{k}": v for k, v in degrees.items()})
    cfg.update(dict(kv.split("=", 1) for kv in a.set))
    return cfg


def summarize(recs: list[dict]) -> dict:
    """Median tokens/s per GPU and MFU over the logged intervals after the first; peak memory of any rank."""
    timed = recs[1:] or recs
    return {
        "intervals": len(timed),
        "tokens_per_s_per_gpu": statistics.median(r["tokens_per_s_per_device"] for r in timed),
        "tokens_per_s_per_gpu_all": [r["tokens_per_s_per_device"] for r in timed],
        "mfu": statistics.median(r["mfu"] for r in timed) if timed[0].get("mfu") is not None else None,
        "peak_gib_max_rank": max(r.get("mem_gib_max_rank", r["mem_gib"]) for r in recs),
        **(
            {
                "peak_alloc_gib_max_rank": max(
                    r.get("mem_alloc_gib_max_rank", r["mem_alloc_gib"]) for r in recs
                )
            }
            if "mem_alloc_gib" in recs[0]
            else {}
        ),
        "final_loss": recs[-1]["loss"],
        "losses": {r["step"]: r["loss"] for r in recs},  # two layouts' runs compared step by step
    }


def gpu_kind(device: str) -> str | None:
    """The planner's name for the GPU this runs on (H100, H200, A100, B200), None on CPU or another GPU."""
    if device != "cuda":
        return None
    import torch

    from loom.plan.hardware import GPUS

    name = torch.cuda.get_device_name().upper()
    return next((k for k in GPUS if k in name), None)


def predict(cfg: dict, gpus: int, kind: str | None) -> dict:
    """``loom plan``'s estimate of the same job, made before it runs (so measured figures sit beside predicted
    ones); an estimate that fails is recorded, never fatal."""
    if kind is None:
        return {"skipped": "no planner entry for this device"}
    try:
        from loom.config import build_config
        from loom.plan.hardware import GPUS
        from loom.plan.planner import estimate

        est = estimate(build_config(None, {k: str(v) for k, v in cfg.items()}), gpus, GPUS[kind])
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    return {
        "gpu": kind,
        "peak_gib": est.memory.total / 2**30,
        "memory_gib": est.memory.gib(),
        "step_ms": est.time.ms(),
        "tokens_per_s_per_gpu": est.tokens_per_s_per_gpu,
        "mfu": est.mfu,
    }


def run_layout(name: str, cp_method: str | None, a) -> dict:
    degrees = parse_layout(name)
    gpus = world(degrees)
    if cp_method is not None:
        degrees["cp_method"] = cp_method
    run_dir = os.path.join(a.run_dir, f"{a.flavor}_{a.seq}_{name}" + (f"_{cp_method}" if cp_method else ""))
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = job_config(degrees, a, run_dir)
    predicted = predict(cfg, gpus, gpu_kind(a.device))
    proc, command, wall = run_train(cfg, gpus, a.timeout)
    out = {
        "layout": name,
        "cp_method": cp_method,
        "gpus": gpus,
        "degrees": degrees,
        "command": command,
        "wall_s": wall,
        "predicted": predicted,
    }
    if rejected := config_rejection(proc):
        out["rejected"] = rejected
    elif proc.returncode:
        out["error"] = failure(proc)
    else:
        out.update(summarize(metrics(run_dir)))
        out["log"] = [
            ln for ln in proc.stdout.splitlines() if ln.startswith(("loom:", "kernels:", "pipeline"))
        ]
    if notes := [ln for ln in proc.stderr.splitlines() if ln.startswith("loom: note:")]:
        out["notes"] = notes  # the start-up's notes (loom train's memory check), kept whatever the outcome
    return out


def markdown(doc: dict) -> str:
    env, s = doc["environment"], doc["settings"]
    lines = [
        f"# bench.throughput: {s['flavor']}, seq {s['seq']}, global batch {s['global_batch']} "
        f"({env['device']}, torch {env['torch']}, commit {env['commit']})",
        "",
        *[f"`{c}`" for c in doc["invocations"]],
        "",
        "| layout | GPUs | tokens/s per GPU | MFU | peak GiB (max rank; reserved, allocated) | loom plan's "
        "prediction: tokens/s, peak GiB | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        pred = r.get("predicted", {})
        guess = f"{pred['tokens_per_s_per_gpu']:,.0f}, {pred['peak_gib']:.1f}" if "peak_gib" in pred else "-"
        if "tokens_per_s_per_gpu" in r:
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
            alloc = f", {r['peak_alloc_gib_max_rank']:.1f}" if "peak_alloc_gib_max_rank" in r else ""
            lines.append(
                f"| {label(r['layout'], r.get('cp_method'))} | {r['gpus']} | "
                f"{r['tokens_per_s_per_gpu']:,.0f} | {mfu} | {r['peak_gib_max_rank']:.1f}{alloc} | {guess} | |"
            )
        else:
            note = r.get("rejected") or "ERROR: " + r["error"].strip().splitlines()[-1][:160]
            lines.append(
                f"| {label(r['layout'], r.get('cp_method'))} | {r['gpus']} | - | - | - | {guess} | "
                f"{note.replace('|', '/')} |"
            )
    for ref in doc["references"]:
        lines.append(
            f"| reference: {ref['source']} | | {ref['tokens_per_s_per_gpu']:,} | | | | context, not a bar |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=8, help="every layout must use exactly this many")
    p.add_argument("--flavor", default="8B")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--layouts", default="fsdp8")
    p.add_argument(
        "--plan",
        default="",
        metavar="FILE",
        help="measure the fastest layout of this `loom plan --search --json` output (sets --layouts, "
        "--micro-batch and --ac)",
    )
    p.add_argument(
        "--global-batch", type=int, default=0, help="sequences per optimizer step (default: --gpus)"
    )
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--ac", default="op", help="training.activation_checkpointing")
    p.add_argument(
        "--cp-method",
        default="allgather",
        help="parallel.cp_method of the context-parallel layouts; a comma-separated list runs each once per "
        f"method (of {', '.join(CP_METHODS)})",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra loom config for every job"
    )
    p.add_argument("--device", default="cuda", help="cpu: a gloo smoke run of the script itself")
    p.add_argument("--timeout", type=int, default=540)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--run-dir", default="/tmp/loom_throughput")
    p.add_argument("--out", default="bench/results/throughput.json")
    p.add_argument("--commit", default=default_commit())
    a = p.parse_args()
    if a.plan:
        a.layouts, a.micro_batch, a.ac = planned(a.plan)
    a.global_batch = a.global_batch or a.gpus
    names = a.layouts.split(",")
    methods = cp_methods(a.cp_method)
    for name in names:
        if world(parse_layout(name)) != a.gpus:
            raise SystemExit(f"--layouts {name}: uses {world(parse_layout(name))} GPUs, --gpus is {a.gpus}")
    settings = {
        k: getattr(a, k)
        for k in ("flavor", "seq", "global_batch", "micro_batch", "steps", "compile", "ac", "set")
    }
    doc = {
        "benchmark": "throughput",
        "environment": environment(a.commit, command()),
        "settings": settings,
        "references": REFERENCES.get((a.flavor, a.seq), []),
        "results": [],
        "invocations": [],
    }
    if a.resume and os.path.exists(a.out):
        with open(a.out) as fh:
            old = json.load(fh)
        if old["settings"] != settings:
            raise SystemExit(f"--resume: {a.out} was measured with other settings: {old['settings']}")
        doc["results"], doc["invocations"] = old["results"], old["invocations"]
    doc["invocations"].append(doc["environment"]["command"])
    done = {(r["layout"], r.get("cp_method")) for r in doc["results"]}
    for name, cp_method in jobs(names, methods):
        if (name, cp_method) in done:
            continue
        res = run_layout(name, cp_method, a)
        doc["results"].append(res)
        print(
            json.dumps(
                {k: v for k, v in res.items() if k not in ("command", "log", "tokens_per_s_per_gpu_all")}
            ),
            flush=True,
        )
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
        with open(os.path.splitext(a.out)[0] + ".md", "w") as fh:
            fh.write(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()

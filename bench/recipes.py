"""The standard training-performance table: a list of configs (1B, 3B, 8B dense; Qwen3-MoE and DeepSeek-V3 on 1-8
GPUs), each a row with the columns used across the industry (model, #GPUs, GBS, MBS, GA, TP, PP, VP, CP, EP, ETP,
sequence length, precision, time per step, tokens/s per GPU, MFU, peak memory), the measured row next to
``loom plan``'s prediction of the same config.

    python -m bench.recipes                        # every recipe this machine's GPUs can run, measured + predicted
    python -m bench.recipes --predict-only         # the prediction columns only (the default without CUDA)
    python -m bench.recipes --only 8b_fsdp8,8b_tp2 --steps 30 --out bench/results/recipes_h100.json

Each measured row is one ``loom train`` job (synthetic data, ``--steps`` steps, no checkpoint); its time per step,
tokens/s per GPU and MFU are the medians of the logged intervals after the first (compilation and warm-up), its peak
memory the largest rank's. The prediction is ``loom plan``'s estimate of the same config on the GPU kind this runs
on (``--gpu`` on a CPU). A dev tool in bench/, not a ``loom`` command: bench/README.md says why.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from dataclasses import dataclass, field

from bench.common import command, config_rejection, default_commit, environment, failure, metrics, run_train


@dataclass(frozen=True)
class Recipe:
    """One row: ``flavor`` on ``gpus`` GPUs, ``gbs`` sequences of ``seq`` tokens a step in micro-batches of
    ``mbs``; ``settings``: further config fields (dotted names), e.g. the parallel degrees. ``model``: the
    model column's name (default the flavor)."""

    name: str
    flavor: str
    gpus: int
    gbs: int
    mbs: int
    seq: int
    settings: dict = field(default_factory=dict)
    model: str = ""


# the shipped list: bf16 compute over fp32 master weights, torch.compile, FSDP2 over what the other degrees leave;
# every row fits an 80 GB H100 by loom plan's estimate (tests/unit/test_bench_recipes.py checks it)
_COMPILED = {"training.compile": "true"}
RECIPES: list[Recipe] = [
    Recipe("1b_1gpu", "1B", 1, 8, 2, 8192, {**_COMPILED, "training.activation_checkpointing": "op"}),
    Recipe("1b_fsdp2", "1B", 2, 16, 2, 8192, {**_COMPILED, "training.activation_checkpointing": "op"}),
    Recipe("1b_fsdp8", "1B", 8, 64, 2, 8192, {**_COMPILED, "training.activation_checkpointing": "op"}),
    Recipe("3b_1gpu", "3B", 1, 8, 1, 8192, {**_COMPILED, "training.activation_checkpointing": "full"}),
    Recipe("3b_fsdp2", "3B", 2, 16, 1, 8192, {**_COMPILED, "training.activation_checkpointing": "op"}),
    Recipe("3b_fsdp8", "3B", 8, 64, 1, 8192, {**_COMPILED, "training.activation_checkpointing": "op"}),
    Recipe("8b_fsdp2", "8B", 2, 16, 1, 8192, {**_COMPILED, "training.activation_checkpointing": "full"}),
    Recipe("8b_fsdp4", "8B", 4, 32, 1, 8192, {**_COMPILED, "training.activation_checkpointing": "op"}),
    Recipe("8b_fsdp8", "8B", 8, 64, 1, 8192, {**_COMPILED, "training.activation_checkpointing": "op"}),
    Recipe(
        "8b_tp2",
        "8B",
        8,
        64,
        1,
        8192,
        {**_COMPILED, "training.activation_checkpointing": "op", "parallel.tp": 2},
    ),
    Recipe(
        "8b_pp2_vp2",
        "8B",
        8,
        64,
        1,
        8192,
        {
            **_COMPILED,
            "training.activation_checkpointing": "op",
            "parallel.pp": 2,
            "parallel.pp_schedule": "interleaved_1f1b",
            "parallel.pp_virtual_stages": 2,
        },
    ),
    Recipe(
        "8b_cp2_32k",
        "8B",
        8,
        16,
        1,
        32768,
        {**_COMPILED, "training.activation_checkpointing": "full", "parallel.cp": 2},
    ),
    Recipe(
        "qwen3_moe_30b_a3b_ep8",
        "qwen3_moe_30b_a3b",
        8,
        32,
        1,
        4096,
        {**_COMPILED, "training.activation_checkpointing": "full", "parallel.ep": 8},
    ),
    Recipe(
        "qwen3_moe_12l_ep4",
        "qwen3_moe_30b_a3b",
        4,
        16,
        1,
        4096,
        {**_COMPILED, "training.activation_checkpointing": "full", "parallel.ep": 4, "model.n_layers": 12},
        model="qwen3_moe_30b_a3b (12 layers)",
    ),
    Recipe(
        "deepseek_v3_proxy_ep8",
        "deepseek_v3_671b",
        8,
        32,
        1,
        4096,
        # a proxy that fits 8 GPUs: the flavor's MLA, shared expert and grouped sigmoid routing with 4 layers (3
        # dense, 1 MoE), 64 of its 256 experts and no MTP block; eager: its aux-loss-free balancing
        # (model.moe_bias_speed) counts the experts' loads outside compiled blocks
        {
            "training.activation_checkpointing": "full",
            "parallel.ep": 8,
            "model.n_layers": 4,
            "model.moe_experts": 64,
            "model.mtp_depth": 0,
        },
        model="deepseek_v3_671b proxy (4 layers, 64 experts, no MTP)",
    ),
]
BY_NAME = {r.name: r for r in RECIPES}

COLUMNS = ["model", "#GPUs", "GBS", "MBS", "GA", "TP", "PP", "VP", "CP", "EP", "ETP", "seq len", "precision"]
FIGURES = ["time/step s", "tokens/s/GPU", "MFU", "peak GiB"]


def config(recipe: Recipe, run_dir: str = "", steps: int = 30, device: str = "cuda") -> dict:
    """The recipe as ``loom train`` settings (dotted name -> value); a run dir, steps and device for a job."""
    cfg = {
        "model.flavor": recipe.flavor,
        "training.seq_len": recipe.seq,
        "training.global_batch_size": recipe.gbs,
        "training.micro_batch_size": recipe.mbs,
        "training.dtype": "bfloat16",
        "training.steps": steps,
        "metrics.every": log_every(steps),
        "metrics.tensorboard": "false",
        "checkpoint.at_end": "false",
        "run.device": device,
        **recipe.settings,
    }
    if run_dir:
        cfg.update({"run.dir": run_dir, "data.cache_dir": os.path.join(os.path.dirname(run_dir), "cache")})
    return cfg


def log_every(steps: int) -> int:
    """Log every 5 steps, or often enough for at least 5 timed intervals after the first (the median's inputs):
    a short job (``--steps 12`` to fit a device call) logged every 5 had 2."""
    return max(1, min(5, steps // 6))


def layout(recipe: Recipe) -> dict:
    """The table's config columns, from the config as loom resolves it on the recipe's GPUs (GA: micro-batches per
    step per rank; VP: pipeline stages per rank)."""
    from loom.config import build_config
    from loom.parallel.pipeline import stages_per_rank
    from loom.plan.planner import validate

    cfg = build_config(None, {k: str(v) for k, v in config(recipe).items()})
    dims, _, accum = validate(cfg, recipe.gpus)
    p, t = cfg.parallel, cfg.training
    precision = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[t.dtype]
    return {
        "model": recipe.model or recipe.flavor,
        "#GPUs": recipe.gpus,
        "GBS": t.global_batch_size,
        "MBS": t.micro_batch_size,
        "GA": accum,
        "TP": dims.tp,
        "PP": dims.pp,
        "VP": stages_per_rank(p) if dims.pp > 1 else 1,
        "CP": dims.cp,
        "EP": p.ep,
        "ETP": p.etp,
        "seq len": t.seq_len,
        "precision": precision + (f" + {t.float8}" if t.float8 != "none" else ""),
    }


def predict(recipe: Recipe, gpu: str) -> dict:
    """``loom plan``'s estimate of the recipe on ``gpu`` (a planner GPU kind): the table's four figures, and
    whether it fits."""
    from loom.config import build_config
    from loom.plan.hardware import GPUS
    from loom.plan.planner import estimate

    est = estimate(build_config(None, {k: str(v) for k, v in config(recipe).items()}), recipe.gpus, GPUS[gpu])
    return {
        "time/step s": est.time.total,
        "tokens/s/GPU": est.tokens_per_s_per_gpu,
        "MFU": est.mfu,
        "peak GiB": est.memory.total / 2**30,
        "fits": est.fits,
    }


def measure(recipe: Recipe, a) -> dict:
    """One ``loom train`` job of the recipe on this machine's GPUs: the table's four figures (medians of the
    logged intervals after the first; the largest rank's peak), or why it did not run."""
    run_dir = os.path.join(a.run_dir, recipe.name)
    shutil.rmtree(run_dir, ignore_errors=True)
    proc, cmd, wall = run_train(config(recipe, run_dir, a.steps), recipe.gpus, a.timeout)
    out: dict = {"command": cmd, "wall_s": wall}
    if rejected := config_rejection(proc):
        return {**out, "rejected": rejected}
    if proc.returncode:
        return {**out, "error": failure(proc)}
    return {**out, **summarize(metrics(run_dir), recipe)}


def summarize(records: list[dict], recipe: Recipe) -> dict:
    """A job's figures from its metrics.jsonl records: the medians over the logged training intervals after the
    first (compilation and warm-up) of the step time (the step's tokens over tokens/s), tokens/s per GPU and MFU,
    and the largest peak memory of any rank."""
    recs = [r for r in records if r.get("tokens_per_s")]
    timed = recs[1:] or recs
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "intervals": len(timed),
        "time/step s": recipe.gbs * recipe.seq / tps,
        "tokens/s/GPU": tps / recipe.gpus,
        "MFU": statistics.median(mfus) if mfus else None,
        "peak GiB": max(r.get("mem_gib_max_rank", r["mem_gib"]) for r in recs),
    }


def _fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if key == "MFU":
        return f"{100 * v:.1f}%"
    if key == "tokens/s/GPU":
        return f"{v:,.0f}"
    if key in ("time/step s", "peak GiB"):
        return f"{v:.2f}" if key == "time/step s" else f"{v:.1f}"
    return str(v)


def table(rows: list[dict], gpu: str) -> str:
    """The markdown table: the config columns, then measured and predicted (on ``gpu``) figures side by side;
    a row that was not measured shows '-' (and its reason in the last column)."""
    heads = (
        COLUMNS + [f"{f} (measured)" for f in FIGURES] + [f"{f} (plan, {gpu})" for f in FIGURES] + ["note"]
    )
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for row in rows:
        measured, predicted = row.get("measured", {}), row.get("predicted", {})
        note = row.get("note", "")
        if predicted and not predicted.get("fits", True):
            note = (note + "; " if note else "") + "the plan says it does not fit"
        cells = [_fmt(c, row["layout"][c]) for c in COLUMNS]
        cells += [_fmt(f, measured.get(f)) for f in FIGURES] + [_fmt(f, predicted.get(f)) for f in FIGURES]
        lines.append("| " + " | ".join(cells + [note.replace("|", "/")]) + " |")
    return "\n".join(lines)


def gpu_kind(device_name: str) -> str | None:
    """The planner's name for a CUDA device's name (H100, H200, ...), or None."""
    from loom.plan.hardware import GPUS

    return next((k for k in GPUS if k in device_name.upper()), None)


def rows_for(names: list[str], a, cuda_gpus: int, gpu: str) -> list[dict]:
    """A row per recipe: its layout, the plan's prediction, and a measurement where asked and the GPUs allow."""
    rows = []
    for name in names:
        recipe = BY_NAME[name]
        row: dict = {"recipe": name, "config": config(recipe)}
        try:
            row["layout"] = layout(recipe)
            row["predicted"] = predict(recipe, gpu)
        except Exception as err:  # recorded, never fatal: the row still runs
            row["predicted"], row["note"] = {}, f"plan: {type(err).__name__}: {err}"[:200]
        if a.predict_only:
            pass
        elif recipe.gpus > cuda_gpus:
            row["note"] = f"needs {recipe.gpus} GPUs, this machine has {cuda_gpus}"
        else:
            m = measure(recipe, a)
            row["run"] = m
            if "rejected" in m or "error" in m:
                row["note"] = m.get("rejected") or "ERROR: " + m["error"].strip().splitlines()[-1][:160]
            else:
                row["measured"] = {f: m[f] for f in FIGURES}
        rows.append(row)
        if a.out:  # rewritten after every row: a command cut short keeps what finished
            write(a, rows, gpu)
    return rows


def write(a, rows: list[dict], gpu: str) -> None:
    doc = {"environment": environment(a.commit, command()), "planned_on": gpu, "rows": rows}
    with open(a.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(os.path.splitext(a.out)[0] + ".md", "w") as fh:
        fh.write(f"`{command()}`\n\n{table(rows, gpu)}\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.recipes", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--only", default="", help="comma-separated recipe names (default: all); --list names them"
    )
    p.add_argument("--list", action="store_true", help="print the recipes' names and exit")
    p.add_argument("--predict-only", action="store_true", help="no jobs: the prediction columns only")
    p.add_argument("--gpu", default="", help="the planner's GPU kind (default: this machine's, else H100)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--timeout", type=float, default=560.0, help="seconds per job")
    p.add_argument("--run-dir", default="/tmp/loom_bench_recipes")
    p.add_argument("--out", default="", help="JSON (and a .md table beside it), rewritten after every row")
    p.add_argument("--commit", default=default_commit())
    a = p.parse_args(argv)
    if a.list:
        print("\n".join(f"{r.name}: {r.model or r.flavor} on {r.gpus} GPUs" for r in RECIPES))
        return 0
    names = [n for n in a.only.split(",") if n] or list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(
            f"bench.recipes: --only {','.join(unknown)}: no such recipe (known: {', '.join(BY_NAME)})",
            file=sys.stderr,
        )
        return 2
    import torch

    from loom.plan.hardware import GPUS

    cuda_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not cuda_gpus:
        a.predict_only = True
    if a.gpu and a.gpu not in GPUS:
        print(
            f"bench.recipes: --gpu {a.gpu}: not a planner GPU kind (known: {', '.join(GPUS)})",
            file=sys.stderr,
        )
        return 2
    gpu = a.gpu or (gpu_kind(torch.cuda.get_device_name()) if cuda_gpus else None) or "H100"
    rows = rows_for(names, a, cuda_gpus, gpu)
    if a.predict_only:
        print(
            f"prediction only ({'--predict-only' if cuda_gpus else 'no CUDA GPU here'}): loom plan on {gpu}"
        )
    print(table(rows, gpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())

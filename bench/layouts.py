"""Layout invariance on real GPUs (NCCL): every parallel layout's per-step loss against the one-GPU run of
the same global batch, same seed, same data.

Each layout is a real ``loom train --nproc-per-node N`` job: fp32 (matmuls in full fp32 precision: loom
leaves PyTorch's default, TF32 off), ``run.deterministic = true``, ``--steps`` steps, loss logged every
step. The reference runs on one GPU with gradient accumulation; the layouts use their own micro-batch
counts, so accumulation is varied too. A layout passes when every step's loss is within ``--tol`` (relative)
of the reference's. ``--dtype bfloat16`` reports the spread instead (bf16 sums in a layout-dependent order).
A layout that loom rejects (a config error: e.g. too few micro-batches for a V-shaped schedule)
is recorded with the one-line reason, not as a failure.

    python -m bench.layouts --gpus 8 --flavors debug,125M --out bench/results/layouts_8gpu_h200.json

``--cp-method ring`` runs the context-parallel layouts with ring attention (``parallel.cp_method``; rows named
``cp2+ring``), so they sit beside the all-gather rows of an earlier invocation in the same file (``--resume``).

The JSON is written after every layout (a command cut short keeps what finished) and, with ``--resume``,
layouts already in it are skipped, so one matrix can be spread over several commands under a time limit.
A markdown table goes next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

from bench.common import command, config_rejection, default_commit, environment, failure, metrics, run_train

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")
# per flavor: model overrides (enough layers for 4 stages x 2 virtual) and sequence length
# "debug_docs": the debug model on packed documents with per-document positions (the document mask on)
FLAVOR_SETTINGS = {
    "debug": ({"model.n_layers": 8}, 128),
    "125M": ({}, 512),
    "debug_moe": ({"model.n_layers": 8, "model.moe_experts": 8}, 128),
    "debug_docs": ({"model.flavor": "debug", "model.n_layers": 8, "data.document_positions": "true"}, 512),
}
MOE_FLAVORS = ("debug_moe",)
# expert-parallel layouts, run for MoE flavors only (with every other layout); under TP the ep ranks take in tp
EP_LAYOUTS = {
    2: {"fsdp2_ep2": {"dp_shard": 2, "ep": 2}, "tp2_ep2": {"tp": 2, "dp_shard": 1, "ep": 2}},
    4: {
        "fsdp4_ep2": {"dp_shard": 4, "ep": 2},
        "fsdp4_ep4": {"dp_shard": 4, "ep": 4},
        "hsdp2x2_ep2": {"dp_replicate": 2, "dp_shard": 2, "ep": 2},
        "fsdp2_cp2_ep2": {"dp_shard": 2, "cp": 2, "ep": 2},
        "fsdp2_tp2_ep4": {"dp_shard": 2, "tp": 2, "ep": 4},
    },
    8: {
        "fsdp8_ep8": {"dp_shard": 8, "ep": 8},
        "fsdp8_ep2": {"dp_shard": 8, "ep": 2},
        "hsdp2x4_ep4": {"dp_replicate": 2, "dp_shard": 4, "ep": 4},
        "fsdp4_pp2_ep2_1f1b": {"dp_shard": 4, "pp": 2, "ep": 2, "pp_schedule": "1f1b"},
        "fsdp4_cp2_ep4": {"dp_shard": 4, "cp": 2, "ep": 4},
        "fsdp4_tp2_ep4": {"dp_shard": 4, "tp": 2, "ep": 4},
    },
}
GLOBAL_BATCH = 16


def _pp(name: str, schedule: str, **degrees) -> tuple[str, dict]:
    return f"{name}_{schedule}", {**degrees, "pp_schedule": schedule}


def layouts(gpus: int) -> dict[str, dict]:
    """Layout name -> parallel degrees, for ``gpus`` GPUs."""
    table: dict[str, dict] = {}
    if gpus == 2:
        table = {
            "fsdp2": {"dp_shard": 2},
            "ddp2": {"dp_replicate": 2, "dp_shard": 1},
            "tp2": {"tp": 2, "dp_shard": 1},
        }
        table.update(_pp("pp2", s, pp=2, dp_shard=1) for s in SCHEDULES)
        table["cp2"] = {"cp": 2, "dp_shard": 1}
    elif gpus == 4:
        table = {
            "fsdp4": {"dp_shard": 4},
            "hsdp2x2": {"dp_replicate": 2, "dp_shard": 2},
            "fsdp2_tp2": {"dp_shard": 2, "tp": 2},
        }
        table.update(_pp("tp2_pp2", s, tp=2, pp=2, dp_shard=1) for s in SCHEDULES)
        table.update(_pp("fsdp2_pp2", s, pp=2, dp_shard=2) for s in SCHEDULES)
        table.update({"fsdp2_cp2": {"dp_shard": 2, "cp": 2}, "cp2_tp2": {"cp": 2, "tp": 2, "dp_shard": 1}})
    elif gpus == 8:
        table = {
            "fsdp8": {"dp_shard": 8},
            "hsdp2x4": {"dp_replicate": 2, "dp_shard": 4},
            "fsdp4_tp2": {"dp_shard": 4, "tp": 2},
        }
        table.update(_pp("fsdp2_tp2_pp2", s, dp_shard=2, tp=2, pp=2) for s in SCHEDULES)
        table.update(_pp("pp4_tp2", s, pp=4, tp=2, dp_shard=1) for s in SCHEDULES)
        # context parallel: alone with FSDP, with TP, and with PP (a plain and a split-backward schedule)
        table.update(
            {
                "fsdp4_cp2": {"dp_shard": 4, "cp": 2},
                "fsdp2_cp2_tp2": {"dp_shard": 2, "cp": 2, "tp": 2},
                "cp4_tp2": {"cp": 4, "tp": 2, "dp_shard": 1},
            }
        )
        table.update(_pp("fsdp2_cp2_pp2", s, dp_shard=2, cp=2, pp=2) for s in ("1f1b", "zbv"))
    else:
        raise SystemExit(f"--gpus {gpus}: layouts are defined for 2, 4 or 8 GPUs")
    return table


def with_cp_method(table: dict[str, dict], method: str) -> dict[str, dict]:
    """``table`` with ``parallel.cp_method = method`` on its context-parallel layouts, renamed ``name+method``;
    the default (allgather) leaves it as it is."""
    if method == "allgather":
        return table
    return {
        (f"{n}+{method}" if d.get("cp", 1) > 1 else n): (
            {**d, "cp_method": method} if d.get("cp", 1) > 1 else d
        )
        for n, d in table.items()
    }


def applies(flavor: str, degrees: dict) -> bool:
    """Expert parallelism only for MoE flavors."""
    return flavor in MOE_FLAVORS or degrees.get("ep", 1) == 1


def job_config(flavor: str, degrees: dict, a, run_dir: str) -> dict:
    model, seq = FLAVOR_SETTINGS[flavor]
    cfg = {
        "model.flavor": flavor,
        **model,
        "training.seq_len": seq,
        "training.dtype": a.dtype,
        "training.global_batch_size": GLOBAL_BATCH,
        "training.micro_batch_size": 2 if not degrees else 1,
        "training.steps": a.steps,
        "optimizer.lr": a.lr,
        "optimizer.warmup_steps": 5,
        "run.seed": 11,
        "run.deterministic": "true",
        "run.device": a.device,
        "run.dir": run_dir,
        "metrics.every": 1,
        "metrics.tensorboard": "false",
        "checkpoint.at_end": "false",
        "data.cache_dir": os.path.join(a.run_dir, "cache"),
    }
    cfg.update({f"parallel.{k}": v for k, v in degrees.items()})
    return cfg


def run_job(flavor: str, name: str, degrees: dict, a) -> dict:
    gpus = _world(degrees)
    run_dir = os.path.join(a.run_dir, f"{flavor}_{a.dtype}_{name}")
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh metrics.jsonl
    proc, command, wall = run_train(job_config(flavor, degrees, a, run_dir), gpus, a.timeout)
    out = {
        "flavor": flavor,
        "layout": name,
        "gpus": gpus,
        "dtype": a.dtype,
        "degrees": degrees,
        "command": command,
        "wall_s": wall,
    }
    if rejected := config_rejection(proc):
        out["rejected"] = rejected
    elif proc.returncode:
        out["error"] = failure(proc)
    else:
        out["losses"] = [r["loss"] for r in metrics(run_dir)]
    return out


def _world(degrees: dict) -> int:
    n = 1
    for axis in ("dp_replicate", "dp_shard", "tp", "pp", "cp"):
        n *= max(1, degrees.get(axis, 1))
    return n


def compare(res: dict, ref: dict, tol: float, dtype: str) -> None:
    """Adds the largest relative loss difference against the reference and, in fp32, pass or fail."""
    if "losses" not in res or "losses" not in ref:
        return
    got, want = res["losses"], ref["losses"]
    res["steps_compared"] = min(len(got), len(want))
    res["max_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(got, want))
    if len(got) != len(want):
        res["error"] = f"{len(got)} logged steps, reference {len(want)}"
    if dtype == "float32":
        res["pass"] = res["max_rel_diff"] <= tol and len(got) == len(want)


def markdown(doc: dict) -> str:
    env = doc["environment"]
    lines = [
        f"# bench.layouts ({env['device']}, torch {env['torch']}, {doc['dtype']}, {doc['steps']} steps, "
        f"commit {env['commit']})",
        "",
        f"`{env['command']}`",
        "",
        "| flavor | layout | GPUs | max rel. loss diff vs 1 GPU | result | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        if "rejected" in r:
            verdict, diff = "rejected: " + r["rejected"].replace("|", "/"), "-"
        elif "error" in r and "max_rel_diff" not in r:
            verdict, diff = "ERROR", "-"
        else:
            diff = f"{r['max_rel_diff']:.2e}" if "max_rel_diff" in r else "-"
            verdict = (
                "reference"
                if r["layout"] == "single"
                else ("pass" if r.get("pass") else "FAIL" if "pass" in r else "spread")
            )
        lines.append(f"| {r['flavor']} | {r['layout']} | {r['gpus']} | {diff} | {verdict} | {r['wall_s']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--flavors", default="debug,125M", help=f"of {', '.join(FLAVOR_SETTINGS)}")
    p.add_argument("--layouts", default="", help="comma-separated subset (default: all for --gpus)")
    p.add_argument("--device", default="cuda", help="cpu: a gloo smoke run of the script itself")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--cp-method",
        choices=["allgather", "ring"],
        default="allgather",
        help="parallel.cp_method of the context-parallel layouts (ring: their rows named NAME+ring)",
    )
    # 1e-3 with 2 warmup steps made the 125M loss spike (5.4 -> 8.7 at step 3) and chaotic training
    # magnifies rounding differences of any layout; invariance is measured on a stable run
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument(
        "--resume", action="store_true", help="keep the results already in --out, skip those layouts"
    )
    p.add_argument("--run-dir", default="/tmp/loom_layouts")
    p.add_argument("--out", default="bench/results/layouts.json")
    p.add_argument("--commit", default=default_commit())
    a = p.parse_args()
    table = {**layouts(a.gpus), **EP_LAYOUTS.get(a.gpus, {})}
    chosen = a.layouts.split(",") if a.layouts else list(table)
    unknown = [n for n in chosen if n not in table]
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; for {a.gpus} GPUs: {', '.join(table)}")
    renamed = with_cp_method(table, a.cp_method)
    names = dict(zip(table, renamed))
    table, chosen = renamed, [names[n] for n in chosen]
    doc = {
        "benchmark": "layouts",
        "environment": environment(a.commit, command()),
        "dtype": a.dtype,
        "steps": a.steps,
        "global_batch": GLOBAL_BATCH,
        "tol": a.tol,
        "results": [],
    }
    if a.resume and os.path.exists(a.out):
        with open(a.out) as fh:
            old = json.load(fh)
        doc["results"] = old["results"]
        doc["invocations"] = old.get("invocations", [])
    doc.setdefault("invocations", []).append(doc["environment"]["command"])
    done = {(r["flavor"], r["layout"]) for r in doc["results"]}
    for flavor in a.flavors.split(","):
        for name in ["single"] + chosen:
            if (flavor, name) in done or not applies(flavor, table.get(name, {})):
                continue
            res = run_job(flavor, name, {} if name == "single" else table[name], a)
            ref = next((r for r in doc["results"] if r["flavor"] == flavor and r["layout"] == "single"), None)
            if name != "single" and ref:
                compare(res, ref, a.tol, a.dtype)
            doc["results"].append(res)
            print(
                json.dumps({k: v for k, v in res.items() if k not in ("losses", "command", "degrees")}),
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

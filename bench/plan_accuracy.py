"""The planner's estimates next to the GPU runs it is checked against (tests/data/plan_runs.json: each run's
config, GPU and measured peak memory and throughput), as the table in docs/planner.md. CPU only.

    python -m bench.plan_accuracy --out bench/results/plan_accuracy.md
"""

from __future__ import annotations

import argparse
import json
import os

from bench.common import command, default_commit
from loom.config import build_config
from loom.plan.hardware import GPUS
from loom.plan.planner import estimate

RUNS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "plan_runs.json"
)


def row(run: dict) -> str:
    # a run of older code is estimated with its own host waits and gradient rescale under expert parallelism
    # (the file's "about")
    est = estimate(
        build_config(None, run["config"]),
        run["gpus"],
        GPUS[run["gpu"]],
        ep_waits=run.get("ep_host_waits"),
        ep_grad_rescale=run.get("ep_grad_rescale", False),
    )
    peak, tps = run["peak_gib_max_rank"], run["tokens_per_s_per_gpu"]
    mem, est_tps = est.memory.total / 2**30, est.tokens_per_s_per_gpu
    name = run["run"] + (f" ({run['label']})" if run["label"] else "")
    fitted = ", fitted" if run["fitted"] else ""
    return (
        f"| {name} | {run['gpus']}x{run['gpu']} | {peak:.1f} / {mem:.1f} ({mem / peak - 1:+.0%}) | "
        f"{tps:,.0f} / {est_tps:,.0f} ({est_tps / tps - 1:+.0%}{fitted}) |"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="", help="also write the table (markdown) here")
    p.add_argument(
        "--commit", default=default_commit(), help="the commit of the planner measured (LOOM_COMMIT)"
    )
    a = p.parse_args()
    with open(RUNS) as fh:
        runs = json.load(fh)["runs"]
    lines = [
        "| run (tests/data/plan_runs.json) | GPUs | peak GiB measured / estimated | "
        "tokens/s per GPU measured / estimated |",
        "|---|---|---|---|",
    ]
    for run in runs:
        lines.append(row(run))
        print(lines[-1], flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(
                f"# bench.plan_accuracy (the planner at commit {a.commit})\n\n`{command()}`\n\nEstimates against "
                "the measured runs (each run's result file and commit: tests/data/plan_runs.json).\n\n"
                + "\n".join(lines)
                + "\n"
            )


if __name__ == "__main__":
    main()

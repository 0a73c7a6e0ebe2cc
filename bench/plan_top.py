"""The fastest layout of a ``loom plan --search --json FILE`` as ``bench/throughput.py`` arguments, so that the
8-GPU run measures what the planner proposes (issue 5):

    python bench/plan_top.py plan.json        # -> --layouts fsdp8 --micro-batch 2 --ac none
"""

from __future__ import annotations

import json
import sys


def layout_name(layout: dict) -> str:
    """A planner layout dict -> bench/throughput.py's layout name (fsdp8, hsdp2x4, fsdp4_tp2, fsdp2_pp2_1f1b)."""
    rep, shard = layout["dp_replicate"], layout["dp_shard"]
    parts = [f"hsdp{rep}x{shard}"] if rep > 1 and shard > 1 else [f"ddp{rep}"] if rep > 1 else \
        [f"fsdp{shard}"] if shard > 1 else []
    parts += [f"{axis}{layout[axis]}" for axis in ("tp", "pp", "cp") if layout[axis] > 1]
    if layout.get("ep", 1) > 1 or layout.get("etp", 1) > 1:
        raise SystemExit("bench/throughput.py has no expert-parallel or tensor-parallel-expert layouts")
    if layout["pp"] > 1:
        parts.append(layout["pp_schedule"])
    return "_".join(parts) or "fsdp1"


def throughput_args(plan: dict, rank: int = 0) -> list[str]:
    best = plan["search"]["best"][rank]["layout"]
    return ["--layouts", layout_name(best), "--micro-batch", str(best["micro_batch_size"]),
            "--ac", best["activation_checkpointing"]]


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        print(" ".join(throughput_args(json.load(fh))))

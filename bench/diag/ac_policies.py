"""Which matmuls an op-level checkpointing policy keeps, and what that costs: for each policy, what one compiled
block keeps from its forward to its backward and a forward + backward's time, on one GPU, a few blocks of a flavor's
shape under bf16 autocast (fp32 weights, as one GPU trains) with the fused loss. A policy keeps a set of the block's
matmuls by their order (Llama: 1 wq, 2 wk, 3 wv, 4 wo, 5 w1, 6 w3, 7 w2) and, as loom's, the attention; the
rest reruns. ``op`` keeps {1, 3, 5, 7} (torchtitan's every other), ``matmuls`` all seven. docs/parallelism.md,
"Activation checkpointing", reads its result.

    python -m bench.diag.ac_policies --flavor 3B --seq 8192 --layers 4 --out bench/results/ac_policies_3b_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import torch

# (mode, the kept matmuls' positions in a block, or None: the mode's own policy)
POLICIES = (
    ("none", None),
    ("full", None),
    ("op", {1, 3, 5, 7}),
    ("op", {1, 3, 5}),
    ("op", {1, 2, 3, 4, 5}),
    ("op", {1, 2, 3, 4, 5, 7}),
    ("op", {1, 2, 3, 5}),
    ("op", {1, 2, 3, 5, 6}),
    ("op", {1, 2, 3, 4, 5, 6, 7}),
    ("op", {2, 3, 4, 5}),
)


def keeping(save: set[int]):
    """An op-level policy's contexts keeping the block's aten.mm outputs at positions ``save`` (1-based, in the
    forward's order) and what loom's policies keep besides (the attention, the token exchanges)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    import loom.parallel.activation_checkpoint as ac

    def make_contexts():
        counts: dict[str, int] = defaultdict(int)

        def policy(ctx, op, *args, **kwargs):
            mode = "recompute" if ctx.is_recompute else "forward"
            if op == torch.ops.aten.mm.default:
                counts[mode] += 1
                return (
                    CheckpointPolicy.MUST_SAVE if counts[mode] in save else CheckpointPolicy.PREFER_RECOMPUTE
                )
            return CheckpointPolicy.MUST_SAVE if op in ac._SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

        return tuple(ac._ignoring_profiler(m) for m in create_selective_checkpoint_contexts(policy))

    return make_contexts


def measure(
    flavor: str, seq: int, layers: int, batch: int, mode: str, save: set[int] | None, steps: int
) -> dict:
    """``bench.diag.float8_saved.held_per_block`` under bf16 autocast with cuDNN attention and checkpointing ``mode``
    (its matmuls ``save``, or the mode's own policy): held bytes per block, the step's peak above its start and the
    median forward + backward time over ``steps``."""
    import loom.parallel.activation_checkpoint as ac
    from bench.diag.float8_saved import held_per_block

    torch._dynamo.reset()
    torch.cuda.empty_cache()  # the previous policy's model is gone by now
    policy = ac._op_policy
    if save is not None:
        ac._op_policy = lambda every_matmul=False: keeping(save)
    try:
        row = held_per_block(
            flavor, seq, "none", layers, batch, autocast=True, ac=mode, attention="sdpa_cudnn", timed=steps
        )
    finally:
        ac._op_policy = policy
    return {
        "ac": mode,
        "save": sorted(save) if save else None,
        "held_per_block_mib": row["held_per_block_mib"],
        "peak_above_start_mib": row["step_peak_above_start_mib"],
        "ms": row.get("ms"),  # none with --steps 0
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--flavor", default="3B")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/diag/ac_policies.py: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    rows = []
    for mode, save in POLICIES:
        rows.append(measure(a.flavor, a.seq, a.layers, a.batch, mode, save, a.steps))
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        from bench.common import command, default_commit, environment, write_result

        write_result(a.out, {"environment": environment(default_commit(), command()), "rows": rows})


if __name__ == "__main__":
    main()

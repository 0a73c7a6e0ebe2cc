"""The MoE layer's experts: grouped GEMM (``torch._grouped_mm``) vs a loop of one matmul per expert, forward +
backward, in the same run (two rounds in alternating order, the faster counts), as in training: fp32 weights
under bf16 autocast, the router included.

    python -m bench.moe --out bench/results/moe_layer_h100.json

TFLOP/s count the routed work only: 6 x tokens x top_k x 3 x dim x hidden (forward + backward).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.common import bench_ms, command, default_commit, environment
from loom.models.common.moe import MoE

# (tokens, dim, hidden, experts, top_k): a 1B-wide layer with 8 experts of width 2048 and with 64 small ones
CASES = [
    (8192, 2048, 2048, 8, 2),
    (16384, 2048, 2048, 8, 2),
    (8192, 2048, 1024, 64, 8),
    (8192, 4096, 1792, 16, 2),
]


def time_case(tokens: int, dim: int, hidden: int, n: int, k: int) -> dict:
    torch.manual_seed(0)
    moe = MoE(dim, hidden, n, k, aux_loss=0.01).cuda()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(tokens // 2048, 2048, dim, device="cuda", requires_grad=True)
    params = [x, *moe.parameters()]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = moe(x)
        out.float().square().mean().backward()

    flops = 6 * tokens * k * 3 * dim * hidden
    row = {"tokens": tokens, "dim": dim, "hidden": hidden, "experts": n, "top_k": k, "rounds": []}
    for order in (("grouped", "loop"), ("loop", "grouped")):
        times = {}
        for name in order:
            moe.experts.grouped = name == "grouped"
            times[name] = bench_ms(step, grads=params)
        row["rounds"].append(times)
    for name in ("grouped", "loop"):
        ms = min(r[name] for r in row["rounds"])
        row[name] = {"ms": ms, "tflops": flops / ms / 1e9}
    row["grouped_speedup"] = row["loop"]["ms"] / row["grouped"]["ms"]
    print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/moe_layer.json")
    p.add_argument("--commit", default=default_commit())
    a = p.parse_args()
    doc = {"benchmark": "moe_layer", "environment": environment(a.commit, command()), "rows": []}
    for case in CASES:
        doc["rows"].append(time_case(*case))
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()

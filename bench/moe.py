"""The MoE layer's experts: grouped GEMM (``torch._grouped_mm``) vs a loop of one matmul per expert, forward +
backward, in the same run (two rounds in alternating order, the faster counts), as in training: fp32 weights
under bf16 autocast, the router included.

    python -m bench.moe --out bench/results/moe_layer_h100.json
    python -m bench.moe --phases --out bench/results/moe_phases_h200.json

TFLOP/s count the routed work only: 6 x tokens x top_k x 3 x dim x hidden (forward + backward).

``--phases``: where one layer's time goes, forward + backward of each part timed alone on the layer's own inputs
(``phase_times``): the router (gate, scores, top-k), the permutation (tokens sorted into expert order and back,
weighted by the router, with the experts left out), the grouped experts, the whole layer, and the whole layer with
the host reading its token counts as expert parallelism must before its all-to-all (the price of that wait on one
GPU: the device drains and the host launches the rest anew). Cases include the Qwen3-30B-A3B and DeepSeek-V3
layers of bench.peers' workloads.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.common import bench_ms, command, default_commit, environment
from loom.models.common.moe import LOCAL_EXPERTS, LocalExperts, MoE

# (tokens, dim, hidden, experts, top_k): a 1B-wide layer with 8 experts of width 2048 and with 64 small ones
CASES = [
    (8192, 2048, 2048, 8, 2),
    (16384, 2048, 2048, 8, 2),
    (8192, 2048, 1024, 64, 8),
    (8192, 4096, 1792, 16, 2),
]


# (name, tokens, dim, hidden, experts, top_k, shared): the MoE layers of bench.peers' workloads, one GPU's tokens
PHASE_CASES = [
    ("qwen3_moe_30b_a3b", 8192, 2048, 768, 128, 8, 0),
    ("deepseek_v3_proxy", 4096, 7168, 2048, 64, 8, 1),
]


class _HostRead(LocalExperts):
    """One device's experts, the token counts read on the host first (what expert parallelism's exchange needs)."""

    def run(self, experts, x, counts):
        counts.tolist()
        return experts(x, counts)


class _NoExperts(LocalExperts):
    """The experts left out: the slots come back as they went (the permutation and the weighted sum remain)."""

    def run(self, experts, x, counts):
        return x


def phase_times(moe: MoE, x: torch.Tensor, timer=None, dtype=torch.bfloat16) -> dict:
    """ms per forward + backward of each part of ``moe`` on ``x`` (B, S, E) under ``dtype`` autocast:
    ``router``, ``permutation``, ``experts``, ``layer`` and ``layer_host_read``; ``timer(fn, grads)`` -> ms (default
    ``bench_ms``, CUDA)."""
    timer = timer or bench_ms
    device = x.device.type
    params = [x, *moe.parameters()]
    flat = x.detach().reshape(-1, x.shape[-1])
    with torch.no_grad(), torch.autocast(device, dtype=dtype):
        _, chosen, _ = moe.router(flat)
    order = chosen.flatten().argsort(stable=True)
    counts = torch.bincount(chosen.flatten(), minlength=moe.n_experts)
    slots = flat[order // moe.top_k].to(dtype).requires_grad_()

    def backward(out):
        out.float().square().mean().backward()

    def router():
        with torch.autocast(device, dtype=dtype):
            weights, _, probs = moe.router(x.reshape(-1, x.shape[-1]))
        backward(weights.float().sum() + probs.float().sum())

    def experts():
        with torch.autocast(device, dtype=dtype):
            out = moe.experts(slots, counts)
        backward(out)

    def layer():
        with torch.autocast(device, dtype=dtype):
            out = moe(x)
        backward(out)

    times = {"router": timer(router, params), "experts": timer(experts, [slots, *moe.experts.parameters()])}
    for name, parallel in (("permutation", _NoExperts()), ("layer_host_read", _HostRead()), ("layer", None)):
        moe.parallel = parallel or LOCAL_EXPERTS
        times[name] = timer(layer, params)
    moe.parallel = LOCAL_EXPERTS
    return times


def time_phases(name: str, tokens: int, dim: int, hidden: int, n: int, k: int, shared: int) -> dict:
    torch.manual_seed(0)
    moe = MoE(dim, hidden, n, k, shared=shared).cuda()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(tokens // 4096, 4096, dim, device="cuda", requires_grad=True)
    row = {
        "case": name,
        "tokens": tokens,
        "dim": dim,
        "hidden": hidden,
        "experts": n,
        "top_k": k,
        "shared": shared,
    }
    row["ms"] = phase_times(moe, x)
    row["host_read_ms"] = row["ms"]["layer_host_read"] - row["ms"]["layer"]
    print(json.dumps(row), flush=True)
    return row


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
    p.add_argument(
        "--phases", action="store_true", help="where a layer's time goes (PHASE_CASES), not grouped vs loop"
    )
    p.add_argument("--commit", default=default_commit())
    a = p.parse_args()
    name = "moe_phases" if a.phases else "moe_layer"
    doc = {"benchmark": name, "environment": environment(a.commit, command()), "rows": []}
    for case in PHASE_CASES if a.phases else CASES:
        doc["rows"].append(time_phases(*case) if a.phases else time_case(*case))
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()

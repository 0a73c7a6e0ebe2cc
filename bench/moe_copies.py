"""Where the MoE layer's copies come from: forward + backward of one MoE layer as in training (fp32 weights under
bf16 autocast, router included) under torch.profiler, GPU time per aten op and input shapes, for the copy / cast /
gather / scatter ops; then, in the same run, the layer timed with each expert weight layout that
``loom.models.common.moe.Experts`` could use (``--layouts``), two alternating rounds (the faster counts).

    python bench/moe_copies.py --out bench/results/moe_copies_h100.json

The step profiles of bench/results/trace_moe_*_h100.json put 28-47 ms per step in copies / casts; this says which
ops they are and how many bytes each moves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernels import bench_ms  # noqa: E402
from bench.train_1b import environment  # noqa: E402
from loom.models.common.moe import MoE  # noqa: E402

# (tokens, dim, hidden, experts, top_k): the two profiled 1B MoE shapes
CASES = [(8192, 2048, 2048, 8, 2), (8192, 2048, 1024, 16, 4)]
COPY_OPS = ("copy", "_to_copy", "clone", "contiguous", "index", "gather", "scatter", "cat", "add", "mul", "sort",
            "argsort", "fill", "zero", "sum")


class _Layout(torch.nn.Module):
    """The experts' grouped path with another weight layout (the same math): ``hidden_dim`` stores w1 / w3 as
    (n, H, E) and w2 as (n, E, H) and passes transposed views (torchtitan's layout, HF's per-expert Linear);
    ``fused13`` stores w1 and w3 side by side as one (n, E, 2H) weight: one grouped GEMM and one cast for both."""

    def __init__(self, experts, layout: str):
        super().__init__()
        self.layout, self.gate = layout, experts._gate
        w1, w3, w2 = experts.w1.data, experts.w3.data, experts.w2.data
        if layout == "hidden_dim":
            self.w1 = torch.nn.Parameter(w1.mT.contiguous())
            self.w3 = torch.nn.Parameter(w3.mT.contiguous())
            self.w2 = torch.nn.Parameter(w2.mT.contiguous())
        else:
            self.w13 = torch.nn.Parameter(torch.cat([w1, w3], dim=-1))
            self.w2 = torch.nn.Parameter(w2.clone())

    def forward(self, x, counts):
        offsets = counts.cumsum(0).to(torch.int32)
        x = x.to(torch.bfloat16)
        with torch.autocast("cuda", enabled=False):
            if self.layout == "hidden_dim":
                w1, w3, w2 = (w.to(torch.bfloat16).mT for w in (self.w1, self.w3, self.w2))
                h = self.gate(torch._grouped_mm(x, w1, offs=offsets), torch._grouped_mm(x, w3, offs=offsets))
            else:
                w13, w2 = self.w13.to(torch.bfloat16), self.w2.to(torch.bfloat16)
                a, b = torch._grouped_mm(x, w13, offs=offsets).chunk(2, dim=-1)
                h = self.gate(a, b)
            return torch._grouped_mm(h, w2, offs=offsets)


def set_layout(moe: MoE, layout: str) -> None:
    if layout != "dim_hidden":
        moe.experts = _Layout(moe.experts, layout)


def make_layer(tokens: int, dim: int, hidden: int, n: int, k: int) -> tuple[MoE, torch.Tensor]:
    torch.manual_seed(0)
    moe = MoE(dim, hidden, n, k, aux_loss=0.01).cuda()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(tokens // 2048, 2048, dim, device="cuda", requires_grad=True)
    return moe, x


def step_fn(moe: MoE, x: torch.Tensor):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = moe(x)
        out.float().square().mean().backward()
    return step


def profile_ops(step, grads, top: int = 25) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        for g in grads:
            g.grad = None
        step()
    torch.cuda.synchronize()
    for g in grads:
        g.grad = None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        name = e.key.removeprefix("aten::")
        gpu_us = getattr(e, "self_device_time_total", 0.0)
        if gpu_us <= 0 or not any(name.startswith(op) or op in name for op in COPY_OPS):
            continue
        rows.append({"op": e.key, "shapes": str(e.input_shapes)[:200], "calls": e.count, "gpu_ms": gpu_us / 1e3})
    rows.sort(key=lambda r: -r["gpu_ms"])
    total = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    for r in rows[:top]:
        print(f"  {r['gpu_ms']:8.3f} ms  x{r['calls']:<3d} {r['op']:<28s} {r['shapes']}", flush=True)
    print(f"  total GPU time of the step {total:.2f} ms", flush=True)
    return [{"total_gpu_ms": total}] + rows[:top]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/moe_copies.json")
    p.add_argument("--commit", default=os.environ.get("LOOM_COMMIT", "unknown"))
    p.add_argument("--layouts", default="dim_hidden", help="comma-separated layouts to time: dim_hidden (loom's), hidden_dim, fused13")
    a = p.parse_args()
    doc = {"benchmark": "moe_copies", "environment": environment(a.commit, " ".join(["python"] + sys.argv)),
           "rows": []}
    layouts = a.layouts.split(",")
    for case in CASES:
        tokens, dim, hidden, n, k = case
        row = {"tokens": tokens, "dim": dim, "hidden": hidden, "experts": n, "top_k": k, "profiles": {},
               "rounds": []}
        layers = {}
        for layout in layouts:
            moe, x = make_layer(*case)
            set_layout(moe, layout)
            layers[layout] = (moe, x)
            print(f"{case} layout {layout}: ops by GPU time", flush=True)
            row["profiles"][layout] = profile_ops(step_fn(moe, x), [x, *moe.parameters()])
        for order in (layouts, layouts[::-1]):
            times = {}
            for layout in order:
                moe, x = layers[layout]
                times[layout] = bench_ms(step_fn(moe, x), grads=[x, *moe.parameters()])
            row["rounds"].append(times)
        row["ms"] = {layout: min(r[layout] for r in row["rounds"]) for layout in layouts}
        print(json.dumps({"case": case, "ms": row["ms"]}), flush=True)
        doc["rows"].append(row)
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()

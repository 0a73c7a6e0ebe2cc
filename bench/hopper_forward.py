"""The Gluon attention forward for Hopper (loom/kernels/attention/hopper.py) against loom's Triton forward, in the
same process: correctness first (against an fp32 reference, and against the Triton forward), then forward
TFLOP/s of each Gluon block config and of the autotuned Triton forward, two rounds in alternating order (the
faster round counts). cuDNN SDPA's forward is timed alongside as context.

    python bench/hopper_forward.py --out bench/results/hopper_forward_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernels import bench_ms  # noqa: E402
from bench.train_1b import environment  # noqa: E402

CONFIGS = [(128, 128, 8), (128, 64, 8), (64, 128, 4), (64, 64, 4)]
SHAPES = [(64, 32, 32, 4096), (64, 32, 32, 8192), (64, 32, 32, 16384), (128, 32, 32, 4096), (128, 32, 32, 8192),
          (128, 32, 32, 16384), (128, 32, 8, 8192), (64, 32, 8, 8192)]  # (head dim, q heads, kv heads, seq)
TOKENS = 32768


def gluon_forward(q, k, v, causal, config):
    """One Gluon config, no autotuning -> (out, lse)."""
    import triton

    from loom.kernels.attention import hopper

    triton.set_allocator(hopper._allocator)
    bm, bn, warps = config
    bsz, hq, seq, dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(bsz, hq, seq, dtype=torch.float32, device=q.device)
    hopper._attn_fwd_hopper[(triton.cdiv(seq, bm), bsz * hq)](
        q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], seq, hq,
        hq // k.shape[1], seq, q.shape[-1] ** -0.5 * hopper.LOG2E, CAUSAL=causal, HEAD_DIM=dim, BLOCK_M=bm,
        BLOCK_N=bn, num_warps=warps)
    return out, lse


def triton_forward(q, k, v, causal):
    from loom.kernels.attention import triton as kernels

    return kernels.triton_forward(q, k, v, causal, None, 0, q.shape[-1] ** -0.5)


def make_qkv(d, hq, hkv, s, batch, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # (B, S, H, D) storage seen as (B, H, S, D), as the model passes it
    q = torch.randn(batch, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k = torch.randn(batch, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    v = torch.randn(batch, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    return q, k, v


def reference(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    kf, vf = (t.float().repeat_interleave(group, 1) for t in (k, v))
    return F.scaled_dot_product_attention(q.float(), kf, vf, is_causal=causal)


def check(configs) -> list[dict]:
    """Max abs error of each config against the fp32 reference, next to the Triton forward's and bf16
    SDPA's, on odd lengths (masked tails) and GQA; LSE against the Triton forward's."""
    rows = []
    for d, hq, hkv, s, causal in [(64, 4, 4, 1000, True), (128, 4, 2, 777, True), (128, 4, 4, 1024, False),
                                  (64, 8, 2, 300, False), (128, 2, 2, 64, True), (64, 2, 1, 129, True)]:
        q, k, v = make_qkv(d, hq, hkv, s, 2)
        ref = reference(q, k, v, causal)
        t_out, t_lse = triton_forward(q, k, v, causal)
        group = hq // hkv
        sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                              is_causal=causal)
        row = {"shape": [d, hq, hkv, s], "causal": causal, "triton_err": (t_out.float() - ref).abs().max().item(),
               "sdpa_bf16_err": (sdpa.float() - ref).abs().max().item()}
        for c in configs:
            out, lse = gluon_forward(q, k, v, causal, c)
            torch.cuda.synchronize()
            err = (out.float() - ref).abs().max().item()
            row[str(c)] = {"err": err, "lse_diff": (lse - t_lse).abs().max().item(),
                           "nan": bool(torch.isnan(out).any().item())}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def timing(configs, causal=True) -> list[dict]:
    rows = []
    for d, hq, hkv, s in SHAPES:
        batch = max(1, TOKENS // s)
        q, k, v = make_qkv(d, hq, hkv, s, batch)
        flops = 4 * batch * hq * s * s * d * (0.5 if causal else 1.0)
        fns = {"triton": lambda: triton_forward(q, k, v, causal)}
        for c in configs:
            fns[f"gluon{c}"] = (lambda c=c: gluon_forward(q, k, v, causal, c))
        group = hq // hkv
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

        def cudnn():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)
        fns["cudnn"] = cudnn
        best = {}
        for rnd, names in enumerate((list(fns), list(reversed(fns)))):
            for name in names:
                try:
                    ms = bench_ms(fns[name])
                except Exception as e:  # a config that does not compile or launch is recorded, not fatal
                    best.setdefault(name, {"error": str(e)[:300]})
                    continue
                prev = best.get(name, {}).get("ms")
                best[name] = {"ms": ms if prev is None else min(prev, ms), f"round{rnd}": ms,
                              **{k2: v2 for k2, v2 in best.get(name, {}).items() if k2.startswith("round")}}
        for name, r in best.items():
            if "ms" in r:
                r["tflops"] = flops / r["ms"] / 1e9
        tri = best["triton"]["ms"]
        row = {"shape": [d, hq, hkv, s], "batch": batch, "causal": causal, "results": best,
               "speedup_vs_triton": {n: tri / r["ms"] for n, r in best.items() if "ms" in r}}
        rows.append(row)
        print(json.dumps({"shape": row["shape"], **{n: round(r.get("tflops", 0), 1) for n, r in best.items()}}),
              flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--commit", default=os.environ.get("LOOM_COMMIT", "unknown"))
    p.add_argument("--skip-timing", action="store_true")
    a = p.parse_args()
    result = {"env": environment(a.commit, "python " + " ".join(sys.argv)), "configs": CONFIGS}
    result["check"] = check(CONFIGS)
    if not a.skip_timing:
        result["timing"] = timing(CONFIGS)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""The warp-specialized Gluon dK/dV kernel for Hopper (loom/kernels/attention/hopper.py) against loom's Triton
dK/dV kernel, same process: gradients first (dK, dV of both kernels against an fp32 autograd reference, next to
bf16 SDPA's error, and the Gluon kernel's difference from the Triton kernel's), then ms per call of each Gluon
config, of its autotuned choice and of the autotuned Triton kernel on the same inputs (causal MHA; two rounds in
alternating order, the faster counts), with the Triton dQ kernel's time for scale. Rows are appended to
$HOPPER_DKDV_PARTIAL as they finish. ``--smoke i``: one small call of config i (a hang check).

    python bench/hopper_dkdv.py --out bench/results/hopper_ws_dkdv_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernels import two_rounds  # noqa: E402
from bench.train_1b import environment  # noqa: E402

CONFIGS = [(64, 128, 2, False), (64, 128, 2, True), (64, 128, 3, True)]
SHAPES = [(128, 32, 4096), (128, 32, 8192), (128, 32, 16384), (64, 32, 4096), (64, 32, 8192), (64, 32, 16384)]
TOKENS = 32768
OUT = os.environ.get("HOPPER_DKDV_PARTIAL", "/tmp/hopper_dkdv_partial.jsonl")


def make(d, h, s, batch, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # (B, S, H, D) storage seen as (B, H, S, D), as the model passes it
    q, k, v, do = (torch.randn(batch, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
                   for _ in range(4))
    return q, k, v, do


def inputs(q, k, v, do, causal):
    from loom.kernels.attention import triton as T

    scale = q.shape[-1] ** -0.5
    out, lse = T.attention_forward(q, k, v, causal, None, 0, scale)
    delta, lse2 = T.backward_preprocess(do, out, lse, None)
    return scale, delta, lse2


def gluon_dkdv(q, k, v, do, lse2, delta, causal, scale, config):
    from loom.kernels.attention import hopper
    from loom.kernels.attention.triton import _seq_key

    dk, dv = torch.empty_like(k), torch.empty_like(v)
    hopper.dkdv(q, k, v, do, lse2, delta, dk, dv, causal, None, scale, _seq_key(q.shape[2]), config=config)
    return dk, dv


def triton_dkdv(q, k, v, do, lse2, delta, causal, scale):
    from loom.kernels.attention import triton as T

    dk, dv = torch.empty_like(k), torch.empty_like(v)
    T.triton_dkdv(do, q, k, v, lse2, delta, dk, dv, causal, None, 0, scale)
    return dk, dv


def check() -> list[dict]:
    rows = []
    for d, h, s, causal in [(64, 4, 1000, True), (128, 4, 777, True), (128, 4, 1024, False), (64, 8, 300, False),
                            (128, 2, 64, True), (64, 2, 129, True), (128, 2, 2048, True)]:
        q, k, v, do = make(d, h, s, 2)
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
        F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal).backward(do.float())
        qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
        F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal).backward(do)
        scale, delta, lse2 = inputs(q, k, v, do, causal)
        tk, tv = triton_dkdv(q, k, v, do, lse2, delta, causal, scale)
        err = lambda x, ref: (x.float() - ref).abs().max().item()  # noqa: E731
        row = {"shape": [d, h, s], "causal": causal, "sdpa_bf16": [err(kb.grad, kf.grad), err(vb.grad, vf.grad)],
               "triton": [err(tk, kf.grad), err(tv, vf.grad)]}
        for c in CONFIGS:
            gk, gv = gluon_dkdv(q, k, v, do, lse2, delta, causal, scale, c)
            torch.cuda.synchronize()
            row[str(c)] = [err(gk, kf.grad), err(gv, vf.grad), bool(torch.isnan(gk).any() or torch.isnan(gv).any()),
                           (gk.float() - tk.float()).abs().max().item(), (gv.float() - tv.float()).abs().max().item()]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def timing() -> list[dict]:
    from loom.kernels.attention import triton as T

    rows = []
    for d, h, s in SHAPES:
        batch = max(1, TOKENS // s)
        q, k, v, do = make(d, h, s, batch)
        scale, delta, lse2 = inputs(q, k, v, do, True)
        dq = torch.empty_like(q)
        fns = {"triton": lambda: triton_dkdv(q, k, v, do, lse2, delta, True, scale),
               "dq_triton": lambda: T.triton_dq(do, q, k, v, lse2, delta, dq, True, None, 0, scale)}
        for c in CONFIGS:
            fns[f"gluon{c}"] = (lambda c=c: gluon_dkdv(q, k, v, do, lse2, delta, True, scale, c))
        fns["gluon_auto"] = lambda: gluon_dkdv(q, k, v, do, lse2, delta, True, scale, None)
        best = two_rounds(fns)
        tri = best["triton"]["ms"]
        row = {"shape": [d, h, s], "batch": batch, "causal": True, "results": best,
               "speedup_vs_triton": {n: tri / r["ms"] for n, r in best.items() if "ms" in r and n != "dq_triton"}}
        rows.append(row)
        with open(OUT, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({"shape": row["shape"], **{n: round(r.get("ms", -1), 3) for n, r in best.items()}}),
              flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", type=int, default=None, help="only run CONFIGS[i] once on a small shape (a hang check)")
    p.add_argument("--commit", default=os.environ.get("LOOM_COMMIT", "unknown"))
    a = p.parse_args()
    if a.smoke is not None:
        q, k, v, do = make(128, 2, 1000, 1)
        scale, delta, lse2 = inputs(q, k, v, do, True)
        tk, tv = triton_dkdv(q, k, v, do, lse2, delta, True, scale)
        gk, gv = gluon_dkdv(q, k, v, do, lse2, delta, True, scale, CONFIGS[a.smoke])
        torch.cuda.synchronize()
        print("smoke", CONFIGS[a.smoke], (gk - tk).abs().max().item(), (gv - tv).abs().max().item(), flush=True)
        return
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    result = {"env": environment(a.commit, "python " + " ".join(sys.argv)), "configs": CONFIGS}
    result["check"] = check()
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    result["timing"] = timing()
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

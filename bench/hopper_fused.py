"""The five-matmul backward on Hopper (dQ's share added by fp32 atomics inside the Gluon dK/dV kernel, as in
FlashAttention-3; ``hopper.dkdv(..., dq_acc=...)``) against loom's two-kernel backward (the Gluon dK/dV kernel, then
the Gluon dQ at head dim 128 or the Triton dQ), same process: gradients first (dK/dV against the two-kernel ones,
dQ against them: fp32 atomics add in a run-dependent order), then ms per backward of each (the fused one including the
zeroing of its fp32 dQ buffer and the cast to the input dtype), two rounds in alternating order.

    python bench/hopper_fused.py --out bench/results/hopper_fused_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernels import TOKENS, attention_flops, doc_ids, random_doc_lens, two_rounds  # noqa: E402
from bench.train_1b import environment  # noqa: E402

# (head dim, query heads, kv heads, seq, causal, packed documents)
SHAPES = [(128, 16, 16, 8192, True, True), (128, 16, 16, 4096, True, True), (128, 16, 16, 16384, True, True),
          (128, 16, 16, 8192, True, False), (128, 32, 8, 8192, True, False), (64, 32, 8, 8192, True, True)]
CHECKS = [(2, 4, 4, 1000, 128, True, False), (1, 8, 2, 777, 128, True, True), (2, 2, 2, 1024, 128, False, False),
          (1, 4, 1, 517, 64, False, True), (2, 8, 8, 300, 64, True, True)]


def setup(q, k, v, do, causal, bounds):
    from loom.kernels.attention import triton as T

    scale = q.shape[-1] ** -0.5
    out, lse = T.attention_forward(q, k, v, causal, bounds, 0, scale)
    delta, lse2 = T.backward_preprocess(do, out, lse, None)
    return scale, delta, lse2


def two_kernel(q, k, v, do, lse2, delta, causal, bounds, scale):
    from loom.kernels.attention import hopper
    from loom.kernels.attention import triton as T

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    hopper.dkdv(q, k, v, do, lse2, delta, dk, dv, causal, bounds, scale, T._seq_key(q.shape[2]))
    if hopper.dq_wins(q.shape[-1], bounds):
        hopper.dq(q, k, v, do, lse2, delta, dq, causal, bounds, scale, T._seq_key(q.shape[2]))
    else:
        T.triton_dq(do, q, k, v, lse2, delta, dq, causal, bounds, 0, scale)
    return dq, dk, dv


def fused(q, k, v, do, lse2, delta, causal, bounds, scale, config):
    from loom.kernels.attention import hopper
    from loom.kernels.attention import triton as T

    dk, dv = torch.empty_like(k), torch.empty_like(v)
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    hopper.dkdv(q, k, v, do, lse2, delta, dk, dv, causal, bounds, scale, T._seq_key(q.shape[2]), config=config,
                dq_acc=acc)
    return acc.to(q.dtype), dk, dv


def check() -> list[dict]:
    from loom.kernels.attention import hopper
    from loom.kernels.attention import reference as R

    rows = []
    for b, hq, hk, s, d, causal, docs in CHECKS:
        gen = torch.Generator().manual_seed(s)
        q, k, v, do = (torch.randn(b, s, h, d, generator=gen).cuda().bfloat16().transpose(1, 2)
                       for h in (hq, hk, hk, hq))
        bounds = None
        if docs:
            ids = torch.cumsum(torch.rand(b, s, generator=gen) < 1 / 150, dim=1)
            ids[:, s - s // 10:] = -1
            bounds = R.document_bounds(ids.cuda())
        scale, delta, lse2 = setup(q, k, v, do, causal, bounds)
        tq, tk, tv = two_kernel(q, k, v, do, lse2, delta, causal, bounds, scale)
        row = {"shape": [b, hq, hk, s, d], "causal": causal, "docs": docs}
        for c in [*hopper._CONFIGS["dkdv_dq"], None]:
            fq, fk, fv = fused(q, k, v, do, lse2, delta, causal, bounds, scale, c)
            torch.cuda.synchronize()
            row[str(c)] = {"dk_diff": (fk.float() - tk.float()).abs().max().item(),
                           "dv_diff": (fv.float() - tv.float()).abs().max().item(),
                           "dq_diff": (fq.float() - tq.float()).abs().max().item(),
                           "dq_scale": tq.float().abs().max().item(),
                           "nan": bool(fq.isnan().any() or fk.isnan().any() or fv.isnan().any())}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def timing() -> list[dict]:
    from loom.kernels.attention import hopper
    from loom.kernels.attention import reference as R

    rows = []
    for d, hq, hk, s, causal, docs in SHAPES:
        b = TOKENS // s
        gen = torch.Generator().manual_seed(s)
        q, k, v, do = (torch.randn(b, s, h, d, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)
                       for h in (hq, hk, hk, hq))
        lens = random_doc_lens(b, s, gen) if docs else None
        bounds = R.document_bounds(doc_ids(lens, "cuda")) if docs else None
        scale, delta, lse2 = setup(q, k, v, do, causal, bounds)
        flops = 2.5 * attention_flops(b, hq, d, lens, s, causal)
        fns = {"two_kernel": lambda: two_kernel(q, k, v, do, lse2, delta, causal, bounds, scale)}
        for c in hopper._CONFIGS["dkdv_dq"]:
            fns[f"fused{c}"] = (lambda c=c: fused(q, k, v, do, lse2, delta, causal, bounds, scale, c))
        fns["fused_auto"] = lambda: fused(q, k, v, do, lse2, delta, causal, bounds, scale, None)
        best = two_rounds(fns)
        for r in best.values():
            if "ms" in r:
                r["tflops"] = flops / r["ms"] / 1e9
        base = best["two_kernel"]["ms"]
        row = {"shape": [d, hq, hk, s], "batch": b, "causal": causal, "docs": docs, "results": best,
               "speedup_vs_two_kernel": {n: base / r["ms"] for n, r in best.items() if "ms" in r}}
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("shape", "causal", "docs", "speedup_vs_two_kernel")}),
              {n: round(r.get("ms", 0), 3) for n, r in best.items()}, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--commit", default=os.environ.get("LOOM_COMMIT", "unknown"))
    a = p.parse_args()
    result = {"env": environment(a.commit, "python " + " ".join(sys.argv)), "check": check(), "timing": timing()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

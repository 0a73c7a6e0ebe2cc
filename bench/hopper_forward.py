"""The persistent warp-specialized Gluon forward for Hopper (loom/kernels/attention/hopper.py) against loom's Triton
forward, same process: outputs first (each Gluon config and the autotuned choice against the Triton kernel's out and
log-sum-exp, and both against an fp32 reference next to bf16 SDPA's error), then ms per call of each Gluon config,
of its autotuned choice and of the autotuned Triton forward on the same inputs (two rounds in alternating order, the
faster counts), causal MHA/GQA and packed documents at 32k tokens per call.

    python bench/hopper_forward.py --out bench/results/hopper_ws_forward_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernels import TOKENS, attention_flops, doc_ids, random_doc_lens, two_rounds  # noqa: E402
from bench.train_1b import environment  # noqa: E402

# (head dim, query heads, kv heads, seq, causal, packed documents)
SHAPES = [(128, 16, 16, 4096, True, False), (128, 16, 16, 8192, True, False), (128, 16, 16, 16384, True, False),
          (64, 32, 32, 8192, True, False), (128, 16, 16, 8192, False, False),
          (128, 16, 16, 4096, True, True), (128, 16, 16, 8192, True, True), (128, 16, 16, 16384, True, True),
          (64, 32, 8, 8192, True, True)]
CHECKS = [(64, 4, 4, 1000, True, False, False), (128, 4, 4, 777, True, True, False),
          (128, 2, 2, 1024, False, False, False), (64, 8, 2, 300, False, True, False),
          (128, 2, 2, 64, True, False, False), (64, 8, 1, 517, True, True, True), (128, 8, 2, 2048, True, False, True),
          (128, 4, 4, 1000, False, False, True)]


def _bounds(b, s, gen, padded):
    """Random packed documents (1-400 tokens) and, when ``padded``, a tail of padding."""
    from loom.kernels.attention.reference import document_bounds

    ids = torch.cumsum(torch.rand(b, s, generator=gen) < 1 / 150, dim=1)
    if padded:
        ids[:, s - s // 10:] = -1
    return document_bounds(ids.cuda())


def triton_fwd(q, k, v, causal, bounds):
    from loom.kernels.attention import triton as T

    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    T.triton_forward(q, k, v, out, lse, causal, bounds, 0, q.shape[-1] ** -0.5)  # the Triton kernel, not dispatch
    return out, lse


def gluon_fwd(q, k, v, causal, bounds, config):
    from loom.kernels.attention import hopper
    from loom.kernels.attention.triton import _seq_key

    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    hopper.forward(q, k, v, out, lse, causal, bounds, q.shape[-1] ** -0.5, _seq_key(q.shape[2]), config=config)
    return out, lse


def check() -> list[dict]:
    from loom.kernels.attention import hopper
    from loom.kernels.attention import reference as R

    rows = []
    for d, hq, hk, s, causal, model_layout, docs in CHECKS:
        gen = torch.Generator().manual_seed(s)
        shape = lambda h: (2, s, h, d) if model_layout else (2, h, s, d)  # noqa: E731
        q, k, v = (torch.randn(*shape(h), generator=gen).cuda().bfloat16() for h in (hq, hk, hk))
        if model_layout:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        bounds = _bounds(2, s, gen, padded=True) if docs else None
        mask = R.visible(s, causal, bounds, 0, q.device)  # (B or 1, 1, S, S) bool
        g = hq // hk
        kf, vf = (t.float().repeat_interleave(g, dim=1) for t in (k, v))
        ref = F.scaled_dot_product_attention(q.float(), kf, vf, attn_mask=mask)
        sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask)
        seen = mask.any(-1)  # rows that see some key (a row that sees none: zeros here, SDPA gives NaN)
        seen = seen.expand(q.shape[0], hq, s) if seen.shape[1] == 1 else seen
        err = lambda x: (x.float() - ref).abs()[seen].max().item()  # noqa: E731
        to, tl = triton_fwd(q, k, v, causal, bounds)
        row = {"shape": [d, hq, hk, s], "causal": causal, "model_layout": model_layout, "docs": docs,
               "sdpa_bf16": err(sdpa), "triton": err(to), "gluon": {}}
        for c in [*hopper._CONFIGS["fwd"], None]:
            go, gl = gluon_fwd(q, k, v, causal, bounds, c)
            torch.cuda.synchronize()
            finite = torch.isfinite(tl)
            row["gluon"][str(c)] = {
                "err_vs_ref": err(go), "nan": bool(torch.isnan(go).any() or torch.isnan(gl).any()),
                "max_diff_out_vs_triton": (go.float() - to.float()).abs().max().item(),
                "max_diff_lse_vs_triton": (gl[finite] - tl[finite]).abs().max().item(),
                "same_inf_rows": bool(torch.equal(torch.isinf(gl), torch.isinf(tl)))}
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
        q, k, v = (torch.randn(b, h, s, d, generator=gen).to("cuda", torch.bfloat16) for h in (hq, hk, hk))
        lens = random_doc_lens(b, s, gen) if docs else None
        bounds = R.document_bounds(doc_ids(lens, "cuda")) if docs else None
        flops = attention_flops(b, hq, d, lens, s, causal)
        fns = {"triton": lambda: triton_fwd(q, k, v, causal, bounds)}
        for c in hopper._CONFIGS["fwd"]:
            fns[f"gluon{c}"] = (lambda c=c: gluon_fwd(q, k, v, causal, bounds, c))
        fns["gluon_auto"] = lambda: gluon_fwd(q, k, v, causal, bounds, None)
        best = two_rounds(fns)
        for r in best.values():
            if "ms" in r:
                r["tflops"] = flops / r["ms"] / 1e9
        tri = best["triton"]["ms"]
        row = {"shape": [d, hq, hk, s], "batch": b, "causal": causal, "docs": docs, "flops": flops, "results": best,
               "speedup_vs_triton": {n: tri / r["ms"] for n, r in best.items() if "ms" in r}}
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("shape", "causal", "docs", "speedup_vs_triton")}),
              {n: round(r.get("tflops", 0)) for n, r in best.items()}, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--commit", default=os.environ.get("LOOM_COMMIT", "unknown"))
    a = p.parse_args()
    result = {"env": environment(a.commit, "python " + " ".join(sys.argv)),
              "check": [] if a.skip_check else check(), "timing": timing()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""Fused linear + cross-entropy (loom.kernels.linear_ce) vs the unfused path: time of forward +
backward and peak memory, bf16, on one GPU.

The unfused path is what the trainer does without ``fused_loss``: logits = h @ W.T in bf16, then
F.cross_entropy(logits.float(), reduction="sum"). Both take bf16 h (N, E) and W (V, E) (as under
FSDP2's bf16 policy) and back-propagate into both. Peak memory is max_memory_allocated during
forward + backward above what was allocated before (the inputs).

    python -m bench.fused_loss --variants unfused,fused,unfused_compile --out bench/results/fused_loss_h100.json

Writes one JSON with the device, library versions, commit and the exact command, and per case and
variant: ms per forward + backward (median of --iters after --warmup), tokens/s and peak extra GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from bench.common import command, default_commit, environment, event_ms
from loom.kernels.linear_ce import default_chunk_tokens, linear_cross_entropy, linear_cross_entropy_unfused

VARIANTS = ("unfused", "fused", "unfused_compile")


def loss_fn(variant: str, chunk_tokens: int | None):
    if variant == "fused":
        return lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens=chunk_tokens)
    if variant == "unfused":
        return linear_cross_entropy_unfused
    if variant == "unfused_compile":
        return torch.compile(linear_cross_entropy_unfused)
    raise ValueError(f"variant: {variant!r} not one of {VARIANTS}")


def measure(variant: str, n: int, e: int, v: int, warmup: int, iters: int, chunk_tokens: int | None) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, e, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, e, device="cuda", generator=g) * e**-0.5).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    fn = loss_fn(variant, chunk_tokens)

    def step():
        h.grad = w.grad = None
        fn(h, w, y).backward()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    h.grad = w.grad = None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    times = event_ms(step, iters)
    ms = statistics.median(times)
    return {
        "variant": variant,
        "n": n,
        "e": e,
        "v": v,
        "dtype": "bfloat16",
        "chunk_tokens": chunk_tokens or default_chunk_tokens(v, e, torch.bfloat16)
        if variant == "fused"
        else None,
        "ms_fwd_bwd": ms,
        "ms_min": min(times),
        "tokens_per_s": n / ms * 1e3,
        "peak_extra_gib": peak / 2**30,
        "loss": float(fn(h, w, y).detach()),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dims", default="2048,4096", help="hidden sizes E, comma-separated")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--variants", default="unfused,fused", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument(
        "--chunk-tokens", type=int, default=None, help="fused chunk rows (default: the op's budget)"
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="bench/results/fused_loss.json")
    p.add_argument("--commit", default=default_commit())
    a = p.parse_args()
    results = []
    for e in (int(x) for x in a.dims.split(",")):
        for variant in a.variants.split(","):
            try:
                r = measure(variant, a.tokens, e, a.vocab, a.warmup, a.iters, a.chunk_tokens)
            except torch.OutOfMemoryError as err:
                r = {"variant": variant, "n": a.tokens, "e": e, "v": a.vocab, "error": str(err)[:300]}
            torch.cuda.empty_cache()
            results.append(r)
            print(json.dumps(r), flush=True)
    ratios = {}
    for e in {r["e"] for r in results}:
        by = {r["variant"]: r for r in results if r["e"] == e and "error" not in r}
        if "fused" in by and "unfused" in by:
            f, u = by["fused"], by["unfused"]
            ratios[f"E{e}"] = {
                "time_fused_over_unfused": f["ms_fwd_bwd"] / u["ms_fwd_bwd"],
                "peak_unfused_over_fused": u["peak_extra_gib"] / f["peak_extra_gib"],
            }
    doc = {
        "benchmark": "fused_loss",
        "environment": environment(a.commit, command()),
        "results": results,
        "ratios": ratios,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"\n{'E':>5} {'variant':<16} {'ms fwd+bwd':>11} {'Mtok/s':>8} {'peak extra GiB':>15}")
    for r in results:
        if "error" in r:
            print(f"{r['e']:>5} {r['variant']:<16} ERROR {r['error'][:200]}")
        else:
            print(
                f"{r['e']:>5} {r['variant']:<16} {r['ms_fwd_bwd']:>11.2f} {r['tokens_per_s'] / 1e6:>8.2f} "
                f"{r['peak_extra_gib']:>15.2f}"
            )
    print("ratios:", json.dumps(ratios))


if __name__ == "__main__":
    main()

"""AdamW step time on the parameters of a loom flavor (default ``1B``): loom's Triton kernel vs PyTorch's
fused and foreach AdamW, all with a gradient factor (clipping) applied as training applies it.

    python -m bench.optimizer --flavor 1B --out bench/results/optimizer_1b_h100.json
    python -m bench.optimizer --flavor 125M --out bench/results/optimizer_125m_h100.json   # many small tensors

Each implementation is timed in two rounds in alternating order (the faster round counts); GB/s counts
the 28 bytes an fp32 AdamW must move per parameter (read param, grad, two moments; write three).
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.common import command, default_commit, environment
from loom.config.sections import OptimizerConfig
from loom.models.llama import FLAVORS, Llama
from loom.train.optimizer import OptimizerParts

IMPLEMENTATIONS = ("triton", "fused", "foreach")
BYTES_PER_PARAM = 28


def make_model(flavor: str) -> torch.nn.Module:
    args = FLAVORS[flavor]
    # a flavor without its own vocabulary: the byte tokenizer's, rounded as training rounds it
    if not args.vocab_size:
        from loom.data.tokenizers import ByteTokenizer
        from loom.models.llama import round_vocab

        args = args.with_(vocab_size=round_vocab(ByteTokenizer().vocab_size))
    with torch.device("meta"):
        model = Llama(args)
    model = model.to_empty(device="cuda")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
        p.grad = torch.randn_like(p) * 1e-3
    return model


def time_steps(opt: OptimizerParts, factor: torch.Tensor, iters: int) -> float:
    """Median ms per step of ``iters`` steps, each timed by CUDA events."""
    for _ in range(3):  # warm-up: state allocation, kernel compilation
        opt.step(factor)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step(factor)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--flavor", default="1B", choices=sorted(FLAVORS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="")
    p.add_argument("--commit", default=default_commit())
    a = p.parse_args()
    model = make_model(a.flavor)
    n = sum(p.numel() for p in model.parameters())
    factor = torch.tensor(0.5, device="cuda")
    rounds: dict[str, list[float]] = {impl: [] for impl in IMPLEMENTATIONS}
    for order in (IMPLEMENTATIONS, IMPLEMENTATIONS[::-1]):
        for impl in order:
            opt = OptimizerParts(
                [model],
                OptimizerConfig(lr=3e-4, betas=[0.9, 0.95], implementation=impl),
                torch.device("cuda"),
            )
            rounds[impl].append(time_steps(opt, factor, a.iters))
            del opt
            torch.cuda.empty_cache()
    rows = []
    for impl, ms in rounds.items():
        best = min(ms)
        rows.append(
            {
                "implementation": impl,
                "ms": best,
                "rounds_ms": ms,
                "gb_per_s": n * BYTES_PER_PARAM / best / 1e6,
            }
        )
        print(f"{impl:8s} {best:7.2f} ms  {rows[-1]['gb_per_s']:6.0f} GB/s  rounds {ms}", flush=True)
    ms = {r["implementation"]: r["ms"] for r in rows}
    ratios = {
        "fused_ms / triton_ms": ms["fused"] / ms["triton"],
        "foreach_ms / triton_ms": ms["foreach"] / ms["triton"],
    }
    print(ratios)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {
                    "benchmark": "optimizer",
                    "environment": environment(a.commit, command()),
                    "flavor": a.flavor,
                    "params": n,
                    "rows": rows,
                    "ratios": ratios,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()

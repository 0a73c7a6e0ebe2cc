"""The training step's GEMMs of a loom flavor (default ``8B``), each timed alone on one GPU: where a step's matmul
milliseconds go, and what each BLAS setting would give at each shape.

    python -m bench.gemms --flavor 8B --tokens 8192 --out bench/results/gemms_8b_h200.json

Every block linear runs three GEMMs a step, as autograd runs ``F.linear``: the forward ``x @ w.T``, the input
gradient ``dy @ w`` and the weight gradient ``dy.T @ x``; the output head too. Each is timed under each setting
(``--settings``): ``cublas`` (PyTorch's default BLAS), ``cublaslt`` (``preferred_blas_library``), ``carveout``
(cuBLASLt sized for the SMs a resident NCCL kernel leaves: ``--carveout`` of them), and the projections that share
an input fused into one GEMM (q/k/v, gate/up). The step's figure is the sum over the blocks and the head, for
comparison with a profile's matmul time (loom.metrics.trace_summary)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.common import bench_ms, command, default_commit, environment
from loom.models.llama import FLAVORS

SETTINGS = ("cublas", "cublaslt", "carveout")


def linears(flavor: str, vocab: int | None) -> dict[str, tuple[int, int]]:
    """The flavor's block linears and head as name -> (out features, in features)."""
    a = FLAVORS[flavor]
    head_dim = a.dim // a.n_heads
    kv = a.n_kv_heads * head_dim
    return {
        "wq": (a.dim, a.dim),
        "wk": (kv, a.dim),
        "wv": (kv, a.dim),
        "wo": (a.dim, a.dim),
        "w1": (a.ffn_dim, a.dim),
        "w3": (a.ffn_dim, a.dim),
        "w2": (a.dim, a.ffn_dim),
        "head": (vocab or a.vocab_size, a.dim),
    }


def gemm_calls(tokens: int, out_f: int, in_f: int, dtype) -> dict:
    """The three GEMMs of one linear of ``tokens`` rows: name -> (callable, FLOPs)."""
    x = torch.randn(tokens, in_f, device="cuda", dtype=dtype)
    w = torch.randn(out_f, in_f, device="cuda", dtype=dtype)
    dy = torch.randn(tokens, out_f, device="cuda", dtype=dtype)
    flops = 2.0 * tokens * out_f * in_f
    return {
        "forward": (lambda: x @ w.t(), flops),
        "input_grad": (lambda: dy @ w, flops),
        "weight_grad": (lambda: dy.t() @ x, flops),
    }


def apply(setting: str, carveout: int) -> None:
    lib = "cublas" if setting == "cublas" else "cublaslt"
    torch.backends.cuda.preferred_blas_library(lib)
    torch._C._set_sm_carveout_experimental(carveout if setting == "carveout" else None)


def time_linear(tokens: int, shape: tuple[int, int], dtype, setting: str, carveout: int) -> dict:
    """ms and TFLOP/s of each of the linear's three GEMMs under ``setting``."""
    apply(setting, carveout)
    out = {}
    for kind, (fn, flops) in gemm_calls(tokens, *shape, dtype).items():
        ms = bench_ms(fn)
        out[kind] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
    torch.cuda.empty_cache()
    return out


def step_ms(per_linear: dict, names: list[str], n_layers: int) -> float:
    """The step's GEMM ms: the named block linears' three GEMMs times the blocks, plus the head's."""
    block = sum(g["ms"] for n in names for g in per_linear[n].values())
    return round(block * n_layers + sum(g["ms"] for g in per_linear["head"].values()), 2)


def refuse(why: str) -> None:
    """One line on stderr, exit 2 (a user or machine error)."""
    print(f"bench.gemms: {why}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="8B", choices=sorted(FLAVORS))
    p.add_argument(
        "--tokens", type=int, default=8192, help="rows of every GEMM: micro batch x sequence length"
    )
    p.add_argument(
        "--vocab", type=int, default=None, help="the head's rows (default: the flavor's vocabulary)"
    )
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of {', '.join(SETTINGS)}")
    p.add_argument(
        "--carveout", type=int, default=24, help="SMs the carveout setting leaves to communication"
    )
    p.add_argument("--commit", default=default_commit())
    p.add_argument("--out", default=None)
    a = p.parse_args()
    settings = a.settings.split(",")
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        refuse(f"--settings {bad[0]!r}: allowed {', '.join(SETTINGS)}")
    if not torch.cuda.is_available():
        refuse("no CUDA device: it times GEMMs on one GPU")
    shapes = linears(a.flavor, a.vocab)
    fused = {
        "wqkv": (shapes["wq"][0] + 2 * shapes["wk"][0], FLAVORS[a.flavor].dim),
        "w13": (2 * shapes["w1"][0], FLAVORS[a.flavor].dim),
    }
    doc = {
        "env": environment(a.commit, command()),
        "flavor": a.flavor,
        "tokens": a.tokens,
        "dtype": "bfloat16",
        "shapes": {n: list(s) for n, s in {**shapes, **fused}.items()},
        "settings": {},
    }
    n_layers = FLAVORS[a.flavor].n_layers
    for setting in settings:
        per = {
            n: time_linear(a.tokens, s, torch.bfloat16, setting, a.carveout)
            for n, s in {**shapes, **fused}.items()
        }
        apart = ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]
        doc["settings"][setting] = {
            "linears": per,
            "step_ms": step_ms(per, apart, n_layers),
            "step_ms_fused": step_ms(per, ["wqkv", "wo", "w13", "w2"], n_layers),
        }
        s = doc["settings"][setting]
        print(f"{setting}: step GEMMs {s['step_ms']} ms (q/k/v and gate/up fused: {s['step_ms_fused']} ms)")
        for n, g in per.items():
            print("   ", n, " ".join(f"{k} {v['ms']:.3f} ms {v['tflops']:.0f}" for k, v in g.items()))
    apply("cublas", 0)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")


if __name__ == "__main__":
    main()

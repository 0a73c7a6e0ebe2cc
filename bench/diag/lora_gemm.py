"""Prices the lever the LoRA 8B floor names (bench.diag.floor): the adapters' rank-r products inside the frozen base's
GEMM. One Triton GEMM (tensor descriptors, grouped tile order) computes C = X W' + s (X A') B' with the rank-r product
of each tile's rows accumulated beside the base product from the same X tiles and added in the epilogue; the same
kernel without the adapter is the base alone. Per shape of the 8B step (4,096 tokens; the forward of q/k/v, o,
gate/up and down, and the input gradients of o and down), against cuBLAS's base GEMM and against loom's op
(``loom.kernels.lora.reference``: the base GEMM, then the rank-r GEMMs accumulating onto it), best of a few tile
configs, each timed alone. Not a training path: a measurement of what a fused kernel could gain.

    python -m bench.diag.lora_gemm --out bench/results/lora_gemm_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_gemm(
    x_ptr,
    w_ptr,
    lo_ptr,
    hi_ptr,
    c_ptr,
    M,
    N,
    K,
    scaling,
    R: tl.constexpr,
    FORWARD: tl.constexpr,
    LORA: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    STAGES: tl.constexpr,
    WS: tl.constexpr,
):
    """C (M, N) = X (M, K) W' + scaling (X L') H'. FORWARD: W (N, K), L = A (R, K), H = B (N, R), all read
    transposed (y = x W^T + s x A^T B^T). Otherwise the input gradient: W (K, N), L = B (K, R), H = A (R, N)
    (dx = dy W + s dy B A)."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows = min(tiles_m - first_m, GROUP_M)
    om = (first_m + (pid % rows)) * BM
    on = ((pid % (GROUP_M * tiles_n)) // rows) * BN
    xd = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BM, BK])
    if FORWARD:
        wd = tl.make_tensor_descriptor(w_ptr, [N, K], [K, 1], [BN, BK])
        ld = tl.make_tensor_descriptor(lo_ptr, [R, K], [K, 1], [R, BK])
        hd = tl.make_tensor_descriptor(hi_ptr, [N, R], [R, 1], [BN, R])
    else:
        wd = tl.make_tensor_descriptor(w_ptr, [K, N], [N, 1], [BK, BN])
        ld = tl.make_tensor_descriptor(lo_ptr, [K, R], [R, 1], [BK, R])
        hd = tl.make_tensor_descriptor(hi_ptr, [R, N], [N, 1], [R, BN])
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    low = tl.zeros((BM, R), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES, warp_specialize=WS):
        ok = k * BK
        xt = xd.load([om, ok])
        if FORWARD:
            acc = tl.dot(xt, wd.load([on, ok]).T, acc)
            if LORA:
                low = tl.dot(xt, ld.load([0, ok]).T, low)
        else:
            acc = tl.dot(xt, wd.load([ok, on]), acc)
            if LORA:
                low = tl.dot(xt, ld.load([ok, 0]), low)
    if LORA:
        low = (low * scaling).to(c_ptr.dtype.element_ty)
        if FORWARD:
            acc = tl.dot(low, hd.load([on, 0]).T, acc)
        else:
            acc = tl.dot(low, hd.load([0, on]), acc)
    cd = tl.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BM, BN])
    cd.store([om, on], acc.to(c_ptr.dtype.element_ty))


CONFIGS = (  # (BM, BN, BK, STAGES, warps, warp-specialized K loop)
    (128, 256, 64, 3, 8, False),
    (128, 256, 64, 4, 8, False),
    (256, 128, 64, 3, 8, False),
    (128, 128, 64, 4, 4, False),
    (128, 256, 64, 3, 8, True),
    (128, 256, 64, 4, 8, True),
    (128, 128, 64, 4, 4, True),
)


def lora_gemm(x, w, lo, hi, scaling: float, forward: bool, lora: bool, config) -> torch.Tensor:
    """The kernel on (M, K) ``x``: see ``_lora_gemm`` for the layouts of ``w``, ``lo`` and ``hi``."""
    bm, bn, bk, stages, warps, ws = config
    m, k = x.shape
    n = w.shape[0] if forward else w.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=x.device))
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _lora_gemm[grid](
        x, w, lo, hi, out, m, n, k, scaling,
        R=lo.shape[0] if forward else lo.shape[1], FORWARD=forward, LORA=lora,
        BM=bm, BN=bn, BK=bk, GROUP_M=8, STAGES=stages, WS=ws, num_warps=warps,
    )  # fmt: skip
    return out


def shapes(tokens: int) -> dict[str, tuple[int, int, int, bool]]:
    """name -> (M, N, K, forward) of the 8B LoRA step's GEMMs."""
    return {
        "qkv_forward": (tokens, 6144, 4096, True),
        "o_forward": (tokens, 4096, 4096, True),
        "gate_up_forward": (tokens, 28672, 4096, True),
        "down_forward": (tokens, 4096, 14336, True),
        "o_input_grad": (tokens, 4096, 4096, False),
        "down_input_grad": (tokens, 14336, 4096, False),
    }


def group_rank(name: str, rank: int) -> int:
    """The R of a shape's GEMM: its group's adapters side by side, padded to a power of two (q/k/v: 3r -> 4r)."""
    return {"qkv": 4, "gate_up": 2}.get(name.rsplit("_", 1)[0].removesuffix("_input"), 1) * rank


def operands(m, n, k, forward, r, device, dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    x = rand(m, k)
    if forward:
        return x, rand(n, k, std=k**-0.5), rand(r, k, std=k**-0.5), rand(n, r, std=r**-0.5)
    return x, rand(k, n, std=k**-0.5), rand(k, r, std=k**-0.5), rand(r, n, std=r**-0.5)


def reference(x, w, lo, hi, scaling, forward):
    """What loom's op computes for one linear: the base GEMM (beta 0), then the rank-r GEMM accumulating onto it."""
    if forward:
        u = (x @ lo.t()).mul_(scaling)
        return (x @ w.t()).addmm_(u, hi.t())
    du = (x @ lo).mul_(scaling)
    return (x @ w).addmm_(du, hi)


def measure(tokens: int, rank: int, scaling: float) -> dict:
    from bench.common import bench_ms

    rows = {}
    for name, (m, n, k, forward) in shapes(tokens).items():
        x, w, lo, hi = operands(m, n, k, forward, group_rank(name, rank), "cuda")
        ref = reference(x, w, lo, hi, scaling, forward)
        row = {
            "m_n_k": [m, n, k],
            "rank": group_rank(name, rank),
            "cublas_base_ms": bench_ms(lambda: x @ w.t() if forward else x @ w),
            "loom_op_ms": bench_ms(lambda: reference(x, w, lo, hi, scaling, forward)),
            "triton": {},
        }
        for config in CONFIGS:
            key = "x".join(map(str, config))
            try:
                fused = lora_gemm(x, w, lo, hi, scaling, forward, True, config)
                err = ((fused.float() - ref.float()).norm() / ref.float().norm()).item()
                row["triton"][key] = {
                    "fused_ms": bench_ms(lambda c=config: lora_gemm(x, w, lo, hi, scaling, forward, True, c)),
                    "base_ms": bench_ms(lambda c=config: lora_gemm(x, w, lo, hi, scaling, forward, False, c)),
                    "rel_err": err,
                }
            except Exception as e:  # a config that does not fit (shared memory, registers): recorded, skipped
                row["triton"][key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        ok = [v for v in row["triton"].values() if "fused_ms" in v]
        if ok:
            row["best_fused_ms"] = min(v["fused_ms"] for v in ok)
            row["best_triton_base_ms"] = min(v["base_ms"] for v in ok)
            row["fused_vs_loom_op"] = row["loom_op_ms"] / row["best_fused_ms"]
            row["triton_base_vs_cublas"] = row["cublas_base_ms"] / row["best_triton_base_ms"]
        flops = 2 * m * n * k
        row["cublas_tflops"] = flops / row["cublas_base_ms"] / 1e9
        rows[name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "triton"}), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--scaling", type=float, default=2.0)
    p.add_argument("--out", default="")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/diag/lora_gemm.py: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    rows = measure(a.tokens, a.rank, a.scaling)
    if a.out:
        from bench.common import command, default_commit, environment, write_result

        write_result(a.out, {"environment": environment(default_commit(), command()), "shapes": rows})


if __name__ == "__main__":
    main()

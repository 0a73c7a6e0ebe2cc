"""The LoRA product for frozen bases in plain matmuls: what ``loom::lora_linear`` computes, forward and backward.

Several linears that read the same input (q, k, v; gate, up) run as one call: their down-projections A are one GEMM
(the adapters' rank-r products side by side), and backward sums their input gradients in place. Each rank-r
product is written first and its base GEMM accumulates onto it (``addmm_``: the big GEMM's epilogue reads it), so no
memory-bound pass over an (N, out) output follows a base GEMM; the frozen W take no gradient. The scaling multiplies
the small (N, n r) down-projection, as the unfused path does, so the base GEMM adds with beta 1: cuBLAS's kernels
for another beta ran 1-5% slower at 8B's shapes on an H200 (docs/lora.md).
"""

from __future__ import annotations

import torch


def lora_linear(
    x: torch.Tensor, ws: list[torch.Tensor], a: list[torch.Tensor], b: list[torch.Tensor], scaling: float
) -> list[torch.Tensor]:
    """x (N, in); per linear i: w_i (out_i, in), a_i (r, in), b_i (out_i, r), one dtype. Returns [y_1, ..., y_n, u]:
    y_i (N, out_i) = x w_i^T + (s x a_i^T) b_i^T, and u = s x [a_1; ...; a_n]^T (N, n r), which backward needs."""
    r = a[0].shape[0]
    u = (x @ _cat(a).t()).mul_(scaling)  # (N, n r)
    ys = [(u[:, i * r : (i + 1) * r] @ bi.t()).addmm_(x, wi.t()) for i, (wi, bi) in enumerate(zip(ws, b))]
    return ys + [u]


def lora_linear_backward(
    g: list[torch.Tensor],
    x: torch.Tensor,
    ws: list[torch.Tensor],
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    u: torch.Tensor,
    scaling: float,
    input_grad: bool,
) -> list[torch.Tensor]:
    """g: the outputs' gradients, g_i (N, out_i); u: the forward's scaled down-projection. Returns [dx (N, in), or an
    empty tensor without ``input_grad``; da_1 (r, in), ..., da_n; db_1 (out_1, r), ..., db_n]."""
    r = a[0].shape[0]
    du = (
        torch.cat([(gi @ bi).mul_(scaling) for gi, bi in zip(g, b)], dim=1)
        if len(g) > 1
        else (g[0] @ b[0]).mul_(scaling)
    )  # (N, n r)
    db = [gi.t() @ u[:, i * r : (i + 1) * r] for i, gi in enumerate(g)]  # (out_i, r)
    da = [t.clone() for t in (du.t() @ x).split(r)] if len(g) > 1 else [du.t() @ x]  # (r, in) each, unaliased
    dx = x.new_empty(0)
    if input_grad:
        dx = du @ _cat(a)  # (N, in)
        for gi, wi in zip(g, ws):
            dx.addmm_(gi, wi)
    return [dx, *da, *db]


def _cat(a: list[torch.Tensor]) -> torch.Tensor:
    return a[0] if len(a) == 1 else torch.cat(a)  # (n r, in)

"""The LoRA product for frozen bases in plain matmuls: what ``loom::lora_linear`` computes, forward and backward.

Several linears that read the same input (q, k, v; gate, up) run as one call: their down-projections A are one GEMM
(the adapters' rank-r products side by side), and backward sums their input gradients in place; the frozen W take
no gradient. Every base GEMM writes its output alone (beta 0) and the small rank-r GEMM accumulates onto it: in the
8B pair on an H200 (docs/lora.md) cuBLAS's base GEMMs that read their output back (beta 1, or the scaling as beta)
ran 8-12% slower than the same GEMMs with beta 0 in PEFT's run, more than the memory-bound pass the small GEMM makes
over the output. For the same reason a large input-gradient GEMM after the first is written apart and added
(``EPILOGUE_MAX_K``). The scaling multiplies the small (N, n r) down-projection, as the unfused path does.
"""

from __future__ import annotations

import torch

# Input gradients after the first: a GEMM over more than this many output features of the forward (its K here) is
# written apart and added to dx, smaller ones accumulate in the GEMM (beta 1). The beta-1 kernel's ~10% extra time
# (measured, module docstring) exceeds one pass over dx (3 N x in elements) once K > ~6k at an H200's ratio of GEMM
# to memory throughput (790 TFLOP/s, ~4 TB/s): 0.1 x 2 N in K / 790e12 > 6 N in / 4e12.
EPILOGUE_MAX_K = 6144


def lora_linear(
    x: torch.Tensor, ws: list[torch.Tensor], a: list[torch.Tensor], b: list[torch.Tensor], scaling: float
) -> list[torch.Tensor]:
    """x (N, in); per linear i: w_i (out_i, in), a_i (r, in), b_i (out_i, r), one dtype. Returns [y_1, ..., y_n, u]:
    y_i (N, out_i) = x w_i^T + (s x a_i^T) b_i^T, and u = s x [a_1; ...; a_n]^T (N, n r), which backward needs."""
    r = a[0].shape[0]
    u = (x @ _cat(a).t()).mul_(scaling)  # (N, n r)
    ys = [(x @ wi.t()).addmm_(u[:, i * r : (i + 1) * r], bi.t()) for i, (wi, bi) in enumerate(zip(ws, b))]
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
        dx = g[0] @ ws[0]  # (N, in)
        for gi, wi in zip(g[1:], ws[1:]):
            if wi.shape[0] > EPILOGUE_MAX_K:
                dx.add_(gi @ wi)
            else:
                dx.addmm_(gi, wi)
        dx.addmm_(du, _cat(a))
    return [dx, *da, *db]


def _cat(a: list[torch.Tensor]) -> torch.Tensor:
    return a[0] if len(a) == 1 else torch.cat(a)  # (n r, in)

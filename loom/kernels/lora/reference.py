"""The LoRA product for a frozen base in plain matmuls: what ``loom::lora_linear`` computes, forward and backward.

The rank-r product is written first and the base GEMM accumulates onto it (``addmm_`` with beta: the big GEMM's
epilogue reads it), so no memory-bound pass over the (N, out) output follows the base GEMM; backward adds the
adapter's input gradient into the base's the same way. The frozen W takes no gradient.
"""

from __future__ import annotations

import torch


def lora_linear(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, in), w (out, in), a (r, in), b (out, r), one dtype. Returns y (N, out) = x w^T + s (x a^T) b^T and
    u = x a^T (N, r), which backward needs."""
    u = x @ a.t()  # (N, r)
    return (u @ b.t()).addmm_(x, w.t(), beta=scaling), u


def lora_linear_backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         u: torch.Tensor, scaling: float,
                         input_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """g (N, out): the output's gradient. Returns (dx (N, in), or an empty tensor without ``input_grad``;
    da (r, in); db (out, r))."""
    du = (g @ b).mul_(scaling)  # (N, r)
    db = (g.t() @ u).mul_(scaling)  # (out, r)
    da = du.t() @ x  # (r, in)
    dx = (du @ a).addmm_(g, w) if input_grad else x.new_empty(0)  # (N, in)
    return dx, da, db

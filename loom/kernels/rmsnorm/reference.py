"""RMSNorm in plain PyTorch: the model's unfused path (``loom.models.common.layers.RMSNorm``), the CPU path of
the op, and the definition the Triton kernel is tested against.

Forward: statistics in fp32, the normalized value rounded to x's dtype, then times the weight rounded to x's
dtype. Backward is the closed form, computed in fp32 and rounded once (what the Triton kernel computes)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (..., N); weight: (N,). Returns (..., N) in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., N) fp32
    return y.type_as(x) * weight.type_as(x)


def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``rms_norm`` w.r.t. x and weight: ((..., N) in x's dtype, (N,) in weight's dtype).

    With y = x * r, r = rsqrt(mean(x^2) + eps) and dy = grad * w:
    dx = r * (dy - y * mean(dy * y)),  dweight = sum over rows of grad * y."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    y = xf * rstd  # (..., N)
    gf = grad.float()
    dy = gf * weight.type_as(x).float()  # (..., N)
    dx = rstd * (dy - y * (dy * y).mean(-1, keepdim=True))
    dw = (gf * y).reshape(-1, x.shape[-1]).sum(0)  # (N,)
    return dx.to(x.dtype), dw.to(weight.dtype)

"""SwiGLU gate in plain PyTorch: the model's unfused path (``loom.models.common.layers.FeedForward``), the CPU path
of the op, and the definition the Triton kernel is tested against.

Forward: ``silu(a) * b``, silu rounded to the input dtype before the product. Backward is the closed form in fp32
(fp64 for fp64 input, as forward), rounded once:
    d a = g * b * sig(a) * (1 + a * (1 - sig(a))),   d b = g * silu(a)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a, b: the same shape and dtype. Returns silu(a) * b."""
    return F.silu(a) * b


def swiglu_backward(
    grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``swiglu`` w.r.t. a and b, in their dtypes."""
    opmath = torch.promote_types(a.dtype, torch.float32)
    af, bf, gf = a.to(opmath), b.to(opmath), grad.to(opmath)
    sig = torch.sigmoid(af)
    da = gf * bf * sig * (1 + af * (1 - sig))
    db = gf * af * sig
    return da.to(a.dtype), db.to(b.dtype)

"""RoPE in plain PyTorch: the model's unfused path (``loom.models.common.layers.Attention``), the CPU path of the
op, and the definition the Triton kernel is tested against.

Forward: rotate-half convention, fp32 math, one rounding to x's dtype. RoPE is linear in x: with x = [x1, x2]
(halves of the head dim) and the table's cos = [c1, c2], sin = [s1, s2],
    out = [x1 c1 - x2 s1,  x2 c2 + x1 s2]   and   dx = [g1 c1 + g2 s2,  g2 c2 - g1 s1].
The table is a constant (a buffer): no gradient flows to it or to the positions."""

from __future__ import annotations

import torch


def _cos_sin(
    table: torch.Tensor, seq: int, positions: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if positions is None:
        return table[0, :seq][None, :, None], table[1, :seq][None, :, None]  # (1, S, 1, D)
    return table[0][positions][:, :, None], table[1][positions][:, :, None]  # (B, S, 1, D)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """x: (B, S, H, D); table: (2, L, D) cos and sin; positions: (B, S) integer or None for 0..S-1."""
    cos, sin = _cos_sin(table, x.shape[1], positions)
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).type_as(x)


def apply_rope_backward(
    grad: torch.Tensor, table: torch.Tensor, positions: torch.Tensor | None
) -> torch.Tensor:
    """Gradient of ``apply_rope`` w.r.t. x, given the output gradient (B, S, H, D); in grad's dtype."""
    cos, sin = _cos_sin(table, grad.shape[1], positions)
    gf = grad.float()
    g1, g2 = gf.chunk(2, dim=-1)
    s1, s2 = sin.float().chunk(2, dim=-1)
    return (gf * cos + torch.cat([g2 * s2, -(g1 * s1)], dim=-1)).type_as(grad)

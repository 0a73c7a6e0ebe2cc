"""Gradient norm over every shard, clipping, and unscaling."""

from __future__ import annotations

import torch


def global_grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The true L2 norm of the full gradient, whatever the sharding (a 0-dim fp32 tensor)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False, foreach=True)
    if hasattr(norm, "full_tensor"):  # DTensor grads: partial norms are reduced across their mesh
        norm = norm.full_tensor()
    return norm.float()


@torch.no_grad()
def scale_grads(params: list[torch.nn.Parameter], factor: float | torch.Tensor) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)

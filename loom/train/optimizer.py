"""AdamW on fp32 master weights; fused or foreach kernels when the device supports them."""

from __future__ import annotations

import torch
from torch import nn

from loom.config.sections import OptimizerConfig
from loom.train.grads import scale_grads, unique_params


def _kernel_flags(impl: str, device: torch.device) -> dict:
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    return {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """Weight decay on matrices only (not norms)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    flags = _kernel_flags(cfg.implementation, device)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **flags)


class OptimizerParts:
    """One optimizer per model part (pipeline stages, or the one whole model), stepped together. Each part's
    state dict is keyed by that part's parameter names, so parts of any layout merge into one checkpoint."""

    def __init__(self, parts: list[nn.Module], cfg: OptimizerConfig, device: torch.device):
        self.parts = parts
        self.optimizers = [build_optimizer(part, cfg, device) for part in parts]
        self.params = unique_params(parts)
        n_held = sum(len(g["params"]) for opt in self.optimizers for g in opt.param_groups)
        # the fused kernels can multiply the gradients themselves (their ``grad_scale`` input, which
        # they divide by, as GradScaler uses it): no separate pass over the gradients. Only when no
        # parameter sits in two optimizers (each kernel rescales its gradients in place).
        self.fold_grad_factor = n_held == len(self.params) and all(
            opt.defaults.get("fused") for opt in self.optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizers[0].param_groups

    def step(self, grad_factor: float | torch.Tensor | None = None) -> None:
        """Step every part; ``grad_factor`` (clipping, loss-scale removal) multiplies the gradients first."""
        if grad_factor is None:
            for opt in self.optimizers:
                opt.step()
            return
        if not self.fold_grad_factor:
            scale_grads(self.params, grad_factor)
            for opt in self.optimizers:
                opt.step()
            return
        for opt in self.optimizers:
            device = opt.param_groups[0]["params"][0].device
            opt.grad_scale = 1.0 / torch.as_tensor(grad_factor, dtype=torch.float32, device=device)
            try:
                opt.step()
            finally:
                opt.grad_scale = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


"""Large-batch optimizers with a layer-wise trust ratio: LAMB (You et al. 2019, "Large Batch Optimization for
Deep Learning: Training BERT in 76 minutes", Algorithm 2) and LARS (You et al. 2017, "Large Batch Training of
Convolutional Networks", Algorithm 1).

Both scale each parameter's step by a ratio of norms of the WHOLE parameter. Under FSDP2 or TP a parameter is
a DTensor whose local tensor is a shard, so the norms are sums of squares of the local shards all-reduced over
the parameter's mesh: one all-reduce per sharded mesh axis for every parameter of the step together
(``whole_norms``), not one per parameter. Biases and norm weights (1-D parameters) take neither weight decay
nor the trust ratio when ``exclude_1d`` is on, as both papers' implementations do."""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.parallel.shards import local_tensor


def _like_param(grad: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The gradient in its parameter's placements (TP can return a Partial or Replicate gradient for a
    parameter that is Replicate or Shard); the update is computed on local tensors, which must line up."""
    if hasattr(p, "placements") and tuple(grad.placements) != tuple(p.placements):
        return grad.redistribute(p.device_mesh, p.placements)
    return grad


@torch.no_grad()
def whole_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each tensor over all its shards, (n,) fp32. Plain tensors are whole already. For DTensors,
    each local sum of squares is divided by the number of copies it has (the sizes of the mesh axes it is
    Replicate on), then the sums of one mesh are all-reduced over each mesh axis that shards any of them:
    the sum over every rank of the mesh counts each element once."""
    sq = torch.stack([local_tensor(t).float().square().sum() for t in tensors]) if tensors else torch.zeros(0)
    meshes: dict = {}
    for i, t in enumerate(tensors):
        if hasattr(t, "device_mesh"):
            meshes.setdefault(t.device_mesh, []).append(i)
    for mesh, idx in meshes.items():
        placements = [tensors[i].placements for i in idx]
        part = sq[idx]  # (m,) this mesh's local sums
        for axis in range(mesh.ndim):
            sharded = [pl[axis].is_shard() for pl in placements]
            if not any(sharded):
                continue  # every tensor is whole along this axis: nothing to add up
            copies = torch.tensor([1.0 if s else 1.0 / mesh.size(axis) for s in sharded], device=part.device)
            group = mesh.get_group(axis)
            # FSDP2's CPU offload keeps the shards on the host; NCCL reduces device tensors only
            device = torch.device("cuda") if dist.get_backend(group) == "nccl" else part.device
            reduced = (part * copies).to(device)
            dist.all_reduce(reduced, group=group)
            part = reduced.to(part.device)
        sq[idx] = part
    return sq.sqrt()


def _adapts(p: torch.Tensor, exclude_1d: bool) -> bool:
    """Whether ``p`` takes the trust ratio: every parameter, or only matrices (and larger) with ``exclude_1d``."""
    return p.ndim >= 2 or not exclude_1d


def _trust(w_norm: torch.Tensor, u_norm: torch.Tensor) -> torch.Tensor:
    """||w|| / ||u||, and 1 where either norm is 0 (a zero-initialized weight, a zero update)."""
    ok = (w_norm > 0) & (u_norm > 0)
    return torch.where(ok, w_norm / torch.where(ok, u_norm, torch.ones_like(u_norm)), torch.ones_like(w_norm))


class Lamb(torch.optim.Optimizer):
    """LAMB: Adam's bias-corrected update plus decoupled weight decay, ``u = m̂ / (sqrt(v̂) + eps) + wd·w``,
    scaled per parameter by ``||w|| / ||u||``: ``w ← w − lr · (||w|| / ||u||) · u``. State as AdamW's
    (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints reshard the same way."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        exclude_1d: bool = True,
    ):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.exclude_1d = exclude_1d

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, updates, scales = [], [], []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                g = local_tensor(_like_param(p.grad, p))
                m, v, w = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"]), local_tensor(p)
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
                u = (m / (1 - beta1**t)).div_(denom)
                if group["weight_decay"]:
                    u.add_(w, alpha=group["weight_decay"])
                params.append(p)
                updates.append(_wrap_like(u, p))
                scales.append(group["lr"])
        _apply(params, updates, scales, self.exclude_1d)
        return loss


class Lars(torch.optim.Optimizer):
    """LARS (Algorithm 1 of the paper): local LR ``λ = η·||w|| / (||g|| + wd·||w|| + eps)``, momentum buffer
    ``b ← μ·b + lr·λ·(g + wd·w)``, ``w ← w − b`` (the LR inside the buffer, as the paper writes it). Excluded
    (1-D) parameters take ``λ = 1`` and no decay: momentum SGD."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 1e-3,
        eps: float = 1e-8,
        exclude_1d: bool = True,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                momentum=momentum,
                weight_decay=weight_decay,
                trust_coefficient=trust_coefficient,
                eps=eps,
            ),
        )
        self.exclude_1d = exclude_1d

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = []  # (group, parameter, local gradient)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    entries.append((group, p, _like_param(p.grad, p)))
        if not entries:
            return loss
        norms = whole_norms([p for _, p, _ in entries] + [g for _, _, g in entries])
        w_norm, g_norm = norms[: len(entries)], norms[len(entries) :]
        for i, (group, p, grad) in enumerate(entries):
            wd = group["weight_decay"]
            g, w = local_tensor(grad), local_tensor(p)
            if _adapts(p, self.exclude_1d):
                ok = (w_norm[i] > 0) & (g_norm[i] > 0)
                local_lr = torch.where(
                    ok,
                    group["trust_coefficient"] * w_norm[i] / (g_norm[i] + wd * w_norm[i] + group["eps"]),
                    torch.ones_like(w_norm[i]),
                )
                d = g.add(w, alpha=wd) if wd else g.clone()
            else:
                local_lr, d = 1.0, g.clone()
            d.mul_(local_lr * group["lr"])
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = local_tensor(state["momentum_buffer"])
            buf.mul_(group["momentum"]).add_(d)
            w.sub_(buf)
        return loss


def _wrap_like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A local update as a DTensor laid out as ``p`` (so ``whole_norms`` sees its mesh), or as it is."""
    if not hasattr(p, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def _apply(params: list, updates: list, lrs: list, exclude_1d: bool) -> None:
    """``w ← w − lr · trust · u`` for each parameter, the trust ratios from one batched norm computation."""
    if not params:
        return
    norms = whole_norms(params + updates)
    w_norm, u_norm = norms[: len(params)], norms[len(params) :]
    trust = _trust(w_norm, u_norm)
    for i, (p, u, lr) in enumerate(zip(params, updates, lrs)):
        ratio = trust[i] if _adapts(p, exclude_1d) else 1.0
        local_tensor(p).sub_(local_tensor(u) * (ratio * lr))


def group_options(name: str, cfg) -> dict:
    """The per-group hyperparameters of ``name`` beyond lr and weight decay, from an ``OptimizerConfig``."""
    if name == "lamb":
        return {"betas": tuple(cfg.betas), "eps": cfg.eps}
    if name == "lars":
        return {"momentum": cfg.momentum, "trust_coefficient": cfg.trust_coefficient, "eps": cfg.eps}
    return {}


def build_large_batch(name: str, groups: list[dict], cfg) -> torch.optim.Optimizer:
    """LAMB or LARS over ``groups`` (each with its ``weight_decay``), configured from an ``OptimizerConfig``."""
    if name == "lamb":
        return Lamb(groups, lr=cfg.lr, exclude_1d=cfg.exclude_1d, **group_options(name, cfg))
    assert name == "lars", name
    return Lars(groups, lr=cfg.lr, exclude_1d=cfg.exclude_1d, **group_options(name, cfg))

"""Layout-independent initialization.

Every parameter is drawn on its full shape from a generator seeded by the run seed and the
parameter's canonical name, then this rank keeps its own shard (``keep``: loom.parallel.shards.keep_shard for a
sharded model). So weights do not depend on the number of devices or the parallel layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn

_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """Parameter name with wrapper segments (compile, activation checkpointing, DDP) removed."""
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name[len("module.") :] if name.startswith("module.") else name


def param_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{canonical_name(name)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _full_value(shape, std: float | None, seed: int, device: torch.device) -> torch.Tensor:
    if std is None:
        return torch.ones(shape, device=device)
    if std == 0:
        return torch.zeros(shape, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(shape, device=device)
    return nn.init.trunc_normal_(out, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=gen)


def copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """A plain parameter takes its full value (a sharded one keeps its shard: loom.parallel.shards.keep_shard)."""
    param.copy_(full)


@torch.no_grad()
def init_parameters(
    model: nn.Module,
    seed: int,
    std_of: Callable[[str], float | None],
    draw_device: torch.device | None = None,
    keep=copy_full,
) -> None:
    """Every parameter from its name: ``std_of(name)`` is a truncated normal's std, None for ones, 0 for zeros.
    ``draw_device``: where the values are drawn (a device's generator gives its own values: weights kept in host
    memory for a GPU run are drawn on the GPU, as that run without offload draws them); None: where each lives.
    ``keep(param, full)``: what the parameter keeps of its full value (the parallel layout's part)."""
    for name, param in model.named_parameters():
        cname = canonical_name(name)
        full = _full_value(param.shape, std_of(cname), param_seed(seed, cname), draw_device or param.device)
        keep(param, full)


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Places that hold the same Parameter object (tied weights), grouped."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((mod, name))
    return [group for group in places.values() if len(group) > 1]


def materialize(
    model: nn.Module,
    device: torch.device,
    seed: int,
    std_of,
    init_buffers,
    draw_device: torch.device | None = None,
    keep=copy_full,
) -> None:
    """Allocate storage for a meta-device model (sharded or not) and initialize it. A module marked ``host_weight``
    (QLoRA's base linears: quantized onto the device one at a time later) keeps its own tensors in host memory, so
    the device never holds the whole unquantized base."""
    shared = _shared_parameters(model)
    host = {id(m.weight) for m in model.modules() if getattr(m, "host_weight", False)}
    # Module.to_empty with a device per tensor (FSDP2's _apply hook re-registers its shards as after to_empty)
    model._apply(lambda t: torch.empty_like(t, device="cpu" if id(t) in host else device))
    for (mod0, name0), *others in shared:  # to_empty gives plain tensors one new Parameter per place: re-tie
        for mod, name in others:
            setattr(mod, name, getattr(mod0, name0))
    init_buffers(device)
    for (
        mod
    ) in model.modules():  # state buffers a module keeps (a router's selection bias) start from its reset
        if hasattr(mod, "reset_state"):
            mod.reset_state()
    init_parameters(model, seed, std_of, draw_device, keep)

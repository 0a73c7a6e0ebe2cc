"""Packed projections for generation: the linears that read one input (an attention's q, k and v, a SwiGLU's gate
and up) computed as one matmul over one weight. A batch-1 decode step is a chain of matrix-vector products whose
small ones (the k and v projections of a GQA layer) cost a kernel's start and tail more than their bytes: packed,
a block runs four projections instead of seven, each reading its weights in one pass.

Through the model's own hook for this, ``loom.models.common.layers.project`` (a linear class's
``project_together``): each packed module becomes a ``PackedLinear`` and its weight (and bias) a view of the one
packed tensor, so memory is unchanged, the parameters stay the same objects, and a load into them writes into the
packed tensor. Only plain modules pack (``nn.Linear`` exactly, weights plain tensors of one dtype and device: not
LoRA, not quantized, not split by tensor parallelism); ``unpack`` gives the classes back. For a model the engine
owns: converting the model's dtype or device afterwards (which re-allocates each parameter) would leave the packed
tensor stale."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# (submodule of a block, its linears that read one input), in the order ``project`` receives them
GROUPS = (("attention", ("wq", "wk", "wv")), ("feed_forward", ("w1", "w3")))


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is a view of a packed tensor held by the group's first module."""

    @staticmethod
    def project_together(x: torch.Tensor, linears) -> list[torch.Tensor] | None:
        """x (..., E) through the group's packed weight: one output per linear, as ``project`` expects; None when
        ``linears`` is not exactly a packed group."""
        first = linears[0]
        sizes = getattr(first, "packed_sizes", None)
        if sizes is None or len(linears) != len(sizes):
            return None
        return list(
            F.linear(x, first.packed_weight, first.packed_bias).split(sizes, dim=-1)
        )  # each (..., N_i)


def _packable(mods: list) -> bool:
    if not all(type(m) is nn.Linear for m in mods):
        return False
    tensors = [m.weight for m in mods] + [m.bias for m in mods if m.bias is not None]
    if any(
        type(t.data) is not torch.Tensor for t in tensors
    ):  # DTensor, NF4 and other subclasses stay as they are
        return False
    if len({(t.dtype, t.device) for t in tensors}) != 1:
        return False
    return all(m.bias is None for m in mods) or all(m.bias is not None for m in mods)


def _into(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One tensor holding ``tensors`` concatenated on dim 0; each parameter becomes a view of its rows."""
    packed = torch.cat([t.detach() for t in tensors])  # (sum N_i, ...)
    start = 0
    for t in tensors:
        t.data = packed[start : start + t.shape[0]]
        start += t.shape[0]
    return packed


def pack(model: nn.Module) -> int:
    """Pack every block's groups that can be (module docstring); returns how many groups were packed."""
    count = 0
    for block in model.layers.values():
        for owner_name, names in GROUPS:
            owner = getattr(block, owner_name, None)
            mods = [getattr(owner, n, None) for n in names]
            if owner is None or not _packable(mods):
                continue
            with torch.no_grad():
                weight = _into([m.weight for m in mods])
                bias = _into([m.bias for m in mods]) if mods[0].bias is not None else None
            for m in mods:
                m.__class__ = PackedLinear
            first = mods[0]
            first.register_buffer("packed_weight", weight, persistent=False)
            first.register_buffer("packed_bias", bias, persistent=False)
            first.packed_sizes = tuple(m.weight.shape[0] for m in mods)
            count += 1
    return count


def unpack(model: nn.Module) -> None:
    """Every ``PackedLinear`` back to ``nn.Linear`` (its parameters stay views of the packed tensor: same values)."""
    for module in model.modules():
        if type(module) is PackedLinear:
            for name in ("packed_weight", "packed_bias"):
                module._buffers.pop(name, None)
            module.__dict__.pop("packed_sizes", None)
            module.__class__ = nn.Linear

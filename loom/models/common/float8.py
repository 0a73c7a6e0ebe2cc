"""Float8 training of the linear layers through torchao (``training.float8``): the matmuls of every
transformer-block linear run in float8 (e4m3 forward, e5m2 gradients) with dynamic scales, per tensor
(``tensorwise``) or per row (``rowwise``); weights, optimizer state and master copies stay as they are.
The output head stays in bf16 (as torchtitan: vocab-sized logits are sensitive to float8 rounding).

Applied in the composition order after tensor parallelism and before activation checkpointing,
compile and FSDP (see loom.parallel.parallelize)."""

from __future__ import annotations

import dataclasses

from torch import nn

RECIPES = ("tensorwise", "rowwise")


def float8_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def _convertible(module: nn.Module, fqn: str) -> bool:
    """Block linears whose both dims are multiples of 16 (float8 GEMM tiles); never the output head."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "output":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module, recipe: str, all_gather: bool = False) -> int:
    """Swap eligible ``nn.Linear`` modules for torchao ``Float8Linear`` in place; returns how many. ``all_gather``
    (tensorwise only): their weights become torchao's float8-castable wrappers, which FSDP2 gathers in float8
    (``training.float8_all_gather``); without FSDP they compute exactly as the plain float8 linears."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe not in RECIPES:
        raise ValueError(f"float8 recipe {recipe!r}: allowed {', '.join(RECIPES)}")
    if all_gather and recipe != "tensorwise":
        raise ValueError(f"float8 all-gather needs the tensorwise recipe, not {recipe!r}")
    config = Float8LinearConfig.from_recipe_name(recipe)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=config, module_filter_fn=_convertible)
    from torchao.float8.float8_linear import Float8Linear

    converted = sum(isinstance(m, Float8Linear) for m in model.modules())
    assert converted <= before
    return converted


def precompute_scales(model: nn.Module) -> int:
    """With float8 all-gather: every wrapped weight's scale from its global amax, in one pass over the weights and
    one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``). FSDP2 then casts each shard with it
    instead of reducing that weight's amax inside its all-gather (an all-reduce per weight and gather, which waits
    on the gather's stream). Returns how many weights got a scale (0: none is wrapped and sharded)."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import (
        WeightWithDynamicFloat8CastTensor,
        precompute_float8_dynamic_scale_for_fsdp,
    )

    count = sum(
        isinstance(m, Float8Linear)
        and isinstance(m.weight, DTensor)
        and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
        for m in model.modules()
    )
    if count:
        precompute_float8_dynamic_scale_for_fsdp(model)
    return count

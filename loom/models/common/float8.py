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

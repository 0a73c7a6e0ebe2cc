"""Float8 training of the linear layers through torchao (``training.float8``): the matmuls of every
transformer-block linear run in float8 (e4m3 forward, e5m2 gradients) with dynamic scales, per tensor
(``tensorwise``) or per row (``rowwise``); weights, optimizer state and master copies stay as they are.
The output head stays in bf16 (as torchtitan: vocab-sized logits are sensitive to float8 rounding).

Applied in the composition order after tensor parallelism and before activation checkpointing,
compile and FSDP (see loom.parallel.parallelize)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import weakref
from typing import NamedTuple

import torch
from torch import nn

from loom.config.errors import ConfigError

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


def apply_float8(model: nn.Module, recipe: str, all_gather: bool = False, shards: int = 1) -> int:
    """Swap eligible ``nn.Linear`` modules for torchao ``Float8Linear`` in place; returns how many. ``all_gather``
    (tensorwise only): their weights become torchao's float8-castable wrappers, which FSDP2 gathers in float8
    (``training.float8_all_gather``) over ``shards`` ranks; without FSDP they compute exactly as the plain float8
    linears."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe not in RECIPES:
        raise ValueError(f"float8 recipe {recipe!r}: allowed {', '.join(RECIPES)}")
    if all_gather and recipe != "tensorwise":
        raise ValueError(f"float8 all-gather needs the tensorwise recipe, not {recipe!r}")
    if all_gather:
        check_even_rows(model, shards)
    config = Float8LinearConfig.from_recipe_name(recipe)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=config, module_filter_fn=_convertible)
    from torchao.float8.float8_linear import Float8Linear

    converted = sum(isinstance(m, Float8Linear) for m in model.modules())
    assert converted <= before
    return converted


def check_even_rows(model: nn.Module, shards: int) -> None:
    """The float8 gather needs every shard of a converted weight alike: FSDP2 pads an uneven shard into a new tensor
    (the wrapper's precomputed scale lost on those ranks, which would then reduce an amax the others do not) and
    torchao's pre-all-gather hands it the unpadded shard."""
    for fqn, m in model.named_modules():
        if _convertible(m, fqn) and m.out_features % shards:
            raise ConfigError(
                "training.float8_all_gather",
                True,
                f"needs each float8 weight's rows divisible by its {shards} FSDP2 shards (dp_shard x cp): {fqn} "
                f"has {m.out_features}; allowed false here",
            )


def precompute_scales(model: nn.Module, amaxes=None) -> int:
    """With float8 all-gather: every wrapped weight's scale from its global amax, in one pass over the weights and
    one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``); ``amaxes(weights)``, where it gives
    each weight's local amax (the optimizer's, written in its step), saves the pass (``scales_from_amax``). FSDP2
    then casts each shard with it instead of reducing that weight's amax inside its all-gather (an all-reduce per
    weight and gather, which waits on the gather's stream). Each FSDP2 unit's shards are cast to float8 at its
    first gather (``cast_shards``, lazy). Returns how many weights got a scale (0: none is wrapped and sharded)."""
    from torchao.float8.fsdp_utils import precompute_float8_dynamic_scale_for_fsdp

    weights = _gathered_float8_weights(model)
    if weights:
        amax = amaxes(weights) if amaxes is not None else None
        if amax is None:
            precompute_float8_dynamic_scale_for_fsdp(model)
        else:
            scales_from_amax(weights, amax)
        for unit in fsdp_units(model, weights):
            cast_shards(unit, lazy=True)
    return len(weights)


@torch.no_grad()
def scales_from_amax(weights: list, amax: torch.Tensor) -> None:
    """torchao's precomputed scales (``precompute_float8_dynamic_scale_for_fsdp``, bitwise: the same max over the
    shards, clamp and float64 division) from each weight's local amax (``amax[i]`` for ``weights[i]``, e.g. written
    by loom's AdamW in its step's pass) instead of a pass over the weights: one all-reduce (max) over the mesh's
    sharded dims."""
    import torch.distributed as dist
    from torchao.float8.float8_utils import EPS

    amax = amax.detach().float().clone()
    mesh = weights[0].device_mesh
    for dim, placement in enumerate(weights[0].placements):
        if placement.is_shard() and mesh.size(dim) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    fmax = torch.finfo(weights[0]._local_tensor._dtype).max
    scales = (fmax / torch.clamp(amax, EPS).to(torch.float64)).to(torch.float32)
    for i, w in enumerate(weights):
        w._local_tensor._precomputed_scale = scales[i]


def fsdp_units(model: nn.Module, weights: list) -> list[list]:
    """``weights`` grouped by the FSDP2 unit that gathers them (in the model's order; a weight in no unit's group
    alone)."""
    from torch.distributed.fsdp import FSDPModule

    ids = {id(w): w for w in weights}
    units = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        unit = [
            ids.pop(id(p.sharded_param))
            for p in (group.fsdp_params if group else [])
            if id(p.sharded_param) in ids
        ]
        if unit:
            units.append(unit)
    return units + [[w] for w in ids.values()]


def _gathered_float8_weights(model: nn.Module) -> list:
    """The DTensor weights of the float8 linears FSDP2 gathers in float8 (torchao's wrapper as their shard)."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return [
        m.weight
        for m in model.modules()
        if isinstance(m, Float8Linear)
        and isinstance(m.weight, DTensor)
        and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
    ]


class _Cast(NamedTuple):
    data: torch.Tensor  # the shard in float8
    scale: torch.Tensor  # the scale object it was cast with (each precompute sets new ones)
    source: torch.Tensor  # the shard's storage tensor it was cast from
    param: weakref.ref  # the DTensor parameter (an in-place op on it bumps its counter only)
    versions: tuple  # the parameter's, the shard's and its storage's version counters then


class _Pending(NamedTuple):
    """A unit's shards to cast at its first gather (``cast_shards(lazy=True)``)."""

    weights: list  # weak references to the unit's DTensor parameters
    scale: torch.Tensor  # this shard's scale when the cast was deferred
    source: torch.Tensor
    param: weakref.ref
    versions: tuple


@torch.no_grad()
def cast_shards(weights: list, lazy: bool = False) -> None:
    """Each shard cast to float8 with its precomputed scale, as torchao's pre-all-gather would (scale, clamp to the
    format's range, cast; bitwise the same), all of ``weights`` in one compiled call on CUDA (one kernel a shard,
    reading 4 bytes and writing 1 a parameter), instead of three eager kernels per weight and gather: FSDP2's
    pre-forward then only reads the cast (``cached_cast_class``). The casts hold a byte per parameter of the shards
    until ``drop_casts``. ``lazy`` (``weights``: one FSDP2 unit's): cast at the unit's first gather instead, on the
    stream FSDP2 copies the gather's inputs on, beside the compute of the unit before it, rather than after the
    update, where the next forward's first gather waits for every unit's casts."""
    shards = [w._local_tensor for w in weights]
    cls = cached_cast_class()
    for shard in shards:
        if type(shard) is not cls:  # new shards (a load by assignment) come back as torchao's class
            shard.__class__ = cls
        shard.__dict__.pop("_loom_cast", None)  # the old casts freed before the new are made
        shard.__dict__.pop("_loom_pending", None)
    if lazy:
        unit = [weakref.ref(w) for w in weights]
        for shard, param in zip(shards, weights):
            versions = (param._version, shard._version, shard._tensor._version)
            pending = _Pending(unit, shard._precomputed_scale, shard._tensor, weakref.ref(param), versions)
            shard.__dict__["_loom_pending"] = pending
        return
    sources = [s._tensor for s in shards]
    scales = [s._precomputed_scale for s in shards]
    casts = _casts(sources, scales, shards[0]._dtype)
    for shard, param, data, scale, source in zip(shards, weights, casts, scales, sources):
        versions = (param._version, shard._version, source._version)
        shard.__dict__["_loom_cast"] = _Cast(data, scale, source, weakref.ref(param), versions)


def _cast_pending(shard) -> None:
    """``shard``'s unit cast now (its first gather since the scales were computed): those of its shards still as
    they were then, in one compiled call; the others gather as torchao casts."""
    weights = [w for ref in shard.__dict__["_loom_pending"].weights if (w := ref()) is not None]
    ready = []
    for w in weights:
        pending = w._local_tensor.__dict__.pop("_loom_pending", None)
        if pending is not None and _holds(pending, w._local_tensor):
            ready.append(w)
    if ready:
        cast_shards(ready)


def _scaled_casts(sources: list, scales: list, dtype: torch.dtype) -> list:
    """torchao's cast of a weight with a given scale (hp_tensor_and_scale_to_float8), for each of ``sources``."""
    fmax = torch.finfo(dtype).max
    return [(t.to(torch.float32) * s).clamp(-fmax, fmax).to(dtype) for t, s in zip(sources, scales)]


@functools.cache
def _compiled_casts(backend: str = "inductor"):
    """``_scaled_casts`` compiled once per list of shapes: each cast one fused kernel, all launched from one call."""
    return torch.compile(_scaled_casts, fullgraph=True, dynamic=False, backend=backend)


# compiled lists of shapes kept (one per model part and size: pipeline stages, other runs in the process)
CAST_RECOMPILE_LIMIT = 64


def _casts(sources: list, scales: list, dtype: torch.dtype, backend: str | None = None) -> list:
    """``_scaled_casts``, compiled (by default on CUDA, with Inductor); eager where Dynamo has compiled as many
    lists as it keeps."""
    backend = backend or ("inductor" if sources[0].is_cuda else None)
    if backend is None:
        return _scaled_casts(sources, scales, dtype)
    try:
        with _cast_recompile_limit():
            return _compiled_casts(backend)(sources, scales, dtype)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        return _scaled_casts(sources, scales, dtype)


def _cast_recompile_limit():
    """Dynamo's recompile limit raised to ``CAST_RECOMPILE_LIMIT`` for the casts' call where it is lower; no patch
    where it is not (as ``apply_compile`` leaves it): a config patch costs ~70 us, once per FSDP2 unit and step."""
    cfg = torch._dynamo.config
    if cfg.recompile_limit >= CAST_RECOMPILE_LIMIT:
        return contextlib.nullcontext()
    return cfg.patch(recompile_limit=CAST_RECOMPILE_LIMIT)


def drop_casts(model: nn.Module) -> None:
    """Frees the casts ``cast_shards`` made (their weights are about to change): until the next cast, FSDP2's
    gathers cast each shard as torchao does."""
    for w in _gathered_float8_weights(model):
        w._local_tensor.__dict__.pop("_loom_cast", None)
        w._local_tensor.__dict__.pop("_loom_pending", None)


@functools.cache
def cached_cast_class() -> type:
    """torchao's float8-castable weight whose FSDP2 pre-all-gather returns the cast ``cast_shards`` made while it
    still holds (same scale object, same storage, no in-place change since), and casts as torchao otherwise. Only
    FSDP2's local shards become this class (``__class__`` swapped): torchao's ops build their outputs as its own
    class and flatten only the tensor and scale, so no copy, compile or checkpoint carries a cast."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    class CachedCastWeight(WeightWithDynamicFloat8CastTensor):
        def fsdp_pre_all_gather(self, mesh):
            if "_loom_pending" in self.__dict__:
                _cast_pending(self)
            cast = self.__dict__.get("_loom_cast")
            if cast is not None and _holds(cast, self):
                return (cast.data,), (cast.scale,)
            self.__dict__.pop("_loom_cast", None)
            return super().fsdp_pre_all_gather(mesh)

        def __reduce_ex__(self, proto):  # saved as torchao's class (allow-listed), without the cast
            return _as_torchao(self).__reduce_ex__(proto)

        def __deepcopy__(self, memo):
            return copy.deepcopy(_as_torchao(self), memo)

    return CachedCastWeight


def _holds(cast: _Cast | _Pending, shard) -> bool:
    source, param = shard._tensor, cast.param()
    return (
        param is not None
        and cast.scale is shard._precomputed_scale
        and cast.source is source
        and cast.versions == (param._version, shard._version, source._version)
    )


def _as_torchao(shard):
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return WeightWithDynamicFloat8CastTensor(
        shard._tensor, shard._linear_mm_config, shard._dtype, shard._precomputed_scale
    )

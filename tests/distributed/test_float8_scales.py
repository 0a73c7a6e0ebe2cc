"""training.float8_all_gather's precomputed scales on 2 gloo ranks: after FSDP2 shards the wrapped float8 weights,
one pass gives each weight float8's max over its global amax (the scale its all-gather would reduce), and the step
hook recomputes them once the weights change. gloo cannot gather float8, so the gather itself is checked on GPUs
(tests/gpu/test_multi_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from loom.models.common.float8 import float8_available
from tests.distributed.harness import run_fn

pytestmark = pytest.mark.skipif(not float8_available(), reason="torchao not installed")


def scales_follow_global_amax(rank: int, world: int) -> dict:
    import copy
    import io

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8.float8_linear import Float8Linear

    from loom.models.common.float8 import _as_torchao, apply_float8, precompute_scales
    from loom.models.llama import FLAVORS, Llama
    from loom.parallel.shards import local_tensor
    from loom.train.precision import Float8Scales

    torch.manual_seed(0)
    model = Llama(FLAVORS["debug"].with_(vocab_size=256))
    wrapped = apply_float8(model, "tensorwise", all_gather=True)
    mesh = init_device_mesh("cpu", (world,))
    before = precompute_scales(model)  # not sharded yet: nothing to precompute
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
    fmax = torch.finfo(torch.float8_e4m3fn).max

    def error() -> float:
        """The largest relative error of any weight's scale on any rank."""
        out = []
        for m in linears:
            amax = local_tensor(m.weight).abs().max().reshape(1)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
            want = (fmax / amax.double()).float()
            out.append((m.weight._local_tensor._precomputed_scale - want).abs() / want)
        worst = torch.cat(out).max().reshape(1)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return worst.item()

    def gathers() -> list:
        """What FSDP2's pre-all-gather hands each weight's gather: (float8 shard, scale)."""
        return [m.weight._local_tensor.fsdp_pre_all_gather(mesh) for m in linears]

    def torchao_casts() -> list:
        """torchao's own eager cast of each shard with its precomputed scale."""
        return [_as_torchao(m.weight._local_tensor).fsdp_pre_all_gather(mesh) for m in linears]

    def same(got: list, want: list) -> bool:
        return all(
            torch.equal(g[0][0].view(torch.uint8), w[0][0].view(torch.uint8))
            and torch.equal(g[1][0], w[1][0])
            for g, w in zip(got, want)
        )

    def reused() -> bool:
        return all(g[0][0] is m.weight._local_tensor._loom_cast.data for g, m in zip(gathers(), linears))

    def cast_now() -> list:
        return ["_loom_cast" in m.weight._local_tensor.__dict__ for m in linears]

    first_block = {id(m) for m in next(iter(model.layers.values())).modules()}
    hook = Float8Scales([model], after_quorum=False)
    hook.begin(0)
    first = error()
    # lazy: nothing cast until a unit's first gather, which casts that unit's shards (and no other unit's)
    lazy = {"nothing_yet": not any(cast_now())}
    linears[0].weight._local_tensor.fsdp_pre_all_gather(mesh)
    lazy["one_unit"] = cast_now() == [id(m) in first_block for m in linears] and any(cast_now())
    cast = {"reused": reused(), "equal": same(gathers(), torchao_casts())}
    # a copied or saved weight is torchao's, without the cast (saved: loadable with weights_only)
    buffer = io.BytesIO()
    torch.save(linears[0].weight._local_tensor, buffer)
    buffer.seek(0)
    copied = [copy.deepcopy(linears[0].weight)._local_tensor, torch.load(buffer, weights_only=True)]
    cast["copy_plain"] = all(type(c).__name__ == "WeightWithDynamicFloat8CastTensor" for c in copied)
    cast["copy_plain"] &= not any("_loom_cast" in c.__dict__ for c in copied)
    hook.after_backward([])  # the weights are about to change: the casts are freed, gathers cast as torchao
    cast["dropped"] = not any("_loom_cast" in m.weight._local_tensor.__dict__ for m in linears)
    cast["eager_equal"] = same(gathers(), torchao_casts())
    with torch.no_grad():  # an update that changes rank 1's shards only: every rank's scales follow it
        if rank == 1:
            for i, m in enumerate(linears):
                local_tensor(m.weight).mul_(0.5 + i % 3)
    hook.after_update(1)
    after = error()
    cast["recast_equal"] = reused() and same(gathers(), torchao_casts())
    old = linears[0].weight._local_tensor._loom_cast.data
    with torch.no_grad():  # an in-place change through the DTensor, no refresh: the cast no longer holds
        linears[0].weight.mul_(2.0)
    cast["stale_refused"] = gathers()[0][0][0] is not old
    cast["stale_equal"] = same(gathers()[:1], torchao_casts()[:1])
    # a shard changed in place between the refresh and its unit's first gather: the unit casts the others, it
    # gathers as torchao casts it
    hook.after_update(2)
    with torch.no_grad():
        linears[1].weight.mul_(3.0)
    linears[0].weight._local_tensor.fsdp_pre_all_gather(mesh)
    lazy["stale_left"] = cast_now()[:2] == [True, False] and same(gathers()[1:2], torchao_casts()[1:2])
    # with loom's AdamW the scales come from the amaxes its step wrote: torchao's own scales, bitwise
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import precompute_float8_dynamic_scale_for_fsdp

    from loom.config.sections import OptimizerConfig
    from loom.train.optimizer import OptimizerParts

    opt = OptimizerParts([model], OptimizerConfig(lr=0.05, implementation="triton"), torch.device("cpu"))
    tracked = Float8Scales([model], after_quorum=False, optimizer=opt)
    tracked.begin(2)
    torch.manual_seed(rank)
    for p in model.parameters():
        p.grad = DTensor.from_local(torch.randn(local_tensor(p).shape), p.device_mesh, p.placements)
    opt.step()
    tracked.after_update(3)
    mine = [m.weight._local_tensor._precomputed_scale.clone() for m in linears]
    precompute_float8_dynamic_scale_for_fsdp(model)
    theirs = [m.weight._local_tensor._precomputed_scale for m in linears]
    amax = {"from_optimizer": tracked.from_optimizer and not hook.from_optimizer}
    amax["optimizer_scales"] = all(torch.equal(a, b) for a, b in zip(mine, theirs)) and error() < 1e-6
    out = {"before": before, "count": len(linears), "wrapped": wrapped, "first": first, "after": after}
    return {**out, **cast, **lazy, **amax}


def test_precomputed_scales_are_float8_max_over_the_global_amax(tmp_path):
    """Also: the shards cast once per refresh, at their FSDP2 unit's first gather, are what every gather reuses,
    bitwise torchao's own cast; freed once the gradients are complete; refused after an in-place change that no
    refresh followed; with loom's AdamW, computed from the amaxes its step wrote, bitwise torchao's scales."""
    r = run_fn(2, scales_follow_global_amax, str(tmp_path))
    assert r["before"] == 0 and r["count"] == r["wrapped"] > 0, r
    assert r["first"] < 1e-6 and r["after"] < 1e-6, r
    assert r["reused"] and r["equal"] and r["dropped"] and r["eager_equal"] and r["recast_equal"], r
    assert r["stale_refused"] and r["stale_equal"] and r["copy_plain"], r
    assert r["nothing_yet"] and r["one_unit"] and r["stale_left"], r
    assert r["from_optimizer"] and r["optimizer_scales"], r

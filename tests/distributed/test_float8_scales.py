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
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8.float8_linear import Float8Linear

    from loom.models.common.float8 import apply_float8, precompute_scales
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

    hook = Float8Scales([model], after_quorum=False)
    hook.begin(0)
    first = error()
    with torch.no_grad():  # an update that changes rank 1's shards only: every rank's scales follow it
        if rank == 1:
            for i, m in enumerate(linears):
                local_tensor(m.weight).mul_(0.5 + i % 3)
    hook.after_update(1)
    return {"before": before, "count": len(linears), "wrapped": wrapped, "first": first, "after": error()}


def test_precomputed_scales_are_float8_max_over_the_global_amax(tmp_path):
    r = run_fn(2, scales_follow_global_amax, str(tmp_path))
    assert r["before"] == 0 and r["count"] == r["wrapped"] > 0, r
    assert r["first"] < 1e-6 and r["after"] < 1e-6, r

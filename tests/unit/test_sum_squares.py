"""loom::sum_squares (the gradient norm's local part on CUDA): the reference against PyTorch's norm, the op's opcheck,
the Triton kernel under the interpreter (mixed dtypes, several blocks, non-finite values, its refusals), and the
norm over sharded gradients on 2 gloo ranks against PyTorch's DTensor norm."""

from __future__ import annotations

import functools
import textwrap

import pytest
import torch

from loom.kernels.sum_squares import reference
from loom.kernels.sum_squares.op import sum_squares
from tests.distributed.harness import run_fn
from tests.unit.test_kernels_fused import interpret, triton_skip_reason


def test_reference_and_op_are_the_squared_norm():
    from torch.library import opcheck

    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(s, generator=gen) for s in ((7, 5), (3,), (2, 4, 6))] + [torch.randn(9).bfloat16()]
    want = torch.nn.utils.get_total_norm([t.float() for t in ts], norm_type=2.0) ** 2
    assert torch.allclose(reference.sum_squares(ts), want, rtol=1e-6)
    assert torch.allclose(sum_squares(ts), want, rtol=1e-6)
    assert sum_squares([torch.tensor([1.0, float("inf")])]).isinf()
    opcheck(torch.ops.loom.sum_squares, (ts,))
    with pytest.raises(ValueError, match="no tensors"):
        sum_squares([])


INTERPRETER_SCRIPT = textwrap.dedent("""
    import torch
    from loom.kernels.sum_squares import reference, triton as tk
    torch.manual_seed(0)
    ts = [torch.randn(s) for s in ((8, 6), (4,), (2, 3, 5000), (0,))] + [torch.randn(9000).bfloat16()]
    got, want = tk.sum_squares(ts), reference.sum_squares(ts)
    assert torch.allclose(got, want, rtol=1e-5), (got, want)
    assert tk.sum_squares([torch.zeros(0)]).item() == 0.0
    assert tk.sum_squares([torch.tensor([1.0, float("nan")]), torch.ones(3)]).isnan()
    def raises(*args):
        try:
            tk.sum_squares(*args)
        except ValueError:
            return
        raise AssertionError("no ValueError")
    raises([torch.zeros(4, 6).t()])  # not contiguous
    raises([torch.zeros(3, dtype=torch.float64)])  # float64
    raises([])
    print("ok sum_squares")
""")


@pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
def test_triton_kernel_under_the_interpreter():
    assert "ok sum_squares" in interpret(INTERPRETER_SCRIPT)


def _sharded(placements: str, rank: int, world: int) -> dict:
    """Gradients of several shapes as DTensors on a (2,) or (1, 2) mesh: loom's sum over the shards against the
    square of PyTorch's DTensor norm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from loom.train.grads import sharded_sum_squares

    mesh = init_device_mesh("cpu", (1, world)) if placements == "hsdp" else init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(1)
    full = [torch.randn(s, generator=gen) for s in ((6, 4), (5, 3), (8,))]
    pls = {
        "fsdp": [(Shard(0),), (Shard(0),), (Replicate(),)],
        "hsdp": [(Replicate(), Shard(0)), (Replicate(), Shard(0)), (Replicate(), Replicate())],
    }[placements]
    grads = [distribute_tensor(t, mesh, list(p)) for t, p in zip(full, pls)]
    got = sharded_sum_squares(grads)
    want = torch.nn.utils.get_total_norm(grads, norm_type=2.0).full_tensor() ** 2
    return {"got": float(got), "want": float(want), "exact": float(sum(t.pow(2).sum() for t in full))}


@pytest.mark.parametrize("placements", ["fsdp", "hsdp"])
def test_sum_over_sharded_gradients_is_the_dtensor_norm(tmp_path, placements):
    r = run_fn(2, functools.partial(_sharded, placements), str(tmp_path))
    assert r["got"] == pytest.approx(r["want"], rel=1e-6)
    assert r["got"] == pytest.approx(r["exact"], rel=1e-6)

"""loom::chunk_copy_ (parallel.fsdp_grad_copy triton): FSDP2's reduce-scatter copy-in layout (torch._chunk_cat's where
every first dim divides), the reference against PyTorch, the op's opcheck, the Triton kernel under the interpreter,
and FSDP2's copy-in replaced where it fits and kept where it does not."""

from __future__ import annotations

import textwrap

import pytest
import torch

from loom.kernels.chunk_copy import reference
from loom.kernels.chunk_copy.op import chunk_copy_
from tests.unit.test_kernels_fused import interpret, triton_skip_reason

SHAPES = [(8, 6), (4,), (2, 3, 5), (6, 7)]


def grads(dtype, shapes=SHAPES):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


@pytest.mark.parametrize(
    "src,dst",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)],
)
def test_reference_is_torch_chunk_cat(src, dst):
    gs = grads(src)
    out, want = torch.empty(sum(g.numel() for g in gs), dtype=dst), torch.empty(2, 84, dtype=dst)
    reference.chunk_copy_(gs, out, 2)
    torch._chunk_cat(gs, dim=0, num_chunks=2, out=want)
    assert torch.equal(out.view(2, -1), want)


def test_opcheck_and_the_uneven_refusal():
    from torch.library import opcheck

    opcheck(torch.ops.loom.chunk_copy_, (grads(torch.bfloat16), torch.empty(168), 2))
    with pytest.raises(ValueError, match="divide by 2"):
        chunk_copy_([torch.zeros(3, 2)], torch.empty(6), 2)


def test_fsdp2_copy_in_is_replaced_where_the_gradients_fit_and_kept_where_not():
    """The copy FSDP2 calls gives its own bytes either way: fitting gradients through loom's op, a first dim that
    does not divide (FSDP2 pads it) through FSDP2's own; use_grad_copy sets and restores the function FSDP2 calls."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    from loom.parallel import grad_copy

    calls = []
    original_op = grad_copy.chunk_copy_
    grad_copy.chunk_copy_ = lambda *a: calls.append(1) or original_op(*a)
    try:
        for shapes in (SHAPES, [(5, 4), (4,)]):
            gs = grads(torch.bfloat16, shapes)
            padded = sum(-(-g.shape[0] // 2) * (g.numel() // g.shape[0]) for g in gs) * 2
            out, want = torch.full((padded,), 7.0), torch.full((padded,), 7.0)
            grad_copy.grad_copy_in(gs, out, 2)
            grad_copy._TORCH(gs, want, 2)
            assert torch.equal(out, want)
        assert calls == [1]  # the first list through loom's op, the uneven one through FSDP2's
    finally:
        grad_copy.chunk_copy_ = original_op
    try:
        grad_copy.use_grad_copy("triton")
        assert collectives.foreach_reduce_scatter_copy_in is grad_copy.grad_copy_in
        grad_copy.use_grad_copy("auto", torch.device("cpu"))  # auto: loom's kernel on CUDA only
        assert collectives.foreach_reduce_scatter_copy_in is grad_copy._TORCH
    finally:
        grad_copy.use_grad_copy("torch")
    assert collectives.foreach_reduce_scatter_copy_in is grad_copy._TORCH


INTERPRETER_SCRIPT = textwrap.dedent("""
    import torch
    from loom.kernels.chunk_copy import reference, triton as tk
    torch.manual_seed(0)
    for src, dst in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32)):
        for chunks, shapes in ((2, [(8, 6), (4,), (2, 3, 5000)]), (4, [(8200,), (4, 3)])):
            gs = [torch.randn(s).to(src) for s in shapes]
            n = sum(g.numel() for g in gs)
            out, want = torch.full((n,), 9.0, dtype=dst), torch.empty(n, dtype=dst)
            tk.chunk_copy(gs, out, chunks)
            reference.chunk_copy_(gs, want, chunks)
            assert torch.equal(out, want), (src, chunks)
    def raises(*args):
        try:
            tk.chunk_copy(*args)
        except ValueError:
            return
        raise AssertionError("no ValueError")
    x = torch.zeros(4, 6)
    raises([x.t()], torch.empty(24), 2)  # not contiguous
    raises([torch.zeros(3, 2)], torch.empty(6), 2)  # 3 rows over 2 chunks
    raises([x, x.double()], torch.empty(48), 2)  # mixed dtypes
    raises([x], torch.empty(25), 2)  # the buffer's size
    raises([x], torch.empty(24, dtype=torch.float16), 2)  # fp16 buffer
    print("ok chunk_copy")
""")


@pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
def test_triton_kernel_under_the_interpreter():
    assert "ok chunk_copy" in interpret(INTERPRETER_SCRIPT)

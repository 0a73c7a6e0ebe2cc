"""Fused RMSNorm / RoPE / SwiGLU Triton kernels on CUDA; skipped without CUDA.

Each output and gradient is compared with an fp64 computation of the same function on the same
(rounded) inputs. The bound is relative to what the unfused PyTorch code achieves in the same dtype
(the model's math, gradients through autograd): fused error <= 2 x PyTorch error + a small atol.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from loom.kernels.rmsnorm import reference as norm_ref
from loom.kernels.rmsnorm.op import rms_norm
from loom.kernels.rope import reference as rope_ref
from loom.kernels.rope.op import apply_rope
from loom.kernels.swiglu import reference as swiglu_ref
from loom.kernels.swiglu.op import swiglu
from loom.models.common.rope import RopeScaling, rope_table

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# atol as a fraction of the largest true value: room for a rounding order different from PyTorch's
REL_ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}
CUDA = torch.device("cuda")


def rand(shape, dtype, scale=1.0, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=CUDA) * scale).to(dtype)


def assert_no_worse(name: str, fused: torch.Tensor, plain: torch.Tensor, truth: torch.Tensor, dtype) -> None:
    """fused and plain: the same quantity from the fused op and from unfused PyTorch; truth: fp64."""
    assert fused.dtype == plain.dtype and fused.shape == plain.shape, name
    assert torch.isfinite(fused).all(), f"{name}: non-finite values"
    if truth.numel() == 0:
        return
    err_fused = (fused.double() - truth).abs().max().item()
    err_plain = (plain.double() - truth).abs().max().item()
    atol = REL_ATOL[dtype] * truth.abs().max().item() + 1e-12
    assert err_fused <= 2 * err_plain + atol, (
        f"{name} {dtype}: fused error {err_fused:.3g} > 2 x PyTorch's {err_plain:.3g} + {atol:.3g}"
    )


def grads(fn, inputs, grad):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*inputs)
    out.backward(grad)
    return out.detach(), [t.grad for t in inputs if t.requires_grad]


def went_through_triton(kernel: str) -> None:
    assert f"loom.kernels.{kernel}.triton" in sys.modules, "the op did not run the Triton kernel"


# ---- RMSNorm ----------------------------------------------------------------------------------------

NORM_SHAPES = [
    (1, 1, 4095),
    (3, 7, 2048),
    (2, 5, 8192),
    (1, 3, 16384),
    (8192, 512),
    (1000, 1000),
    (2, 1536, 4096),
    (4, 64),
    (5, 3),
    (0, 128),
]


def norm_truth(x, w, eps):
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_rmsnorm_matches_fp64(shape, dtype):
    eps = 1e-5
    x, g = rand(shape, dtype, 3.0), rand(shape, dtype, seed=1)
    w = (1 + 0.5 * rand(shape[-1:], torch.float32, seed=2)).to(dtype)
    out, (dx, dw) = grads(lambda a, b: rms_norm(a, b, eps), [x, w], g)
    went_through_triton("rmsnorm")
    out_p, (dx_p, dw_p) = grads(lambda a, b: norm_ref.rms_norm(a, b, eps), [x, w], g)
    out_t, (dx_t, dw_t) = grads(lambda a, b: norm_truth(a, b, eps), [x.double(), w.double()], g.double())
    assert_no_worse("out", out, out_p, out_t, dtype)
    assert_no_worse("dx", dx, dx_p, dx_t, dtype)
    assert_no_worse("dweight", dw, dw_p, dw_t, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_fp32_weight_with_low_precision_input(dtype):
    """The autocast case: fp32 weight, x in the compute dtype; output in x's dtype, dweight in fp32."""
    x, g, w = (
        rand((4, 33, 2048), dtype, 2.0),
        rand((4, 33, 2048), dtype, seed=1),
        1 + rand((2048,), torch.float32),
    )
    out, (dx, dw) = grads(lambda a, b: rms_norm(a, b, 1e-6), [x, w], g)
    out_p, (dx_p, dw_p) = grads(lambda a, b: norm_ref.rms_norm(a, b, 1e-6), [x, w], g)
    # truth: the weight rounded to x's dtype, as the model does
    out_t, (dx_t, dw_t) = grads(
        lambda a, b: norm_truth(a, b.to(dtype).double(), 1e-6), [x.double(), w.double()], g.double()
    )
    assert out.dtype == dtype and dx.dtype == dtype and dw.dtype == torch.float32
    assert_no_worse("out", out, out_p, out_t, dtype)
    assert_no_worse("dx", dx, dx_p, dx_t, dtype)
    assert_no_worse("dweight", dw, dw_p, dw_t, dtype)


# ---- RoPE -------------------------------------------------------------------------------------------

ROPE_CASES = [
    ((1, 1, 1, 64), False),
    ((1, 4095, 8, 128), False),
    ((1, 4095, 8, 128), True),
    ((3, 7, 32, 128), True),
    ((2, 257, 5, 80), True),
    ((2, 128, 128, 128), False),
    ((4, 100, 3, 256), True),
    ((2, 64, 6, 96), False),
]
TABLE_LEN = 4096


def rope_truth(x, table, positions):
    seq = x.shape[1]
    cos, sin = (
        (table[0, :seq][None, :, None], table[1, :seq][None, :, None])
        if positions is None
        else (table[0][positions][:, :, None], table[1][positions][:, :, None])
    )
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.double() + torch.cat([-x2, x1], dim=-1) * sin.double()


def packed_positions(bsz, seq, seed=0):
    """Per-document positions of packed sequences: restarts at random document boundaries."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(bsz):
        row, n = [], 0
        while n < seq:
            doc = int(torch.randint(1, max(2, seq // 2), (1,), generator=g))
            row.append(torch.arange(min(doc, seq - n)))
            n += doc
        rows.append(torch.cat(row))
    return torch.stack(rows).to(CUDA)  # (B, S) int64


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,with_positions", ROPE_CASES, ids=str)
def test_rope_matches_fp64(shape, with_positions, dtype):
    bsz, seq, _, head_dim = shape
    table = rope_table(head_dim, TABLE_LEN, 500000.0, RopeScaling(factor=8.0), device=CUDA)  # (2, L, D) fp32
    positions = packed_positions(bsz, seq) if with_positions else None
    if with_positions and seq > 64:  # also positions far into the table
        positions[0, -1] = TABLE_LEN - 1
    x, g = rand(shape, dtype, 2.0), rand(shape, dtype, seed=1)
    out, (dx,) = grads(lambda t: apply_rope(t, table, positions), [x], g)
    went_through_triton("rope")
    out_p, (dx_p,) = grads(lambda t: rope_ref.apply_rope(t, table, positions), [x], g)
    out_t, (dx_t,) = grads(lambda t: rope_truth(t, table, positions), [x.double()], g.double())
    assert_no_worse("out", out, out_p, out_t, dtype)
    assert_no_worse("dx", dx, dx_p, dx_t, dtype)


def test_rope_int32_positions_and_non_contiguous_input():
    table = rope_table(128, 512, 10000.0, None, device=CUDA)
    positions = packed_positions(2, 300)
    qkv = rand((2, 300, 3 * 4 * 128), torch.bfloat16).view(2, 300, 12, 128)
    q = qkv[:, :, :4]  # (B, S, 4, D), not contiguous
    want = rope_ref.apply_rope(q, table, positions)
    torch.testing.assert_close(apply_rope(q, table, positions.int()), want, rtol=1e-2, atol=1e-2)


# ---- SwiGLU -----------------------------------------------------------------------------------------

SWIGLU_SHAPES = [(1, 1, 4095), (3, 7, 2048), (2, 5, 8192), (1, 3, 16384), (2, 128, 14336), (5,), (0, 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=str)
def test_swiglu_matches_fp64(shape, dtype):
    a, b, g = rand(shape, dtype, 3.0), rand(shape, dtype, seed=1), rand(shape, dtype, seed=2)
    out, (da, db) = grads(swiglu, [a, b], g)
    went_through_triton("swiglu")
    out_p, (da_p, db_p) = grads(swiglu_ref.swiglu, [a, b], g)
    out_t, (da_t, db_t) = grads(lambda p, q: F.silu(p) * q, [a.double(), b.double()], g.double())
    assert_no_worse("out", out, out_p, out_t, dtype)
    assert_no_worse("da", da, da_p, da_t, dtype)
    assert_no_worse("db", db, db_p, db_t, dtype)


# ---- launchers refuse bad input; torch.compile traces every op ------------------------------------


def test_launchers_raise_value_errors():
    from loom.kernels.rmsnorm import triton as norm_k
    from loom.kernels.rope import triton as rope_k
    from loom.kernels.swiglu import triton as swiglu_k

    x, w = rand((4, 64), torch.bfloat16), rand((64,), torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        norm_k.rms_norm_forward(rand((64, 4), torch.bfloat16).t(), w, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        norm_k.rms_norm_forward(x, w.cpu(), 1e-5)
    with pytest.raises(ValueError, match="last dim"):
        norm_k.rms_norm_forward(
            rand((2, norm_k.MAX_N + 1), torch.bfloat16), rand((norm_k.MAX_N + 1,), torch.bfloat16), 1e-5
        )
    table = rope_table(64, 16, 10000.0, None, device=CUDA)
    with pytest.raises(ValueError, match="sequence length"):
        rope_k.apply_rope_forward(rand((1, 32, 2, 64), torch.bfloat16), table, None)
    with pytest.raises(ValueError, match="positions"):
        rope_k.apply_rope_forward(rand((1, 8, 2, 64), torch.bfloat16), table, torch.zeros(1, 8, device=CUDA))
    with pytest.raises(ValueError, match="b"):
        swiglu_k.swiglu_forward(x, x.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_compile_fullgraph_runs_every_op(dtype):
    """fp32: compiled == eager tightly (the ops trace right); bf16: Inductor keeps the elementwise glue
    (x * 2, h + 1) in fp32 where eager rounds to bf16, so only the loss is compared, loosely."""
    x, w = rand((2, 16, 256), dtype), 1 + rand((256,), dtype, 0.1)
    table = rope_table(64, 32, 10000.0, None, device=CUDA)
    positions = packed_positions(2, 16)

    def f(x, w):
        h = rms_norm(x * 2, w, 1e-5)  # (B, S, E)
        q = apply_rope(h.view(2, 16, 4, 64), table, positions).view(2, 16, 256)
        q = q + apply_rope(h.view(2, 16, 4, 64), table, None).view(2, 16, 256)
        return swiglu(q, h + 1).float().square().sum()

    def value_and_grads(fn):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(xr, wr)
        return [loss, *torch.autograd.grad(loss, (xr, wr))]

    compiled = torch.compile(f, fullgraph=True)
    got, expected = value_and_grads(compiled), value_and_grads(f)
    if dtype == torch.float32:
        for have, want in zip(got, expected):
            torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(got[0], expected[0], rtol=2e-2, atol=0)
        assert all(torch.isfinite(g).all() for g in got[1:])


# ---- the model with the fused flags on CUDA -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_with_fused_flags_matches_unfused_on_cuda(dtype):
    from loom.models.common.init import materialize
    from loom.models.llama import FLAVORS, Llama

    def build(**flags):
        args = FLAVORS["debug"].with_(vocab_size=512, max_seq_len=128, **flags)
        with torch.device("meta"):
            model = Llama(args)
        materialize(model, CUDA, 0, model.param_std, model.init_buffers)
        return model

    plain, fused = build(), build(fused_norm=True, fused_rope=True, fused_swiglu=True)
    fused.load_state_dict(plain.state_dict())
    tokens = torch.randint(
        0, 512, (4, 129), device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(0)
    )
    positions = packed_positions(4, 128)
    losses = []
    for model in (plain, fused):
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            logits = model(tokens[:, :-1], positions)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert abs(losses[1] - losses[0]) <= tol * losses[0]
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        scale = p.grad.abs().max().item()
        assert (q.grad - p.grad).abs().max().item() <= 10 * tol * scale + 1e-8, name

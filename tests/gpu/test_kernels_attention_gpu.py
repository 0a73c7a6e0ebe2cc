"""Triton FlashAttention on CUDA against an fp32 reference: outputs and gradients for many shapes
(odd lengths, GQA 1/4/8, head dims 64/128, packed documents with boundaries anywhere and padding rows,
sliding windows), bf16 and fp16. Our error must be <= 2x PyTorch's SDPA error in the same dtype (+ atol)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.attention_cases import random_docs, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


CASES = [  # (B, Hq, Hkv, S, D, causal, docs, window)
    (2, 4, 4, 128, 64, True, False, 0),
    (1, 8, 2, 1000, 64, True, False, 0),
    (2, 8, 1, 333, 128, True, False, 0),
    (1, 16, 2, 2048, 128, True, False, 0),
    (2, 4, 1, 517, 64, False, False, 0),
    (1, 8, 8, 1531, 128, True, True, 0),
    (2, 8, 2, 777, 64, True, True, 0),
    (1, 4, 4, 640, 128, False, True, 0),
    (1, 8, 2, 1100, 64, True, False, 200),
    (1, 4, 1, 901, 128, False, True, 129),
    (1, 4, 4, 1000, 128, True, False, 0),  # MHA without documents: on Hopper, dK/dV from the Gluon kernel
    (2, 2, 2, 333, 64, False, False, 0),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_flash_attention_matches_reference(case, dtype, two_configs_per_kernel):
    from loom.kernels.attention import reference as R
    from loom.kernels.attention.op import flash_attention

    b, hq, hk, s, d, causal, docs, window = case
    gen = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(b, h, s, d, generator=gen).cuda() for h in (hq, hk, hk))
    bounds = R.document_bounds(random_docs(b, s, gen).cuda()) if docs else None
    dout = torch.randn(b, hq, s, d, generator=gen).cuda()
    scale = d**-0.5
    ref_o, ref_lse = R.attention_forward(q, k, v, causal, bounds, window, scale)
    ref_g = R.attention_backward(dout, q, k, v, ref_o, ref_lse, None, causal, bounds, window, scale)
    rows = torch.isfinite(ref_lse)  # (B, Hq, S): queries that see some key

    x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*x, causal=causal, bounds=bounds, window=window, return_lse=True)
    out.backward(dout.to(dtype))
    assert not out.isnan().any() and all(not t.grad.isnan().any() for t in x)
    assert torch.equal(torch.isinf(lse), ~rows)
    assert torch.all(out[~rows] == 0)

    # the baseline: PyTorch SDPA in the same dtype, explicit mask (fully masked rows excluded from its error)
    y = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    mask = R.visible(s, causal, bounds, window, q.device)
    mask = mask | ~rows[..., None].any(1, keepdim=True)  # SDPA gives NaN on empty rows: let them see all
    base = F.scaled_dot_product_attention(*y, attn_mask=mask, enable_gqa=hq != hk, scale=scale)
    base.backward(torch.where(rows[..., None], dout, 0).to(dtype))
    o_rows = rows[..., None].expand_as(ref_o)
    assert rel_err(out, ref_o, o_rows) <= 2 * rel_err(base, ref_o, o_rows) + 2e-3
    torch.testing.assert_close(lse[rows], ref_lse[rows], atol=2e-2, rtol=0)
    for name, mine, theirs, ref in zip("qkv", [t.grad for t in x], [t.grad for t in y], ref_g):
        everything = torch.ones_like(ref, dtype=torch.bool)
        assert rel_err(mine, ref, everything) <= 2 * rel_err(theirs, ref, everything) + 5e-3, name


def test_flash_attention_compiles_fullgraph():
    from loom.kernels.attention.op import flash_attention

    q, k, v = (
        torch.randn(2, h, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2)
    )
    f = torch.compile(lambda a, b, c: flash_attention(a, b, c).float().square().sum(), fullgraph=True)
    f(q, k, v).backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    flash_attention(q, k, v).float().square().sum().backward()
    for a, b in zip(eager, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b)


FLEX_CASES = [
    (1, 8, 2, 1000, 64, True, False, 0),
    (1, 8, 8, 1531, 128, True, True, 0),
    (2, 8, 2, 777, 64, True, True, 0),
]


@pytest.mark.parametrize("case", FLEX_CASES, ids=lambda c: "x".join(map(str, c)))
def test_flex_backend_matches_reference(case):
    """``model.attention = flex``: FlexAttention (compiled) through loom's block mask, bf16, within the same bar
    as our kernel: <= 2x SDPA's error against the fp32 reference."""
    from loom.kernels.attention import reference as R
    from loom.kernels.attention.flex import flex_attend

    b, hq, hk, s, d, _, docs, _ = case
    gen = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(b, h, s, d, generator=gen).cuda() for h in (hq, hk, hk))
    bounds = R.document_bounds(random_docs(b, s, gen).cuda()) if docs else None
    dout = torch.randn(b, hq, s, d, generator=gen).cuda()
    ref_o, ref_lse = R.attention_forward(q, k, v, True, bounds, 0, d**-0.5)
    rows = torch.isfinite(ref_lse)  # (B, Hq, S): queries that see some key
    dout = torch.where(rows[..., None], dout, 0)
    ref_g = R.attention_backward(dout, q, k, v, ref_o, ref_lse, None, True, bounds, 0, d**-0.5)
    x = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    out = flex_attend(*x, None if bounds is None else bounds[0])
    out.backward(dout.to(torch.bfloat16))
    assert not out.isnan().any() and all(not t.grad.isnan().any() for t in x)
    y = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    mask = R.visible(s, True, bounds, 0, q.device) | ~rows[..., None].any(1, keepdim=True)
    base = F.scaled_dot_product_attention(*y, attn_mask=mask, enable_gqa=hq != hk)
    base.backward(dout.to(torch.bfloat16))
    o_rows = rows[..., None].expand_as(ref_o)
    assert rel_err(out, ref_o, o_rows) <= 2 * rel_err(base, ref_o, o_rows) + 2e-3
    for name, mine, theirs, ref in zip("qkv", [t.grad for t in x], [t.grad for t in y], ref_g):
        everything = torch.ones_like(ref, dtype=torch.bool)
        assert rel_err(mine, ref, everything) <= 2 * rel_err(theirs, ref, everything) + 5e-3, name

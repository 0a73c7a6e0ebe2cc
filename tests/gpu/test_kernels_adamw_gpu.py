"""loom's AdamW Triton kernel on CUDA against the reference and against PyTorch's fused AdamW; skipped
without CUDA. fp32 math on both sides: agreement to a few fp32 ulps per step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loom.kernels.adamw import reference
from loom.kernels.adamw.op import adamw_multi_step_, adamw_step_
from loom.train.optimizer import TritonAdamW

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
HYPER = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("shape", [(1,), (4095,), (4097,), (128256, 33), (2048, 8192)])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_factor", [False, True])
def test_kernel_matches_reference(shape, grad_dtype, with_factor):
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(shape, device="cuda", generator=gen)
    have = [p.clone(), torch.zeros_like(p), torch.zeros_like(p)]
    want = [p.clone(), torch.zeros_like(p), torch.zeros_like(p)]
    factor = torch.tensor([0.37], device="cuda") if with_factor else None
    for step in range(1, 4):
        g = (torch.randn(shape, device="cuda", generator=gen) * 1e-2).to(grad_dtype)
        adamw_step_(have[0], g, have[1], have[2], step=step, grad_factor=factor, **HYPER)
        reference.adamw_step_(want[0], g, want[1], want[2], factor, step=step, **HYPER)
    for a, b in zip(have, want):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    assert torch.isfinite(have[0]).all()


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_multi_tensor_kernel_matches_reference(grad_dtype):
    """Many tensors in one launch (what TritonAdamW does with its tensors under SMALL elements), each as the
    reference steps it, with and without a clip factor."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1,), (4095,), (4097,), (768, 768), (2048, 768), (3, 5, 48)]
    for factor in (None, torch.tensor([0.37], device="cuda")):
        ps = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
        have = [ps, [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]]
        want = [[t.clone() for t in ts] for ts in have]
        for step in range(1, 4):
            gs = [(torch.randn(s, device="cuda", generator=gen) * 1e-2).to(grad_dtype) for s in shapes]
            adamw_multi_step_(have[0], gs, have[1], have[2], step=step, grad_factor=factor, **HYPER)
            for p, g, m, v in zip(want[0], gs, want[1], want[2]):
                reference.adamw_step_(p, g, m, v, factor, step=step, **HYPER)
        for ours, theirs in zip(have, want):
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


def test_optimizer_matches_torch_fused_adamw():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(1000, 64), nn.Linear(64, 256), nn.LayerNorm(256), nn.Linear(256, 1000)
    ).cuda()
    ref = [p.detach().clone().requires_grad_() for p in model.parameters()]
    ours = TritonAdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    theirs = torch.optim.AdamW(ref, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    for _ in range(5):
        grads = [torch.randn_like(p) * 1e-2 for p in ref]
        for p, q, g in zip(model.parameters(), ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for p, q in zip(model.parameters(), ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(4097,), (2048, 8192)])
@pytest.mark.parametrize("factor", [0.37, float("nan")])
def test_kernel_writes_the_amax_of_the_stepped_parameter(shape, factor):
    """``amax``: the largest |param| after the step (the unchanged one's where a non-finite factor skips it), the
    same float as the reference's max over the kernel's own output, raised above what it held."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(shape, device="cuda", generator=gen)
    g = torch.randn(shape, device="cuda", generator=gen) * 1e-2
    amax = torch.full((1,), 1e-3, device="cuda")
    f = torch.tensor([factor], device="cuda")
    adamw_step_(p, g, torch.zeros_like(p), torch.zeros_like(p), step=1, grad_factor=f, amax=amax, **HYPER)
    assert torch.equal(amax, p.abs().max().reshape(1))

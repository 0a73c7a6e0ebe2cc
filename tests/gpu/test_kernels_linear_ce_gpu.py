"""Fused linear + cross-entropy on CUDA (Triton CE kernel + cuBLAS): accuracy against an fp64
reference relative to the unfused path's own error, peak memory against the unfused path, and
torch.compile of a caller. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from loom.kernels.linear_ce import linear_cross_entropy, linear_cross_entropy_unfused
from loom.kernels.linear_ce.reference import ce_rows_torch_
from loom.models.common.init import materialize
from loom.models.llama import FLAVORS, Llama
from loom.numerics import IGNORE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def inputs(n, e, v, dtype, seed=0, ignore_every=7):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, e, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, e, device="cuda", generator=g) * e**-0.5).to(dtype)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[::ignore_every] = IGNORE
    labels[1] = v - 1  # the last column (a partial V-block)
    return h, w, labels


def loss_and_grads(fn, h, w, labels):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, labels)
    loss.backward()
    return loss.detach().double(), h.grad.double(), w.grad.double()


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n,e,v", [(1023, 256, 128256), (517, 128, 32003)], ids=["llama3_vocab", "odd_vocab"])
def test_accuracy_vs_fp64_within_twice_the_unfused_error(dtype, n, e, v):
    h, w, labels = inputs(n, e, v, dtype)
    truth = loss_and_grads(linear_cross_entropy_unfused, h.double(), w.double(), labels)
    unfused = loss_and_grads(linear_cross_entropy_unfused, h, w, labels)
    for chunk in (None, 100):  # the default (one chunk here) and several chunks, the last partial
        fused = loss_and_grads(
            lambda a, b, c: linear_cross_entropy(a, b, c, chunk_tokens=chunk), h, w, labels
        )
        atol = 1e-3 if dtype == torch.bfloat16 else 1e-6
        for name, f, u, t in zip(("loss", "grad_h", "grad_w"), fused, unfused, truth):
            assert torch.isfinite(f).all(), name
            assert rel_err(f, t) <= 2 * rel_err(u, t) + atol, (name, chunk, rel_err(f, t), rel_err(u, t))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_rows_kernel_matches_torch(dtype):
    from loom.kernels.linear_ce.triton import ce_rows_triton_

    g = torch.Generator(device="cuda").manual_seed(0)
    n, v = 33, 50257
    x = (torch.randn(n, v, device="cuda", generator=g) * 3).to(dtype)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[3] = IGNORE
    want, want_loss = x.clone(), torch.empty(n, device="cuda")
    ce_rows_torch_(want, labels, want_loss, True)
    got, loss = x.clone(), torch.empty(n, device="cuda")
    ce_rows_triton_(got, labels, loss, True)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        got.float(), want.float(), rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-5
    )
    assert got[3].abs().max() == 0


def test_all_ignored_on_cuda():
    h, w, labels = inputs(64, 64, 1000, torch.bfloat16)
    labels.fill_(IGNORE)
    loss, gh, gw = loss_and_grads(linear_cross_entropy, h, w, labels)
    assert loss.item() == 0 and gh.abs().max() == 0 and gw.abs().max() == 0


def extra_peak_bytes(fn, h, w, labels) -> int:
    """Peak memory of forward + backward above what was allocated before (inputs, nothing else)."""
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(h, w, labels).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_peak_memory_at_least_4x_below_unfused():
    h, w, labels = inputs(8192, 2048, 128256, torch.bfloat16)
    fused = extra_peak_bytes(linear_cross_entropy, h, w, labels)
    unfused = extra_peak_bytes(linear_cross_entropy_unfused, h, w, labels)
    assert 4 * fused <= unfused, (fused / 2**20, unfused / 2**20)


def test_torch_compile_of_a_caller():
    h, w, labels = inputs(300, 64, 5003, torch.bfloat16)

    @torch.compile(fullgraph=True)
    def loss_fn(a, b, c):
        return linear_cross_entropy(a * 1.5, b, c, chunk_tokens=128) / 2

    compiled = loss_and_grads(loss_fn, h, w, labels)
    eager = loss_and_grads(
        lambda a, b, c: linear_cross_entropy(a * 1.5, b, c, chunk_tokens=128) / 2, h, w, labels
    )
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, rtol=1e-3, atol=1e-3)


def test_autocast_bf16_with_fp32_weights():
    h, w, labels = inputs(513, 128, 32003, torch.float32)

    def under_autocast(fn):
        def run(a, b, c):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return fn(a, b, c)

        return run

    truth = loss_and_grads(linear_cross_entropy_unfused, h.double(), w.double(), labels)
    unfused = loss_and_grads(under_autocast(linear_cross_entropy_unfused), h, w, labels)
    fused = loss_and_grads(under_autocast(linear_cross_entropy), h, w, labels)
    for f, u, t in zip(fused, unfused, truth):
        assert rel_err(f, t) <= 2 * rel_err(u, t) + 1e-3


@pytest.mark.parametrize("tie", [True, False])
def test_model_fused_loss_on_cuda(tie):
    args = FLAVORS["debug"].with_(vocab_size=1024, tie_embeddings=tie, max_seq_len=64)
    tokens = torch.randint(0, 1024, (2, 64), device="cuda")
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = IGNORE
    out = []
    for fused in (False, True):
        with torch.device("meta"):
            model = Llama(args.with_(fused_loss=fused))
        materialize(model, torch.device("cuda"), 0, model.param_std, model.init_buffers)
        loss = model(tokens, labels=labels)
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-5, atol=1e-4)
    for name, g in out[0][1].items():
        torch.testing.assert_close(out[1][1][name], g, rtol=1e-4, atol=1e-5, msg=name)

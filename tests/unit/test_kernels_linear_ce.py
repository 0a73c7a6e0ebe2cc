"""Fused linear + cross-entropy (loom.kernels.linear_ce) on CPU: the chunked algorithm against the
unfused definition, the custom op (opcheck, autograd, autocast), tied embeddings in the model, and
the Triton kernel under the CPU interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from loom.kernels.linear_ce import default_chunk_tokens, linear_cross_entropy, linear_cross_entropy_unfused
from loom.kernels.linear_ce.reference import chunked_linear_cross_entropy
from loom.kernels.triton_support import has_triton
from loom.models.common.init import materialize
from loom.models.llama import FLAVORS, Llama
from loom.numerics import IGNORE

N, E, V = 37, 16, 101


def inputs(n=N, e=E, v=V, dtype=torch.float32, seed=0, ignore_every=5):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, e, generator=g).to(dtype)
    w = (torch.randn(v, e, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        labels[::ignore_every] = IGNORE
    return h, w, labels


def unfused_with_grads(h, w, labels):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = linear_cross_entropy_unfused(h, w, labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 5, 16, N, 64])
def test_chunked_reference_matches_definition(chunk):
    h, w, labels = inputs(dtype=torch.float64)
    ref_loss, ref_gh, ref_gw = unfused_with_grads(h, w, labels)
    loss, gh, gw = chunked_linear_cross_entropy(h, w, labels, chunk)
    assert loss.dtype == torch.float32 and gh.dtype == gw.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss.float(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-6, atol=1e-6)  # fp32 softmax, so not fp64-exact
    torch.testing.assert_close(gw, ref_gw, rtol=1e-6, atol=1e-6)
    assert gh[::5].abs().max() == 0  # ignored rows get no gradient


def test_chunked_reference_fp32_and_bf16():
    h, w, labels = inputs()
    ref = unfused_with_grads(h, w, labels)
    for got, want in zip(chunked_linear_cross_entropy(h, w, labels, 8), ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    hb, wb = h.bfloat16(), w.bfloat16()  # same math as the unfused bf16 path: bf16 logits, fp32 softmax
    ref = unfused_with_grads(hb, wb, labels)
    loss, gh, gw = chunked_linear_cross_entropy(hb, wb, labels, 8)
    assert gh.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gh, ref[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw, ref[2], rtol=2e-2, atol=2e-2)


def test_all_rows_ignored_gives_zero_loss_and_grads():
    h, w, _ = inputs()
    labels = torch.full((N,), IGNORE)
    loss, gh, gw = chunked_linear_cross_entropy(h, w, labels, 7)
    assert loss.item() == 0 and gh.abs().max() == 0 and gw.abs().max() == 0
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(hh, ww, labels, chunk_tokens=7)
    loss.backward()
    assert loss.item() == 0 and hh.grad.abs().max() == 0 and ww.grad.abs().max() == 0
    assert torch.isfinite(hh.grad).all() and torch.isfinite(ww.grad).all()


def test_default_chunk_tokens_budget():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert default_chunk_tokens(128256, 2048, bf16, with_grads=False) == 1024  # 250 MiB
    assert default_chunk_tokens(128256, 2048, fp32, with_grads=False) == 512
    assert default_chunk_tokens(128256, 2048, bf16) == 2048  # as large as grad_weight, which is held anyway
    assert default_chunk_tokens(128256, 4096, bf16) == 4096
    assert default_chunk_tokens(128256, 4096, fp32) == 512  # fp32: no accumulator besides grad_weight
    assert default_chunk_tokens(128256, 64, bf16) == 1024  # small weights: the 256 MiB budget
    assert default_chunk_tokens(1000, 16, fp32) * 1000 * 4 <= 256 * 2**20
    assert default_chunk_tokens(10**9, 16, fp32) == 1  # at least one row


def test_opcheck():
    h, w, labels = inputs(n=9, e=8, v=33, ignore_every=4)
    op = torch.ops.loom.linear_cross_entropy
    torch.library.opcheck(op, (h.requires_grad_(), w.requires_grad_(), labels, 4, True, True))
    torch.library.opcheck(op, (h, w.detach(), labels, 4, True, False))
    torch.library.opcheck(op, (h.detach(), w.detach(), labels, 4, False, False))
    # an fp32 weight with 16-bit h, as autocast passes them: the fake's dtypes are the real ones'
    hb = h.detach().bfloat16()
    torch.library.opcheck(op, (hb.requires_grad_(), w.detach().requires_grad_(), labels, 4, True, True))
    torch.library.opcheck(op, (hb.detach(), w.detach(), labels, 4, False, False))


def test_a_frozen_weight_takes_no_weight_gradient():
    """A frozen head (LoRA): h's gradient as before, no grad_weight computed or returned."""
    h, w, labels = inputs()
    _, ref_gh, _ = unfused_with_grads(h, w, labels)
    hh = h.clone().requires_grad_()
    loss, gh, gw = chunked_linear_cross_entropy(hh.detach(), w, labels, 10, weight_grad=False)
    assert gw.numel() == 0
    torch.testing.assert_close(gh, ref_gh, rtol=1e-5, atol=1e-5)
    linear_cross_entropy(hh, w, labels, chunk_tokens=10).backward()
    torch.testing.assert_close(hh.grad, ref_gh, rtol=1e-5, atol=1e-5)


def test_public_function_autograd_leading_dims_and_no_grad():
    h, w, labels = inputs()
    ref_loss, ref_gh, ref_gw = unfused_with_grads(h, w, labels)
    h3 = h.reshape(1, N, E).clone().requires_grad_()  # (B, S, E) as the model passes it
    ww = w.clone().requires_grad_()
    loss = linear_cross_entropy(h3, ww, labels.reshape(1, N), chunk_tokens=10)
    (3.0 * loss).backward()  # the saved gradients are scaled by the incoming scalar
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(h3.grad.reshape(N, E), 3 * ref_gh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ww.grad, 3 * ref_gw, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # validation: no gradients computed
        torch.testing.assert_close(
            linear_cross_entropy(h3, ww, labels.reshape(1, N)), ref_loss, rtol=1e-6, atol=1e-5
        )


def test_argument_errors():
    h, w, labels = inputs()
    with pytest.raises(ValueError, match="dtype"):
        linear_cross_entropy(h, w.double(), labels)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, labels[:-1])
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, w[:, :-1], labels)
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy(h, w, labels, chunk_tokens=0)


def test_autocast_bf16_matches_unfused_autocast():
    """Under autocast h is cast to bf16 and the op casts the weight (as F.linear would); an fp32 weight gets
    its gradient in fp32 from the op's own backward."""
    h, w, labels = inputs()
    grads = []
    for fn in (
        lambda a, b: linear_cross_entropy(a, b, labels, chunk_tokens=8),
        lambda a, b: linear_cross_entropy_unfused(a, b, labels),
    ):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(a, b)
        loss.backward()
        assert loss.dtype == torch.float32 and a.grad.dtype == b.grad.dtype == torch.float32
        grads.append((loss.detach(), a.grad, b.grad))
    (fl, fh, fw), (ul, uh, uw) = grads
    torch.testing.assert_close(fl, ul, rtol=1e-5, atol=1e-4)  # same bf16 logits, same fp32 softmax
    torch.testing.assert_close(fh, uh, rtol=2e-2, atol=1e-2)  # bf16 rounding of the products
    torch.testing.assert_close(fw, uw, rtol=2e-2, atol=1e-2)
    # the fp32 weight reaches the op itself (cast inside it), so its fp32 gradient comes from the op's backward, not
    # through a ToCopyBackward node after a bf16 product
    b = w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, b, labels, chunk_tokens=8)
    op_node = loss.grad_fn
    while "linear_cross_entropy" not in type(op_node).__name__:
        op_node = op_node.next_functions[0][0]
    assert "AccumulateGrad" in type(op_node.next_functions[1][0]).__name__


def tiny_llama(tie: bool, fused: bool) -> Llama:
    args = FLAVORS["debug"].with_(vocab_size=256, tie_embeddings=tie, max_seq_len=32, fused_loss=fused)
    with torch.device("meta"):
        model = Llama(args)
    materialize(model, torch.device("cpu"), 0, model.param_std, model.init_buffers)
    return model


@pytest.mark.parametrize("tie", [True, False])
def test_model_fused_loss_matches_unfused_for_every_parameter(tie):
    """With tied embeddings the shared weight's gradient is the sum of the embedding's and the fused
    loss's: autograd adds them, as for the unfused output layer."""
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = IGNORE
    results = []
    for fused in (False, True):
        model = tiny_llama(tie, fused)
        loss = model(tokens, labels=labels)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ul, ug), (fl, fg) = results
    torch.testing.assert_close(fl, ul, rtol=1e-6, atol=1e-5)
    assert ug.keys() == fg.keys() and ("output.weight" in ug) != tie
    for name in ug:
        torch.testing.assert_close(fg[name], ug[name], rtol=1e-5, atol=1e-6, msg=name)
    model = tiny_llama(tie, True)
    assert model(tokens).shape == (2, 16, 256)  # without labels: logits, as before


INTERPRETER_SCRIPT = textwrap.dedent("""
    import torch
    from loom.numerics import IGNORE
    from loom.kernels.linear_ce import linear_cross_entropy, linear_cross_entropy_unfused
    from loom.kernels.linear_ce.reference import ce_rows_torch_
    from loom.kernels.linear_ce.triton import ce_rows_triton_
    from loom.kernels.triton_support import triton_runs_on
    assert triton_runs_on(torch.device("cpu"))

    g = torch.Generator().manual_seed(0)
    n, v = 7, 300
    x = torch.randn(n, v, generator=g) * 4
    labels = torch.randint(0, v, (n,), generator=g)
    labels[0], labels[2], labels[5] = v - 1, IGNORE, 0
    want, want_loss = x.clone(), torch.empty(n)
    ce_rows_torch_(want, labels, want_loss, True)
    for block in (64, 128, 512):  # several V-blocks with a partial last one, and a single block
        got, loss = x.clone(), torch.empty(n)
        ce_rows_triton_(got, labels, loss, True, block_v=block)
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        got = x.clone()
        ce_rows_triton_(got, labels, loss, False, block_v=block)
        assert torch.equal(got, x)  # no gradient pass: logits untouched
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-5)

    for bad, match in ((lambda: ce_rows_triton_(x[:, ::2], labels, torch.empty(n), True), "contiguous"),
                       (lambda: ce_rows_triton_(x.double(), labels, torch.empty(n), True), "dtype"),
                       (lambda: ce_rows_triton_(x, labels.int(), torch.empty(n), True), "labels"),
                       (lambda: ce_rows_triton_(x, labels[:3], torch.empty(n), True), "rows")):
        try:
            bad()
        except ValueError as e:
            assert match in str(e), e
        else:
            raise AssertionError("no ValueError for " + match)

    h = torch.randn(11, 8, generator=g).requires_grad_()
    w = torch.randn(v, 8, generator=g).requires_grad_()
    lab = torch.randint(0, v, (11,), generator=g)
    lab[4] = IGNORE
    loss = linear_cross_entropy(h, w, lab, chunk_tokens=4)  # the op's Triton path
    loss.backward()
    h2, w2 = h.detach().requires_grad_(), w.detach().requires_grad_()
    ref = linear_cross_entropy_unfused(h2, w2, lab)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)
    print("INTERPRETER OK")
""")


def _triton_version() -> tuple[int, ...]:
    import triton

    return tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())


@pytest.mark.skipif(not has_triton(), reason="triton not installed")
def test_triton_kernel_under_interpreter():
    """fp32 only: the interpreter's bf16 arithmetic is not the GPU's."""
    if _triton_version() < (3, 8):
        pytest.skip(f"the Triton CPU interpreter before 3.8 is not trusted here (have {_triton_version()})")
    env = dict(os.environ, TRITON_INTERPRET="1")  # must be set before triton is imported
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETER_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "INTERPRETER OK" in proc.stdout, proc.stderr[-3000:]

"""Attention kernels on CPU: the reference (masks, log-sum-exp, gradient formulas), the custom op
(opcheck, autograd), model dispatch, and the Triton kernels in Triton's CPU interpreter (fp32)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from loom.kernels.attention import reference as R
from loom.kernels.attention.op import flash_attention, flash_attn_backward_op, flash_attn_op


def qkv(b=2, hq=4, hk=2, s=24, d=16, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, s, d, generator=g, dtype=dtype).requires_grad_(grad) for h in (hq, hk, hk)]


def test_document_bounds_runs_and_padding():
    ids = torch.tensor([[0, 0, 1, 1, 1, -1, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5]])
    b = R.document_bounds(ids)
    assert b[0, 0].tolist() == [0, 0, 2, 2, 2, 8, 6, 6] and b[1, 0].tolist() == [1, 1, 4, 4, 4, -1, 7, 7]
    assert b[0, 1].tolist() == [0] * 8 and b[1, 1].tolist() == [7] * 8
    assert torch.equal(R.document_starts(ids), b[0]) and R.document_starts(ids).dtype == torch.int32


def test_doc_ids_from_positions_and_cu_seqlens():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert R.doc_ids_from_positions(pos).tolist() == [[1, 1, 1, 2, 2, 3]]
    ids = R.doc_ids_from_cu_seqlens(torch.tensor([0, 3, 5]), 7)
    assert ids.tolist() == [[0, 0, 0, 1, 1, -1, -1]]


@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (8, 1)])
def test_reference_matches_sdpa_causal_gqa(hq, hk):
    q, k, v = qkv(hq=hq, hk=hk)
    out, lse = R.attention_forward(q, k, v, True, None, 0, 0.25)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hk, scale=0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    kk = k.repeat_interleave(hq // hk, 1)
    s = (q @ kk.transpose(-1, -2)) * 0.25 + torch.full((24, 24), float("-inf")).triu(1)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))


def test_document_mask_is_block_diagonal_and_window_limits_distance():
    ids = torch.tensor([[0] * 5 + [1] * 9 + [2] * 10] * 2)
    b = R.document_bounds(ids)
    m = R.visible(24, True, b, 0, "cpu")[0, 0]
    same = ids[0][:, None] == ids[0][None, :]
    assert torch.equal(m, same & torch.ones(24, 24, dtype=torch.bool).tril())
    w = R.visible(24, False, None, 3, "cpu")[0, 0]
    i = torch.arange(24)
    assert torch.equal(w, (i[:, None] - i[None, :]).abs() < 3)


@pytest.mark.parametrize("case", ["causal", "docs", "window", "full_docs_window"])
def test_reference_gradients_match_autograd(case):
    ids = torch.tensor([[0] * 7 + [1] * 10 + [-1] * 2 + [3] * 5, [4] * 24])
    causal, bounds, window = {
        "causal": (True, None, 0),
        "docs": (True, R.document_bounds(ids), 0),
        "window": (True, None, 5),
        "full_docs_window": (False, R.document_bounds(ids), 4),
    }[case]
    q, k, v = qkv(dtype=torch.float64, grad=True)
    # plain autograd through a masked softmax (padding rows give exactly zero output)
    mask = R.visible(24, causal, bounds, window, "cpu")
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = p @ v.repeat_interleave(2, 1)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    dlse = torch.where(torch.isinf(lse), 0.0, dlse)
    grads = torch.autograd.grad(
        (out * dout).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * dlse).sum(), (q, k, v)
    )
    o2, lse2 = R.attention_forward(q, k, v, causal, bounds, window, 0.3)
    torch.testing.assert_close(o2, out)
    mine = R.attention_backward(dout, q, k, v, o2, lse2, dlse, causal, bounds, window, 0.3)
    for a, b in zip(mine, grads):
        torch.testing.assert_close(a, b)


def test_padding_rows_give_zero_and_finite_gradients():
    ids = torch.tensor([[0, 0, 0, -1, -1, 1, 1, 1]])
    q, k, v = (t[:1, :, :8] for t in qkv(grad=False))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention(q, k, v, doc_ids=ids, return_lse=True)
    assert torch.all(out[:, :, 3:5] == 0) and torch.all(torch.isneginf(lse[:, :, 3:5]))
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_op_passes_opcheck():
    q, k, v = qkv(grad=True)
    ids = torch.sort(torch.randint(0, 3, (2, 24), generator=torch.Generator().manual_seed(1)), dim=1).values
    b = R.document_bounds(ids)
    torch.library.opcheck(flash_attn_op, (q, k, v, b, None, True, 0, 0.25))
    torch.library.opcheck(flash_attn_op, (q, k, v, None, None, False, 5, 0.25))
    torch.library.opcheck(flash_attn_op, (q, k, v, b, b.clone(), False, 0, 0.25))
    q, k, v = (t.detach() for t in (q, k, v))  # the backward op has no double backward
    out, lse = flash_attn_op(q, k, v, b, None, True, 0, 0.25)
    torch.library.opcheck(
        flash_attn_backward_op,
        (torch.randn_like(out), q, k, v, out, lse, torch.randn_like(lse), b, b.clone(), True, 0, 0.25),
    )


@pytest.mark.slow
def test_gradcheck_through_the_op():
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, -1]])
    for kw in (dict(doc_ids=ids), dict(causal=False, window=3), dict()):
        q, k, v = (torch.randn(1, h, 10, 4, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
        assert torch.autograd.gradcheck(lambda a, b, c: flash_attention(a, b, c, **kw), (q, k, v))


def test_bad_arguments_are_named():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="at most one"):
        flash_attention(
            q, k, v, doc_ids=torch.zeros(2, 24, dtype=torch.long), cu_seqlens=torch.tensor([0, 24])
        )
    with pytest.raises(ValueError, match="batch 1"):
        flash_attention(q, k, v, cu_seqlens=torch.tensor([0, 24]))


def test_model_flash_backend_matches_sdpa_with_and_without_documents():
    from loom.models.llama import FLAVORS, Llama

    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(10), torch.arange(22)]).expand(2, 32)
    losses = {}
    for backend in ("sdpa", "flash"):
        torch.manual_seed(0)
        model = Llama(FLAVORS["debug"].with_(vocab_size=256, max_seq_len=32, attention=backend))
        for pos in (None, positions):
            logits = model(tokens, pos)
            loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            grads = torch.autograd.grad(loss, list(model.parameters()))
            losses[backend, pos is None] = (loss.detach(), grads)
    for plain in (True, False):
        (a, ga), (b, gb) = losses["sdpa", plain], losses["flash", plain]
        torch.testing.assert_close(a, b)
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(losses["sdpa", True][0], losses["sdpa", False][0])  # documents change the loss


def test_dispatch_auto_choices():
    from loom.config.sections import ModelConfig
    from loom.kernels import dispatch

    auto = ModelConfig()
    cpu = dispatch.resolve_kernels(auto, "cpu", compile=False, documents=True)
    assert cpu.attention == "sdpa" and not (cpu.fused_norm or cpu.fused_loss)
    forced = dispatch.resolve_kernels(
        ModelConfig(attention="flash", fused_norm="true"), "cpu", compile=False, documents=False
    )
    assert forced.attention == "flash" and forced.fused_norm
    if dispatch.has_triton():
        gpu_docs = dispatch.resolve_kernels(auto, "cuda", compile=False, documents=True)
        assert gpu_docs.attention == "flash" and gpu_docs.fused_norm and gpu_docs.fused_loss
        gpu = dispatch.resolve_kernels(auto, "cuda", compile=True, documents=False, tp=True)
        assert gpu.attention == "sdpa" and not gpu.fused_norm and not gpu.fused_loss
        tp_eager = dispatch.resolve_kernels(auto, "cuda", compile=False, documents=False, tp=True)
        assert not tp_eager.fused_norm and tp_eager.fused_swiglu
        # compiled: Inductor's norm, except with tensorwise float8 (its fusion with the casts is slower)
        for float8, fused in (("none", False), ("rowwise", False), ("tensorwise", True)):
            c = dispatch.resolve_kernels(auto, "cuda", compile=True, documents=False, float8=float8)
            assert c.fused_norm is fused and not c.fused_rope and not c.fused_swiglu


def test_dispatch_measures_attention_only_where_auto_needs_it():
    from loom.config.sections import ModelConfig
    from loom.kernels import dispatch

    calls = []

    def measure():
        calls.append(1)
        return "flash"

    auto = ModelConfig()
    assert (
        dispatch.resolve_kernels(
            auto, "cpu", compile=False, documents=False, measure_attention=measure
        ).attention
        == "sdpa"
    )
    assert (
        dispatch.resolve_kernels(
            ModelConfig(attention="sdpa"), "cuda", compile=False, documents=False, measure_attention=measure
        ).attention
        == "sdpa"
    )
    # fp32 is not timed: its full-precision Triton dots compile for minutes per autotuned block
    fp32 = dict(compile=False, measure_attention=measure, triton=True, fp32=True)
    assert dispatch.resolve_kernels(auto, "cuda", documents=False, **fp32).attention == "sdpa"
    assert dispatch.resolve_kernels(auto, "cuda", documents=True, **fp32).attention == "flash"
    assert not calls
    if dispatch.has_triton():
        assert (
            dispatch.resolve_kernels(
                auto,
                "cuda",
                compile=False,
                documents=True,
                measure_attention=lambda: calls.append(1) or "flex",
            ).attention
            == "flex"
        )
        assert calls == [1]  # packed documents are timed too (the trainer times flash vs flex)
        assert (
            dispatch.resolve_kernels(
                auto, "cuda", compile=True, documents=False, measure_attention=measure
            ).attention
            == "flash"
        )
        assert calls == [1, 1]
        # untimed
        assert dispatch.resolve_kernels(auto, "cuda", compile=False, documents=True).attention == "flash"


def _random_documents(bsz: int, seq: int, gen: torch.Generator, longest: int) -> torch.Tensor:
    """Per-document positions (B, S) of documents 1..longest tokens long."""
    rows = []
    for _ in range(bsz):
        lengths = []
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(1, longest + 1, (1,), generator=gen)))
        rows.append(torch.cat([torch.arange(n) for n in lengths])[:seq])
    return torch.stack(rows)


@pytest.mark.parametrize("seq,longest", [(512, 400), (300, 150), (256, 1000), (1024, 64)])
def test_flex_block_ranges_are_exactly_the_visible_blocks(seq, longest):
    """Every key block with a visible element is listed; 'full' is exactly the blocks inside the sequence whose
    every element is visible (the mask function is not consulted there)."""
    from loom.kernels.attention.flex import BLOCK, block_ranges

    positions = _random_documents(3, seq, torch.Generator().manual_seed(seq), longest)
    bounds = R.document_bounds(R.doc_ids_from_positions(positions))
    partial, full = block_ranges(bounds[0], seq)
    n = -(-seq // BLOCK)
    vis = F.pad(R.visible(seq, True, bounds, 0, "cpu")[:, 0], (0, n * BLOCK - seq, 0, n * BLOCK - seq))
    vis = vis.view(3, n, BLOCK, n, BLOCK)
    whole = torch.arange(n) * BLOCK + BLOCK <= seq
    assert torch.equal(partial | full, vis.any(4).any(2))
    assert torch.equal(full, vis.all(4).all(2) & whole[:, None] & whole[None, :])
    assert not (partial & full).any()
    if longest >= 400:
        assert full.any()  # long documents leave whole blocks to skip the mask on


@pytest.mark.parametrize("documents,hq,hk,seq", [(True, 4, 2, 200), (False, 4, 4, 256), (True, 2, 1, 384)])
def test_flex_forward_matches_the_reference(documents, hq, hk, seq):
    """FlexAttention through loom's block mask (eager on CPU, forward only: Flex has no CPU backward; the GPU
    tests check the backward) equals masked SDPA."""
    from loom.kernels.attention.flex import flex_attend

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, hq, seq, 16, generator=gen)
    k, v = (torch.randn(2, hk, seq, 16, generator=gen) for _ in range(2))
    bounds = None
    if documents:
        bounds = R.document_bounds(R.doc_ids_from_positions(_random_documents(2, seq, gen, 150)))
    mask = R.visible(seq, True, bounds, 0, "cpu")
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hq != hk)
    starts = None if bounds is None else bounds[0]
    torch.testing.assert_close(flex_attend(q, k, v, starts), expected, atol=2e-6, rtol=1e-5)


def test_flex_is_a_config_error_off_cuda(tmp_path):
    from loom.config import ConfigError, build_config
    from loom.kernels.dispatch import kernel_choice

    cfg = build_config(None, {"model.attention": "flex", "run.device": "cpu"})
    with pytest.raises(ConfigError, match="model.attention.*flex.*needs CUDA"):
        kernel_choice(cfg, "cpu")


def test_flex_under_compiled_op_checkpointing_is_a_config_error():
    """Measured crash (torch 2.11, H100): refused with one line; Flex stays allowed under the other modes."""
    from loom.config import ConfigError, build_config
    from loom.kernels.dispatch import flex_unsupported, kernel_choice

    base = {"model.attention": "flex", "run.device": "cuda", "training.compile": "true"}
    for ac in ("op", "matmuls"):  # op-level: the same placement, the same refusal
        with pytest.raises(ConfigError, match=f"model.attention = 'flex'.*training.compile.*{ac}"):
            kernel_choice(build_config(None, dict(base, **{"training.activation_checkpointing": ac})), "cuda")
    for ac in ("none", "full", "every_k"):
        assert not flex_unsupported(
            build_config(None, dict(base, **{"training.activation_checkpointing": ac}))
        )
    assert not flex_unsupported(
        build_config(
            None, dict(base, **{"training.compile": "false", "training.activation_checkpointing": "op"})
        )
    )


def test_measure_times_every_candidate_and_never_picks_a_failing_one():
    import math

    from loom.kernels.dispatch import fastest, measure

    def timer(fn, inputs):
        return fn(*inputs)

    def broken(*inputs):
        raise RuntimeError("CUDA out of memory\nmore lines")

    times = measure(
        {"a": lambda *x: 2.0, "broken": broken, "b": lambda *x: 1.5}, [torch.zeros(1)], timer=timer
    )
    assert times["a"] == 2.0 and times["b"] == 1.5 and math.isinf(times["broken"])
    assert fastest(times) == "b"
    assert fastest({"x": 1.0, "y": 1.0}) == "x"
    with pytest.raises(RuntimeError, match="no candidate ran"):
        fastest({"broken": math.inf})


def test_measure_attention_times_the_candidates_through_the_models_call():
    from loom.kernels.dispatch import AttentionShape, measure_attention

    calls = []

    def attend(q, k, v, backend, positions):
        calls.append((backend, tuple(q.shape), tuple(k.shape), positions))
        return q

    def timer(fn, inputs):
        return float(len(fn(*inputs).shape))

    shape = AttentionShape(2, 4, 2, 8, 16, torch.float32)
    positions = torch.arange(8).expand(2, 8)
    assert measure_attention(attend, shape, torch.device("cpu"), positions, timer=timer) == {
        "flash": 4.0,
        "flex": 4.0,
    }
    assert [c[0] for c in calls] == ["flash", "flex"] and all(c[3] is positions for c in calls)
    assert calls[0][1:3] == ((2, 4, 8, 16), (2, 2, 8, 16))
    calls.clear()
    measure_attention(attend, shape, torch.device("cpu"), timer=timer)
    # fp32 on the CPU: neither pinned SDPA backend can run, PyTorch's own SDPA choice is the other candidate
    assert [c[0] for c in calls] == ["flash", "sdpa"] and calls[0][3] is None


def test_attention_candidates_per_device_dtype_and_documents():
    """auto times loom's kernel against SDPA pinned to cuDNN and to FlashAttention-2 wherever they can run (16-bit
    on CUDA, their head dims), PyTorch's own SDPA choice where neither can, and Flex with packed documents."""
    from loom.kernels.dispatch import attention_candidates

    pinned = ("flash", "sdpa_cudnn", "sdpa_flash")
    assert attention_candidates(False, "cuda", "bfloat16", 128) == pinned
    assert attention_candidates(False, "cuda", "float16", 64) == pinned
    assert attention_candidates(False, "cuda", "bfloat16") == pinned  # head dim unknown: the device decides
    assert attention_candidates(False, "cuda", "float32", 128) == ("flash", "sdpa")
    assert attention_candidates(False, "cpu", "bfloat16", 128) == ("flash", "sdpa")
    assert attention_candidates(False, "cuda", "bfloat16", 36) == (
        "flash",
        "sdpa_flash",
    )  # cuDNN: multiples of 8
    assert attention_candidates(False, "cuda", "bfloat16", 320) == ("flash", "sdpa")
    # FlashAttention-4 where it runs on this device (installed, the GPU takes the head dim), under the same limits
    assert attention_candidates(False, "cuda", "bfloat16", 128, fa4=True) == (*pinned, "fa4")
    assert attention_candidates(False, "cuda", "bfloat16", 36, fa4=True) == ("flash", "sdpa_flash")
    assert attention_candidates(False, "cuda", "float32", 128, fa4=True) == ("flash", "sdpa")
    assert attention_candidates(True, "cuda", "bfloat16", 128, fa4=True) == ("flash", "flex")
    for device, dtype in (("cuda", "bfloat16"), ("cuda", "float32"), ("cpu", "bfloat16")):
        assert attention_candidates(True, device, dtype, 128) == ("flash", "flex")


def test_measure_attention_times_a_shape_once_per_process():
    """The start-up timing is cached per shape (and device, candidates, documents): a second engine on the same
    shape times nothing; another shape or other documents are timed."""
    from loom.kernels.dispatch import AttentionShape, measure_attention

    timed = []

    def attend(q, k, v, backend, positions):
        timed.append(backend)
        return q

    def timer(fn, inputs):
        fn(*inputs)
        return {"flash": 2.0, "sdpa": 1.0}[timed[-1]]

    shape = AttentionShape(1, 2, 2, 8, 16, torch.float32)
    cpu = torch.device("cpu")
    first = measure_attention(attend, shape, cpu, timer=timer)
    assert first == {"flash": 2.0, "sdpa": 1.0} and timed == ["flash", "sdpa"]
    first["flash"] = 0.0  # a copy: the cache keeps its own figures
    assert measure_attention(attend, shape, cpu, timer=timer) == {"flash": 2.0, "sdpa": 1.0}
    assert len(timed) == 2
    measure_attention(attend, AttentionShape(1, 2, 2, 16, 16, torch.float32), cpu, timer=timer)
    assert len(timed) == 4
    docs = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    timer_docs = lambda fn, inputs: fn(*inputs) is not None and 1.0
    measure_attention(attend, shape, cpu, docs, timer=timer_docs)
    measure_attention(attend, shape, cpu, docs.clone(), timer=timer_docs)  # the same documents: cached
    assert timed[4:] == ["flash", "flex"]
    measure_attention(attend, shape, cpu, torch.tensor([[0, 1, 0, 1, 2, 3, 4, 5]]), timer=timer_docs)
    assert len(timed) == 8


def test_the_start_up_line_names_the_winner_and_its_margin():
    import math

    from loom.kernels.dispatch import describe_choice

    times = {"flash": 1.1, "sdpa_cudnn": 1.0, "sdpa_flash": 1.3}
    assert describe_choice(times) == "sdpa_cudnn won, 1.10x flash (the next)"
    assert (
        describe_choice({"flash": 2.0, "sdpa_cudnn": math.inf}) == "flash won (the only candidate that ran)"
    )


def test_pinned_sdpa_is_refused_where_it_cannot_run():
    """model.attention = sdpa_cudnn / sdpa_flash / fa4 by hand: one line naming the field, the value and what is allowed
    off CUDA, in fp32, with packed documents or a sliding window, past the head dims, cuDNN when deterministic."""
    from loom.config import ConfigError, build_config
    from loom.kernels.dispatch import kernel_choice

    def choose(backend, device="cuda", head_dim=64, window=0, **fields):
        cfg = build_config(None, {"model.attention": backend, "training.dtype": "bfloat16", **fields})
        return kernel_choice(cfg, device, triton=False, window=lambda: window, head_dim=lambda: head_dim)

    for backend in ("sdpa_cudnn", "sdpa_flash", "fa4"):
        assert choose(backend).attention == backend
        cases = [
            (dict(device="cpu"), "needs CUDA"),
            (dict(**{"training.dtype": "float32"}), "bfloat16 / float16 only"),
            (dict(**{"data.document_positions": "true"}), "plain causal attention only"),
            (dict(window=128), "plain causal attention only"),
            (dict(head_dim=512), "head dims up to 256"),
        ]
        for kwargs, match in cases:
            with pytest.raises(ConfigError, match=f"model.attention = '{backend}': .*{match}") as err:
                choose(backend, **kwargs)
            assert "\n" not in str(err.value) and "allowed auto | sdpa | flash | flex" in str(err.value)
    for backend in ("sdpa_cudnn", "fa4"):
        with pytest.raises(ConfigError, match="multiple of 8; this model's attention has 36"):
            choose(backend, head_dim=36)
        with pytest.raises(ConfigError, match="not deterministic"):
            choose(backend, **{"run.deterministic": "true"})
    assert choose("sdpa_flash", head_dim=36).attention == "sdpa_flash"
    with pytest.raises(ConfigError, match="FlashAttention-4 needs CUDA"):
        choose("fa4", device="cpu")
    with pytest.raises(
        ConfigError, match="context parallelism .* not FlashAttention-4: allowed auto | sdpa | flash"
    ):
        choose("fa4", **{"parallel.cp": "2"})
    assert choose("sdpa_flash", **{"run.deterministic": "true"}).attention == "sdpa_flash"


def test_pinned_sdpa_reads_the_models_head_dim():
    """The resolver asks the model's shape for the head dim (the debug flavor's 16: both pinned backends take it)."""
    from loom.config import ConfigError, build_config
    from loom.resolve import model_kernels

    cfg = build_config(
        None, {"model.attention": "sdpa_cudnn", "model.flavor": "debug", "training.dtype": "bfloat16"}
    )
    assert model_kernels(cfg, "cuda", triton=False).attention == "sdpa_cudnn"
    with pytest.raises(ConfigError, match="needs CUDA"):
        model_kernels(cfg, "cpu")


def test_pinned_sdpa_off_cuda_is_plain_sdpa_and_torch_is_asked_on_cuda_only():
    """Off CUDA (the planner's fake tensors) the pinned backends compute plain SDPA; PyTorch's own check (its
    SDPAParams as this torch builds them) refuses CPU tensors; the run-time check is a no-op off CUDA."""
    from loom.kernels.dispatch import AttentionShape, check_fixed_attention, torch_takes
    from loom.models.common.layers import attend

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 8, generator=gen) for h in (4, 2, 2))
    plain = attend(q, k, v, "sdpa", None)
    for backend in ("sdpa_cudnn", "sdpa_flash"):
        assert torch.equal(attend(q, k, v, backend, None), plain)
        assert not torch_takes(backend, q, k, v)
        check_fixed_attention(backend, AttentionShape(2, 4, 2, 16, 8, torch.bfloat16), torch.device("cpu"))


def test_fa4_is_refused_on_the_device_where_it_cannot_run(monkeypatch):
    """model.attention = fa4 checked on the run's device before the model is built: the package, a CUDA GPU of
    compute capability 9-11, the head dims FA4 takes there; each a one-line ConfigError."""
    from loom.config import ConfigError
    from loom.kernels.attention import fa4
    from loom.kernels.dispatch import AttentionShape, check_fixed_attention

    shape = AttentionShape(2, 4, 2, 16, 128, torch.bfloat16)
    monkeypatch.setattr(fa4, "installed", lambda: False)
    with pytest.raises(
        ConfigError, match="model.attention = 'fa4': FlashAttention-4 needs the flash-attn-4 pa"
    ) as e:
        check_fixed_attention("fa4", shape, torch.device("cpu"))
    assert "\n" not in str(e.value) and "allowed auto | sdpa | sdpa_cudnn | sdpa_flash | flash | flex" in str(
        e.value
    )
    monkeypatch.setattr(fa4, "installed", lambda: True)
    assert fa4.refusal(torch.device("cpu"), 128) == "needs a CUDA GPU (device cpu)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "this GPU is 8.0" in fa4.refusal(torch.device("cuda"), 128)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    # the package found but its import failing (here: not installed at all) is a refusal, not a first-step crash
    assert fa4.refusal(torch.device("cuda"), 128).startswith("is installed but does not import (")
    monkeypatch.setattr(fa4, "_interface", lambda: None)
    assert fa4.refusal(torch.device("cuda"), 128) is None
    assert "up to 128, or 256 here; this model's attention has 192" in fa4.refusal(torch.device("cuda"), 192)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fa4.refusal(torch.device("cuda"), 192) is None
    assert [d for d in range(0, 300, 4) if fa4.head_dims_allowed(d, 9)] == list(range(8, 257, 8))


def test_fa4_op_traces_with_its_fakes_and_saves_like_the_other_kernels():
    """loom::fa4 and its backward trace on fake tensors (what torch.compile and the planner see; FA4's own
    autograd function cannot be traced): forward + backward is two custom ops, no copies of q, k, v (FA4 reads the
    model's (B, S, H, D) layout), out and gradients in the layouts of q, k, v; op-level checkpointing saves its
    output."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from loom.kernels.attention.fa4 import fa4_attention
    from loom.parallel.activation_checkpoint import _SAVE_OPS

    def step(q, k, v, dout):
        out = fa4_attention(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    def inputs():  # (B, S, H, D) projections seen as (B, H, S, D), as the model passes them
        return [torch.randn(2, 32, h, 64, dtype=torch.bfloat16).transpose(1, 2) for h in (8, 2, 2)]

    q, k, v = (t.requires_grad_() for t in inputs())
    graph = make_fx(step, tracing_mode="fake")(q, k, v, torch.randn(2, 8, 32, 64, dtype=torch.bfloat16))
    ops = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.loom.fa4.default) == 1 and ops.count(torch.ops.loom.fa4_backward.default) == 1
    assert not {torch.ops.aten.clone.default, torch.ops.aten.contiguous.default} & set(ops)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (t.requires_grad_() for t in inputs())
        out = fa4_attention(q, k, v)
        out.sum().backward()
        assert out.shape == q.shape and out.stride() == q.stride()
        assert all(t.grad.stride() == t.stride() for t in (q, k, v))
    assert torch.ops.loom.fa4.default in _SAVE_OPS


def test_attention_calls_off_triton_run_the_reference():
    from loom.kernels import dispatch

    q = torch.randn(1, 2, 8, 16)
    if not dispatch.triton_runs_on(q.device):  # a CPU run without the interpreter
        assert dispatch.forward_kernel(q, q, q, None, 0) == "reference"
        assert dispatch.backward_kernels(q, q, q, q, None, None, 0) == ("reference", "reference")


INTERPRETER_SCRIPT = textwrap.dedent("""
    import torch
    from loom.kernels.attention import reference as R, triton as T

    def check(q, k, v, causal, bounds, window, scale, key_bounds=None):
        # the Triton kernels' worst difference from the reference; the tensor-descriptor variant gives the same
        # values to fp32 rounding (the interpreter's dots are numpy's matmuls, whose summation order follows the
        # tiles' memory layout: bit-equal in earlier CI runs, 6e-7 apart at d64 on 2026-11-30 with numpy 2.4.6)
        o1, l1 = R.attention_forward(q, k, v, causal, bounds, window, scale)
        do = torch.randn_like(o1)
        g1 = R.attention_backward(do, q, k, v, o1, l1, None, causal, bounds, window, scale)
        runs = []
        for tensor_desc in (False, True):
            o2, l2 = T.attention_forward(q, k, v, causal, bounds, window, scale, key_bounds, tensor_desc=tensor_desc)
            g2 = T.attention_backward(
                do, q, k, v, o2, l2, None, causal, bounds, window, scale, key_bounds, tensor_desc=tensor_desc
            )
            runs.append((o2, l2, *g2))
        apart = max(float((a - b).abs().max()) for a, b in zip(*runs))
        assert apart < 1e-5, f"tensor descriptors differ from plain pointers by {apart}"
        o2, l2, *g2 = runs[0]
        assert torch.equal(torch.isinf(l1), torch.isinf(l2)) and not torch.isnan(o2).any()
        fin = torch.isfinite(l1)
        errs = [(o1 - o2).abs().max(), (l1[fin] - l2[fin]).abs().max()] + [(a - c).abs().max() for a, c in zip(g1, g2)]
        return max(float(e) for e in errs)

    torch.manual_seed(0)
    worst = 0.0
    for b, hq, hk, s, d, causal, docs, window in [(1, 2, 1, 37, 16, True, False, 0), (1, 2, 2, 45, 32, True, True, 0),
                                                  (2, 4, 2, 40, 16, False, True, 9), (1, 2, 1, 45, 16, True, False, 7),
                                                  (1, 4, 1, 90, 16, True, True, 13), (1, 2, 1, 33, 64, False, False, 0)]:
        q, k, v = torch.randn(b, hq, s, d), torch.randn(b, hk, s, d), torch.randn(b, hk, s, d)
        bounds = None
        if docs:
            ids = torch.sort(torch.randint(0, 4, (b, s)), dim=1).values
            ids[:, -3:] = -1  # padding rows: nothing visible
            bounds = R.document_bounds(ids)
        worst = max(worst, check(q, k, v, causal, bounds, window, d ** -0.5))
    # a chunk pair, as context parallelism attends: queries are chunk 1 of a packed sequence, keys chunk 0
    c = 40
    ids = torch.sort(torch.randint(0, 5, (2, 2 * c)), dim=1).values
    whole = R.document_bounds(ids)
    qb, kb = R.shift_bounds(whole[:, :, c:], 0, c), R.shift_bounds(whole[:, :, :c], c, c)
    q, k, v = torch.randn(2, 4, c, 16), torch.randn(2, 2, c, 16), torch.randn(2, 2, c, 16)
    worst = max(worst, check(q, k, v, False, qb, 0, 0.25, kb))
    # bench.kernels --tensor-desc times these kernels through its own autograd call: the same gradients
    from bench.kernels import BACKENDS
    q, k, v = (torch.randn(1, h, 37, 16, requires_grad=True) for h in (2, 1, 1))
    ids = torch.tensor([[0] * 20 + [1] * 17])
    grads = []
    for name in ("triton_plain", "triton_desc"):
        BACKENDS[name](q, k, v, True, ids)().sum().backward()
        grads.append([t.grad for t in (q, k, v)])
        q.grad = k.grad = v.grad = None
    bounds = R.document_bounds(ids)
    q, k, v = (t.detach() for t in (q, k, v))
    o, lse = R.attention_forward(q, k, v, True, bounds, 0, 0.25)
    ref = R.attention_backward(torch.ones_like(o), q, k, v, o, lse, None, True, bounds, 0, 0.25)
    assert all(torch.equal(a, b) for a, b in zip(*grads)), "the bench's two variants differ"
    worst = max(worst, max(float((a - b).abs().max()) for a, b in zip(grads[0], ref)))
    print("WORST", worst)
""")


def _interpreter_ok() -> str | None:
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return (
        None
        if (major, minor) >= (3, 8)
        else f"triton {triton.__version__} < 3.8 (its interpreter fails here)"
    )


@pytest.mark.skipif(_interpreter_ok() is not None, reason=str(_interpreter_ok()))
def test_triton_kernels_in_the_cpu_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", INTERPRETER_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    worst = float(res.stdout.split("WORST")[1])
    assert worst < 1e-4, worst


def test_fp32_inputs_keep_full_precision_matmuls_on_a_gpu(monkeypatch):
    """``tl.dot`` turns an unset input precision into TF32 itself (a launch option never reaches it: measured on an
    H200, 3.4e-2 off float64 either way), so every dot of the kernels takes DOT_PRECISION: "ieee" for fp32 at
    PyTorch's default float32 matmul precision ("highest"), "tf32" where PyTorch allows TF32 or the inputs are 16-bit
    (where it changes nothing); "ieee" in the CPU interpreter (which computes in fp32 anyway)."""
    pytest.importorskip("triton")
    import inspect

    from loom.kernels.attention import triton as T

    src = inspect.getsource(T)
    assert src.count("tl.dot(") == src.count("input_precision=DOT_PRECISION") == 9
    monkeypatch.setattr(T, "interpreting", lambda: False)
    q32, q16 = torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16)
    assert T.dot_precision(q32) == {"DOT_PRECISION": "ieee"}
    assert T.dot_precision(q16) == {"DOT_PRECISION": "tf32"}
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 allowed, as torch.matmul would use it
        assert T.dot_precision(q32) == {"DOT_PRECISION": "tf32"}
    finally:
        torch.set_float32_matmul_precision(old)
    monkeypatch.setattr(T, "interpreting", lambda: True)
    assert T.dot_precision(q16) == {"DOT_PRECISION": "ieee"}


def test_tensor_descriptor_layout_is_checked_by_name():
    """A TMA descriptor needs a 16-byte aligned start and 16-byte multiple strides (but the last): the launcher
    of the tensor-descriptor variant refuses others naming the tensor, where the kernel would fault."""
    pytest.importorskip("triton")
    from loom.kernels.attention import triton as T

    q = torch.zeros(2, 4, 40, 16)
    T.check_descriptor_layout(q=q, k=q.transpose(1, 2))  # the model's (B, S, H, D) layout, transposed: fine
    with pytest.raises(ValueError, match="k: tensor descriptors need a 16-byte aligned start"):
        T.check_descriptor_layout(q=q, k=torch.zeros(q.numel() + 1)[1:].view(q.shape))  # 4 bytes in
    with pytest.raises(ValueError, match="v: .*strides \\(1800, 450, 18, 1\\) of 4 bytes"):
        T.check_descriptor_layout(v=torch.zeros(2, 4, 25, 18)[..., :16])

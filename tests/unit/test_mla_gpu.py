"""Multi-head latent attention on CUDA (skipped without one): debug_mla trains in bf16 on every attention backend
(loom's Triton kernel and FlexAttention with the values zero-padded to the q/k head dim, SDPA as it is) and under
torch.compile with op-level checkpointing, close to fp32; DeepSeek-V2-Lite's attention shape (q/k 192, v 128, the
Triton kernel refused: SDPA) trains; logits equal transformers' DeepSeek-V3 through the fused kernels; the latent
cache's compiled, graph-captured decode equals the full forward at every position."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.harness import run_one

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def job(tmp_path, **extra):
    d = {
        "run.dir": str(tmp_path / "run"),
        "run.device": "cuda",
        "model.flavor": "debug_mla",
        "training.steps": 6,
        "training.seq_len": 128,
        "training.global_batch_size": 8,
        "training.micro_batch_size": 4,
        "optimizer.warmup_steps": 1,
        "metrics.every": 1,
        "checkpoint.at_end": "false",
        "metrics.tensorboard": "false",
    }
    d.update(extra)
    return d


def losses(tmp_path, **extra) -> list[float]:
    out = [r["loss"] for r in run_one(job(tmp_path, **extra))]
    assert all(math.isfinite(x) for x in out) and out[-1] < out[0], out
    return out


def test_every_backend_trains_close_to_fp32(tmp_path):
    fp32 = losses(tmp_path / "fp32", **{"training.dtype": "float32", "model.attention": "sdpa"})
    for backend in ("sdpa", "flash", "flex"):
        for documents in ("false", "true"):
            got = losses(
                tmp_path / f"{backend}-{documents}",
                **{
                    "training.dtype": "bfloat16",
                    "model.attention": backend,
                    "data.document_positions": documents,
                },
            )
            if documents == "false":
                assert max(abs(a - b) / a for a, b in zip(fp32, got)) < 2e-2, backend


def test_compile_and_op_checkpointing(tmp_path):
    eager = losses(tmp_path / "e", **{"training.dtype": "bfloat16", "model.attention": "flash"})
    comp = losses(
        tmp_path / "c",
        **{
            "training.dtype": "bfloat16",
            "model.attention": "flash",
            "training.compile": "true",
            "training.activation_checkpointing": "op",
        },
    )
    assert max(abs(a - b) / a for a, b in zip(eager, comp)) < 1e-2


def test_deepseek_v2_lite_attention_shape_trains(tmp_path):
    """Two layers of the deepseek_v2_lite flavor (q/k heads 192 wide, values 128, YaRN): auto picks SDPA for packed
    documents (loom's kernel takes at most 128) and the model trains."""
    records = run_one(
        job(
            tmp_path,
            **{
                "model.flavor": "deepseek_v2_lite",
                "model.n_layers": 2,
                "training.dtype": "bfloat16",
                "data.document_positions": "true",
                "training.steps": 4,
                "training.micro_batch_size": 2,
            },
        )
    )
    assert all(math.isfinite(r["loss"]) for r in records)


def test_logits_match_transformers_through_the_fused_kernels(tmp_path):
    pytest.importorskip("transformers")
    from tests.unit.test_hf import loom_from_hf, save_hf
    from tests.unit.test_mla import random_deepseek, tokens_of

    hf = random_deepseek("yarn", qk_nope_head_dim=24)  # q/k 24 + 8 = 32 wide: loom's Triton kernel takes it
    folder = save_hf(hf, tmp_path / "hf")
    tokens = tokens_of(2, 64)
    with torch.no_grad():
        theirs = hf(tokens).logits
        for backend in ("sdpa", "flash"):
            model = loom_from_hf(
                folder, attention=backend, fused_norm=True, fused_rope=True, fused_swiglu=True
            ).cuda()
            assert (model(tokens.cuda()).cpu() - theirs).abs().max() < 1e-3, backend


def test_graph_captured_decode_equals_the_full_forward():
    import loom.infer.mla_cache  # noqa: F401  (registers the latent cache)
    from loom.infer.engine import Engine
    from tests.unit.test_mla_cache import model_of, reference, rows_of

    model = model_of("q_lora")
    lengths, new = [3, 9, 6], 7
    rows = rows_of(len(lengths), max(lengths) + new)
    refs = reference(model, [r[: n + new] for r, n in zip(rows, lengths)])  # on the CPU
    model = model.cuda()
    engine = Engine(model, compile=True, cuda_graphs=True)
    logits, _, lens = engine.start([r[:n] for r, n in zip(rows, lengths)], reserve=new)
    for b, n in enumerate(lengths):
        assert (logits[b].cpu() - refs[b][n - 1]).abs().max() < 1e-4
    pos = lens.clone()
    for i in range(new):
        tokens = torch.tensor([[r[n + i]] for r, n in zip(rows, lengths)], device="cuda")
        out = engine.step(tokens, pos[:, None])[:, 0].cpu()
        for b, n in enumerate(lengths):
            assert (out[b] - refs[b][n + i]).abs().max() < 1e-4, (i, b)
        pos += 1

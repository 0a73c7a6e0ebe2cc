"""On a GPU, evaluation gives the CPU's numbers: perplexity and every harness request type from a checkpoint loaded
on CUDA (loom.infer.load's CUDA kernels: fused norm, RoPE and SwiGLU) in float32 equal the CPU's, and in bfloat16
they stay close; the backend still equals lm-eval's hf backend there."""

from __future__ import annotations

import pytest
import torch

from loom.eval import load, perplexity

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

lm_eval = pytest.importorskip("lm_eval")

from loom.eval.harness import LoomLM, flat_metrics  # noqa: E402
from tests.unit.test_eval_harness import evaluate, hf_backend, model_folders, responses  # noqa: E402,F401


def test_perplexity_on_cuda_equals_the_cpu(model_folders, tmp_path):
    ckpt, _, tasks = model_folders
    source = f"{tasks}/roll.jsonl"
    (cpu,) = perplexity(load(ckpt, device="cpu"), source)
    (fp32,) = perplexity(load(ckpt, device="cuda", dtype="float32"), source)
    (bf16,) = perplexity(load(ckpt, device="cuda", dtype="bfloat16"), source, batch_size=1)
    assert fp32.tokens == cpu.tokens and fp32.bits_per_byte == pytest.approx(cpu.bits_per_byte, rel=1e-4)
    assert bf16.bits_per_byte == pytest.approx(cpu.bits_per_byte, rel=2e-2)


def test_the_backend_on_cuda_equals_lm_evals_hf_backend(model_folders):
    ckpt, hf, tasks = model_folders
    names = ["loomtest_mc", "loomtest_roll", "loomtest_gen"]
    from lm_eval.models.huggingface import HFLM

    theirs = evaluate(
        HFLM(pretrained=hf, device="cuda", dtype="float32", batch_size=3, max_length=64), names, tasks
    )
    ours = evaluate(LoomLM(ckpt, device="cuda", dtype="float32", batch_size=3), names, tasks)
    a, b = flat_metrics(ours), flat_metrics(theirs)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-4), key
    assert responses(ours, "loomtest_gen") == responses(theirs, "loomtest_gen")

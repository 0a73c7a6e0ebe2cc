"""bench.diag.lora_gemm: the fused LoRA GEMM it prices computes what loom's op computes (forward and input
gradient), in Triton's CPU interpreter; each shape's adapter width."""

import os
import subprocess
import sys

import pytest

from bench.diag.lora_gemm import group_rank, shapes

SCRIPT = """
import torch
from bench.diag import lora_gemm as lg
for forward in (True, False):
    x, w, lo, hi = lg.operands(32, 48, 64, forward, 16, "cpu", torch.float32)
    ref = lg.reference(x, w, lo, hi, 2.0, forward)
    base = x @ w.t() if forward else x @ w
    assert (ref - base).abs().max() > 1e-2  # the adapters' product counts
    fused = lg.lora_gemm(x, w, lo, hi, 2.0, forward, True, (16, 16, 16, 1, 1, False))
    alone = lg.lora_gemm(x, w, lo, hi, 2.0, forward, False, (16, 16, 16, 1, 1, False))
    assert torch.allclose(fused, ref, atol=1e-4, rtol=1e-4), (fused - ref).abs().max()
    assert torch.allclose(alone, base, atol=1e-4, rtol=1e-4), (alone - base).abs().max()
print("ok")
"""


def _interpreter_ok() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 8)


@pytest.mark.skipif(not _interpreter_ok(), reason="needs triton >= 3.8 (its CPU interpreter)")
def test_fused_gemm_matches_loom_op_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_shapes_and_adapter_widths():
    s = shapes(4096)
    assert s["qkv_forward"] == (4096, 6144, 4096, True) and s["down_input_grad"] == (4096, 14336, 4096, False)
    assert [group_rank(n, 16) for n in ("qkv_forward", "gate_up_forward", "o_input_grad")] == [64, 32, 16]

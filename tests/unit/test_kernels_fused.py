"""Fused RMSNorm / RoPE / SwiGLU ops on CPU: the closed-form backward references match autograd, the ops pass
opcheck, their gradients match autograd through the reference, the model gives the same loss and gradients
with the fused flags on, and each Triton kernel agrees with its reference under Triton's CPU interpreter."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from loom.kernels.rmsnorm import reference as norm_ref
from loom.kernels.rmsnorm.op import rms_norm
from loom.kernels.rope import reference as rope_ref
from loom.kernels.rope.op import apply_rope
from loom.kernels.swiglu import reference as swiglu_ref
from loom.kernels.swiglu.op import swiglu
from loom.models.common import rope as model_rope
from loom.models.common.init import materialize
from loom.models.llama import FLAVORS, Llama


def rope_tables(head_dim: int = 16, max_len: int = 32) -> list[torch.Tensor]:
    """The model's table, one with Llama-3 scaling, and one whose cos/sin halves differ (tests the general
    rotate-half formula, not only the model's duplicated-halves table)."""
    plain = model_rope.rope_table(head_dim, max_len, 10000.0, None)
    scaled = model_rope.rope_table(
        head_dim, max_len, 500000.0, model_rope.RopeScaling(factor=8.0, original_max_position=16)
    )
    return [plain, scaled, torch.randn(2, max_len, head_dim, generator=torch.Generator().manual_seed(3))]


# ---- closed-form backward references vs autograd through the forward reference -------------------


def autograd_grads(fn, inputs, grad):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    fn(*inputs).backward(grad)
    return [t.grad for t in inputs if t.requires_grad]


@pytest.mark.parametrize(
    "dtype,weight_dtype",
    [(torch.float32, torch.float32), (torch.float64, torch.float64), (torch.float32, torch.bfloat16)],
)
def test_rmsnorm_backward_reference_matches_autograd(dtype, weight_dtype):
    x, g = torch.randn(4, 3, 40, dtype=dtype) * 2, torch.randn(4, 3, 40, dtype=dtype)
    w = torch.randn(40).to(weight_dtype)
    dx, dw = norm_ref.rms_norm_backward(g, x, w, 1e-5)
    want_dx, want_dw = autograd_grads(lambda a, b: norm_ref.rms_norm(a, b, 1e-5), [x, w], g)
    assert dx.dtype == dtype and dw.dtype == weight_dtype
    tol = 1e-2 if weight_dtype == torch.bfloat16 else 1e-5  # autograd rounds the weight's grad terms to bf16
    torch.testing.assert_close(dx, want_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, want_dw, rtol=tol, atol=tol)


@pytest.mark.parametrize("with_positions", [False, True])
def test_rope_backward_reference_matches_autograd(with_positions):
    x, g = torch.randn(2, 7, 3, 16), torch.randn(2, 7, 3, 16)
    positions = torch.randint(0, 32, (2, 7)) if with_positions else None
    for table in rope_tables():
        (want,) = autograd_grads(lambda t: rope_ref.apply_rope(t, table, positions), [x], g)
        torch.testing.assert_close(
            rope_ref.apply_rope_backward(g, table, positions), want, rtol=1e-6, atol=1e-6
        )


def test_swiglu_backward_reference_matches_autograd():
    a, b, g = (
        torch.randn(5, 33, dtype=torch.float64) * 4,
        torch.randn(5, 33, dtype=torch.float64),
        torch.randn(5, 33, dtype=torch.float64),
    )
    got = swiglu_ref.swiglu_backward(g, a, b)
    for have, want in zip(got, autograd_grads(swiglu_ref.swiglu, [a, b], g)):
        torch.testing.assert_close(have, want, rtol=1e-12, atol=1e-12)


# ---- the custom ops: opcheck, gradients of the public functions ---------------------------------


def test_opcheck_every_op():
    from torch.library import opcheck

    x = torch.randn(3, 5, 24, requires_grad=True)
    w = torch.randn(24, requires_grad=True)
    opcheck(torch.ops.loom.rms_norm, (x, w, 1e-5))
    opcheck(torch.ops.loom.rms_norm_backward, (torch.randn(3, 5, 24), x.detach(), w.detach(), 1e-5))
    q = torch.randn(2, 5, 3, 16, requires_grad=True)
    table = rope_tables()[0]
    for positions in (None, torch.randint(0, 32, (2, 5))):
        opcheck(torch.ops.loom.apply_rope, (q, table, positions))
        opcheck(torch.ops.loom.apply_rope_backward, (torch.randn(2, 5, 3, 16), table, positions))
    a, b = torch.randn(4, 40, requires_grad=True), torch.randn(4, 40, requires_grad=True)
    opcheck(torch.ops.loom.swiglu, (a, b))
    opcheck(torch.ops.loom.swiglu_backward, (torch.randn(4, 40), a.detach(), b.detach()))


def test_public_functions_grads_match_autograd_through_reference():
    x, w, g = torch.randn(2, 3, 24), torch.randn(24), torch.randn(2, 3, 24)
    got = autograd_grads(lambda a, b: rms_norm(a, b, 1e-6), [x, w], g)
    want = autograd_grads(lambda a, b: norm_ref.rms_norm(a, b, 1e-6), [x, w], g)
    for have, ref in zip(got, want):
        torch.testing.assert_close(have, ref, rtol=1e-5, atol=1e-5)

    q, gq, positions = torch.randn(2, 5, 3, 16), torch.randn(2, 5, 3, 16), torch.randint(0, 32, (2, 5))
    table = rope_tables()[2]
    (got,) = autograd_grads(lambda t: apply_rope(t, table, positions), [q], gq)
    (want,) = autograd_grads(lambda t: rope_ref.apply_rope(t, table, positions), [q], gq)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

    a, b = (
        torch.randn(3, 7, dtype=torch.float64, requires_grad=True),
        torch.randn(3, 7, dtype=torch.float64, requires_grad=True),
    )
    assert torch.autograd.gradcheck(swiglu, (a, b))


def test_public_functions_reject_mismatched_inputs():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 8), torch.randn(9), 1e-5)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(torch.randn(2, 5, 3, 16), rope_tables()[0], torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="swiglu"):
        swiglu(torch.randn(2, 8), torch.randn(2, 8, dtype=torch.float64))


# ---- the model with the fused flags ----------------------------------------------------------------


def build(**flags) -> Llama:
    args = FLAVORS["debug"].with_(vocab_size=256, max_seq_len=32, **flags)
    with torch.device("meta"):
        model = Llama(args)
    materialize(model, torch.device("cpu"), 0, model.param_std, model.init_buffers)
    return model


@pytest.mark.parametrize("with_positions", [False, True])
def test_model_with_fused_flags_gives_the_same_loss_and_grads(with_positions):
    plain, fused = build(), build(fused_norm=True, fused_rope=True, fused_swiglu=True)
    assert [(n, p.shape) for n, p in plain.named_parameters()] == [
        (n, p.shape) for n, p in fused.named_parameters()
    ]
    fused.load_state_dict(plain.state_dict())
    block = fused.layers["0"]
    assert fused.norm.fused and block.ffn_norm.fused and block.feed_forward.fused
    assert block.attention.apply_rope is apply_rope  # the fused op, not the reference
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(10), torch.arange(6)]).expand(2, 16) if with_positions else None
    losses = []
    for model in (plain, fused):
        logits = model(tokens[:, :-1], None if positions is None else positions[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


# ---- the Triton kernels under the CPU interpreter ---------------------------------------------------


def interpret(script: str, *args: str) -> str:
    """``script`` in a fresh process under Triton's CPU interpreter (TRITON_INTERPRET must be set before triton is
    imported); its stdout, after asserting it exited cleanly."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def triton_skip_reason() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton not installed"
    version = importlib.metadata.version("triton")
    if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < (3, 8):
        return f"triton {version}: its CPU interpreter is trusted from 3.8"
    return None


# Run in a fresh process: TRITON_INTERPRET must be set before triton is imported. fp32 only (the
# interpreter is known wrong for bf16: it truncates fp32 -> bf16 instead of rounding to nearest).
# Each case runs the launcher directly, then the public op (forward + backward through autograd,
# which dispatches to Triton on CPU when interpreting), and checks the launchers' ValueErrors.
INTERPRETER_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from loom.kernels.triton_support import triton_runs_on
    assert triton_runs_on(torch.device("cpu"))
    torch.manual_seed(0)
    kernel = sys.argv[1]

    def close(a, b, tol=2e-6):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)

    def grads(fn, inputs, g):
        inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        fn(*inputs).backward(g)
        return [t.grad for t in inputs if t.requires_grad]

    def raises(fn, *args):
        try:
            fn(*args)
        except ValueError:
            return
        raise AssertionError(f"no ValueError from {fn.__name__}")

    if kernel == "rmsnorm":
        from loom.kernels.rmsnorm import reference as ref, triton as tk
        from loom.kernels.rmsnorm.op import rms_norm
        for shape in [(3, 5, 48), (33, 16), (1, 1, 100), (2, 2500), (6,), (0, 16)]:
            x, g, w = torch.randn(shape) * 2, torch.randn(shape), torch.randn(shape[-1])
            close(tk.rms_norm_forward(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
            for have, want in zip(tk.rms_norm_backward(g, x, w, 1e-5), ref.rms_norm_backward(g, x, w, 1e-5)):
                close(have, want, 1e-5)
            close(rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
            for have, want in zip(grads(lambda a, b: rms_norm(a, b, 1e-5), [x, w], g),
                                  grads(lambda a, b: ref.rms_norm(a, b, 1e-5), [x, w], g)):
                close(have, want, 1e-5)
        x, w = torch.randn(4, 8), torch.randn(8)
        raises(tk.rms_norm_forward, x.t(), w, 1e-5)  # not contiguous
        raises(tk.rms_norm_forward, x, torch.randn(9), 1e-5)
        raises(tk.rms_norm_forward, x.double(), w, 1e-5)
        raises(tk.rms_norm_backward, torch.randn(4, 9), x, w, 1e-5)
    elif kernel == "rope":
        from loom.kernels.rope import reference as ref, triton as tk
        from loom.kernels.rope.op import apply_rope
        from loom.models.common.rope import rope_table
        tables = [rope_table(16, 32, 10000.0, None), torch.randn(2, 32, 16), rope_table(12, 32, 10000.0, None)]
        for (b, s, h, d), pos_dtype in [((2, 5, 3, 16), None), ((2, 5, 3, 16), torch.int64),
                                        ((1, 7, 1, 16), torch.int32), ((3, 4, 5, 12), torch.int64)]:
            x, g = torch.randn(b, s, h, d), torch.randn(b, s, h, d)
            pos = None if pos_dtype is None else torch.randint(0, 32, (b, s), dtype=pos_dtype)
            for table in [t for t in tables if t.shape[-1] == d]:
                ref_pos = None if pos is None else pos.long()
                close(tk.apply_rope_forward(x, table, pos), ref.apply_rope(x, table, ref_pos))
                close(tk.apply_rope_backward(g, table, pos), ref.apply_rope_backward(g, table, ref_pos))
                close(apply_rope(x, table, pos), ref.apply_rope(x, table, ref_pos))
                (have,) = grads(lambda t: apply_rope(t, table, pos), [x], g)
                (want,) = grads(lambda t: ref.apply_rope(t, table, ref_pos), [x], g)
                close(have, want)
        x, table = torch.randn(2, 5, 3, 16), tables[0]
        raises(tk.apply_rope_forward, x.transpose(1, 2), table, None)  # not contiguous
        raises(tk.apply_rope_forward, x, table[:, :4], None)  # sequence longer than the table
        raises(tk.apply_rope_forward, x, table, torch.zeros(2, 4, dtype=torch.long))
        raises(tk.apply_rope_forward, x, table, torch.zeros(2, 5))  # float positions
        raises(tk.apply_rope_forward, torch.randn(2, 5, 3, 15), torch.randn(2, 32, 15), None)  # odd head dim
    elif kernel == "swiglu":
        from loom.kernels.swiglu import reference as ref, triton as tk
        from loom.kernels.swiglu.op import swiglu
        for shape in [(3, 5, 48), (2500,), (1,), (7, 1030)]:
            a, b, g = torch.randn(shape) * 4, torch.randn(shape), torch.randn(shape)
            close(tk.swiglu_forward(a, b), ref.swiglu(a, b))
            for have, want in zip(tk.swiglu_backward(g, a, b), ref.swiglu_backward(g, a, b)):
                close(have, want)
            close(swiglu(a, b), ref.swiglu(a, b))
            for have, want in zip(grads(swiglu, [a, b], g), grads(ref.swiglu, [a, b], g)):
                close(have, want, 1e-5)
        a = torch.randn(4, 8)
        raises(tk.swiglu_forward, a.t(), a.t())  # not contiguous
        raises(tk.swiglu_forward, a, torch.randn(4, 9))
        raises(tk.swiglu_forward, a, a.half())
    assert f"loom.kernels.{kernel}.triton" in sys.modules  # the op really went through Triton
    print("ok", kernel)
""")


@pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
@pytest.mark.parametrize("kernel", ["rmsnorm", "rope", "swiglu"])
def test_triton_kernel_under_the_interpreter(kernel):
    assert f"ok {kernel}" in interpret(INTERPRETER_SCRIPT, kernel)

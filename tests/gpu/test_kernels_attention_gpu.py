"""Triton FlashAttention on CUDA against an fp32 reference: outputs and gradients for many shapes
(odd lengths, GQA 1/4/8, head dims 64/128, packed documents with boundaries anywhere and padding rows,
sliding windows), bf16 and fp16. Our error must be <= 2x PyTorch's SDPA error in the same dtype (+ atol)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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


def _docs(b, s, gen):
    """Random document boundaries anywhere, and a run of padding (id -1) in the first row."""
    cuts = torch.rand(b, s, generator=gen) < 0.004
    ids = cuts.cumsum(1)
    ids[0, s // 3 : s // 3 + 17] = -1
    return ids


def _rel_err(x, ref, rows):
    return ((x.float() - ref)[rows].abs().max() / ref[rows].abs().max().clamp_min(1e-6)).item()


@pytest.fixture(scope="module")
def two_configs_per_kernel():
    """Autotuning every shape x dtype over all candidates compiles hundreds of kernels (minutes): these
    cases tune over two configs per kernel, with different block sizes so both the masked and unmasked
    block paths run at different splits. The other tests here use the full candidate lists."""
    from loom.kernels.attention import triton as T

    saved = T._FWD_CONFIGS, T._DKDV_CONFIGS, T._DQ_CONFIGS
    T._FWD_CONFIGS = [(128, 64, 8, 3), (64, 64, 4, 4)]
    T._DKDV_CONFIGS = [(64, 128, 8, 3), (32, 64, 4, 4)]
    T._DQ_CONFIGS = [(128, 64, 8, 3), (64, 64, 4, 3)]
    T._TUNED.clear()
    yield
    T._FWD_CONFIGS, T._DKDV_CONFIGS, T._DQ_CONFIGS = saved
    T._TUNED.clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_flash_attention_matches_reference(case, dtype, two_configs_per_kernel):
    from loom.kernels.attention import reference as R
    from loom.kernels.attention.op import flash_attention

    b, hq, hk, s, d, causal, docs, window = case
    gen = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(b, h, s, d, generator=gen).cuda() for h in (hq, hk, hk))
    bounds = R.document_bounds(_docs(b, s, gen).cuda()) if docs else None
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
    assert _rel_err(out, ref_o, o_rows) <= 2 * _rel_err(base, ref_o, o_rows) + 2e-3
    torch.testing.assert_close(lse[rows], ref_lse[rows], atol=2e-2, rtol=0)
    for name, mine, theirs, ref in zip("qkv", [t.grad for t in x], [t.grad for t in y], ref_g):
        everything = torch.ones_like(ref, dtype=torch.bool)
        assert _rel_err(mine, ref, everything) <= 2 * _rel_err(theirs, ref, everything) + 5e-3, name


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


def test_model_trains_with_flash_on_packed_documents(tmp_path):
    from tests.distributed.harness import run_one

    cfg = {
        "run.dir": str(tmp_path / "run"),
        "run.device": "cuda",
        "training.steps": 6,
        "training.seq_len": 256,
        "training.global_batch_size": 8,
        "training.micro_batch_size": 4,
        "optimizer.warmup_steps": 1,
        "metrics.every": 1,
        "checkpoint.at_end": "false",
        "metrics.tensorboard": "false",
        "training.dtype": "bfloat16",
        "data.document_positions": "true",
        "model.flavor": "125M",
        "model.n_layers": 2,
    }
    flash = run_one(dict(cfg, **{"model.attention": "flash"}))
    sdpa = run_one(dict(cfg, **{"model.attention": "sdpa", "run.dir": str(tmp_path / "run2")}))
    for a, b in zip(flash, sdpa):
        assert abs(a["loss"] - b["loss"]) < 2e-2 * abs(b["loss"]), (a["loss"], b["loss"])


def test_auto_attention_is_timed_on_the_device_at_start_up(tmp_path):
    """model.attention = auto on CUDA (no documents): the trainer times pinned SDPA backends and ours on the run's shape,
    writes the figures to kernels.json and builds the model with the faster; deterministic runs skip it."""
    import json
    import math

    from tests.distributed.harness import run_one

    cfg = {
        "run.dir": str(tmp_path / "run"),
        "run.device": "cuda",
        "training.steps": 2,
        "training.seq_len": 512,
        "training.global_batch_size": 4,
        "training.micro_batch_size": 2,
        "optimizer.warmup_steps": 1,
        "checkpoint.at_end": "false",
        "metrics.tensorboard": "false",
        "training.dtype": "bfloat16",
        "model.flavor": "125M",
        "model.n_layers": 2,
    }
    run_one(cfg)
    with open(tmp_path / "run" / "kernels.json") as f:
        measured = json.load(f)
    times = measured["ms_fwd_bwd"]
    # loom's kernel, SDPA pinned to FlashAttention-2 (sm_80+) and to cuDNN where PyTorch's check takes it
    assert {"flash", "sdpa_flash"} <= set(times) <= {"flash", "sdpa_flash", "sdpa_cudnn"}
    assert all(math.isfinite(t) and t > 0 for t in times.values())
    assert measured["chosen"] == min(times, key=times.get)
    assert measured["verdict"].startswith(f"{measured['chosen']} won, ")
    assert measured["shape"] == "2x12/4x512x64 bfloat16"
    run_one(
        dict(
            cfg,
            **{"run.dir": str(tmp_path / "det"), "run.deterministic": "true", "training.dtype": "float32"},
        )
    )
    assert not (tmp_path / "det" / "kernels.json").exists()


def test_auto_timing_counts_the_gpus_time_not_the_launch_path():
    """A call that keeps the CPU busy 5 ms but the GPU only microseconds: back-to-back timing would report
    >= 5 ms (the CPU-bound case that made ``auto`` see loom's kernel at 1.5 ms instead of its 0.8 ms)."""
    import time

    from loom.kernels.dispatch import time_fwd_bwd

    x = torch.randn(64, device="cuda", requires_grad=True)

    def slow_to_issue(t):
        time.sleep(0.005)
        return t * 2

    assert time_fwd_bwd(slow_to_issue, [x], warmup=1, iters=5) < 2.5


# what PyTorch's SDPA picks in a fresh process after one plain SDPA call: its backend order and its choice for a
# masked GQA call (transformers' compiled Llama passes a mask), with or without loom's SDPA path run first
_SDPA_STATE = """
import sys, torch, torch.nn.functional as F
q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
if sys.argv[1] != "torch":  # loom's SDPA path ("sdpa", or pinned to one backend) on an MHA call first
    from loom.models.common.layers import attend
    attend(q, q, q, sys.argv[1], None).sum().backward()
F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True).sum().backward()
mask = torch.ones(256, 256, device="cuda", dtype=torch.bool).tril()
print(torch._C._get_sdp_priority_order(), torch._fused_sdp_choice(q, k, k, attn_mask=mask, enable_gqa=True))
"""


def test_loom_sdpa_leaves_pytorchs_backend_choice_alone():
    """loom's SDPA path must not change which backend PyTorch picks for other code in the process (a
    set_priority context did: after it transformers' compiled model ran memory-efficient attention)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))  # the repository root
    out = {
        who: subprocess.run(
            [sys.executable, "-c", _SDPA_STATE, who], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        for who in ("torch", "sdpa", "sdpa_flash", "sdpa_cudnn")
    }
    assert out["sdpa"] == out["sdpa_flash"] == out["sdpa_cudnn"] == out["torch"], out


@pytest.mark.parametrize("backend, op", [("sdpa_cudnn", "cudnn"), ("sdpa_flash", "flash")])
def test_pinned_sdpa_runs_its_backend_and_matches_sdpa(backend, op):
    """model.attention = sdpa_cudnn / sdpa_flash: the call runs that backend's op (forward and backward, eager and
    compiled) with SDPA's outputs and gradients (bf16 tolerance), MHA and GQA."""
    import contextlib

    from loom.kernels.dispatch import torch_takes
    from loom.models.common.layers import attend

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator(device="cuda").manual_seed(0)
    for hq, hkv in ((8, 8), (8, 2)):
        q, k, v = (
            torch.randn(2, h, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
            for h in (hq, hkv, hkv)
        )
        if not torch_takes(backend, q, k, v):
            pytest.skip(f"PyTorch's check refuses {backend} here (GPU, cuDNN version, GQA)")
        dout = torch.randn(2, hq, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        results = {}
        for name, fn in (
            ("sdpa", lambda a, b, c: attend(a, b, c, "sdpa", None)),
            (backend, lambda a, b, c: attend(a, b, c, backend, None)),
            ("compiled", torch.compile(lambda a, b, c: attend(a, b, c, backend, None), fullgraph=True)),
        ):
            ops = Ops()
            with ops if name == backend else contextlib.nullcontext():  # no dispatch mode under compile
                out = fn(q, k, v)
                grads = torch.autograd.grad(out, (q, k, v), dout)
            results[name] = (out, *grads)
            if name == backend:
                assert f"aten._scaled_dot_product_{op}_attention.default" in ops.seen, ops.seen
                assert f"aten._scaled_dot_product_{op}_attention_backward.default" in ops.seen, ops.seen
        for name in (backend, "compiled"):
            for a, b in zip(results[name], results["sdpa"]):
                torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_model_trains_with_pinned_sdpa(tmp_path):
    """model.attention = sdpa_cudnn / sdpa_flash by hand: the losses of a short run match PyTorch's own choice's."""
    from tests.distributed.harness import run_one

    cfg = {
        "run.dir": str(tmp_path / "sdpa"),
        "run.device": "cuda",
        "training.steps": 4,
        "training.seq_len": 256,
        "training.global_batch_size": 4,
        "training.micro_batch_size": 2,
        "optimizer.warmup_steps": 1,
        "metrics.every": 1,
        "checkpoint.at_end": "false",
        "metrics.tensorboard": "false",
        "training.dtype": "bfloat16",
        "model.flavor": "125M",
        "model.n_layers": 2,
        "model.attention": "sdpa",
    }
    from loom.kernels.dispatch import AttentionShape, attention_inputs, torch_takes

    # the 125M flavor's attention (12 query heads over 4 key/value heads, head dim 64): a backend PyTorch's own
    # check does not take for it on this GPU is refused at start-up (check_pinned_sdpa), so it is not trained here
    shape = AttentionShape(1, 12, 4, 256, 64, torch.bfloat16)
    taken = [
        b
        for b in ("sdpa_cudnn", "sdpa_flash")
        if torch_takes(b, *attention_inputs(shape, torch.device("cuda")))
    ]
    if not taken:
        pytest.skip("PyTorch takes neither pinned backend for this attention here")
    base = run_one(cfg)
    for backend in taken:
        got = run_one(dict(cfg, **{"model.attention": backend, "run.dir": str(tmp_path / backend)}))
        for a, b in zip(got, base):
            assert abs(a["loss"] - b["loss"]) < 2e-2 * abs(b["loss"]), (backend, a["loss"], b["loss"])


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
    bounds = R.document_bounds(_docs(b, s, gen).cuda()) if docs else None
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
    assert _rel_err(out, ref_o, o_rows) <= 2 * _rel_err(base, ref_o, o_rows) + 2e-3
    for name, mine, theirs, ref in zip("qkv", [t.grad for t in x], [t.grad for t in y], ref_g):
        everything = torch.ones_like(ref, dtype=torch.bool)
        assert _rel_err(mine, ref, everything) <= 2 * _rel_err(theirs, ref, everything) + 5e-3, name


def test_model_trains_with_flex_eager_and_compiled_and_auto_times_it_on_documents(tmp_path):
    """Packed documents: flex (eager, compiled model) gives the losses flash gives; auto times flash vs flex on the
    run's first micro-batch and picks the faster."""
    import json
    import math

    from tests.distributed.harness import run_one

    cfg = {
        "run.device": "cuda",
        "training.steps": 4,
        "training.seq_len": 512,
        "training.global_batch_size": 8,
        "training.micro_batch_size": 4,
        "optimizer.warmup_steps": 1,
        "metrics.every": 1,
        "checkpoint.at_end": "false",
        "metrics.tensorboard": "false",
        "training.dtype": "bfloat16",
        "data.document_positions": "true",
        "model.flavor": "125M",
        "model.n_layers": 2,
    }
    runs = {
        name: run_one(dict(cfg, **{"run.dir": str(tmp_path / name), **extra}))
        for name, extra in (
            ("flash", {"model.attention": "flash"}),
            ("flex", {"model.attention": "flex"}),
            ("flex_compiled", {"model.attention": "flex", "training.compile": "true"}),
            ("flex_op_ac", {"model.attention": "flex", "training.activation_checkpointing": "op"}),
            (
                "flex_compiled_full_ac",
                {
                    "model.attention": "flex",
                    "training.compile": "true",
                    "training.activation_checkpointing": "full",
                },
            ),
            (
                "flex_compiled_every_k",
                {
                    "model.attention": "flex",
                    "training.compile": "true",
                    "training.activation_checkpointing": "every_k",
                },
            ),
            ("auto", {}),
            ("auto_compiled_op_ac", {"training.compile": "true", "training.activation_checkpointing": "op"}),
        )
    }
    for name in (
        "flex",
        "flex_compiled",
        "flex_op_ac",
        "flex_compiled_full_ac",
        "flex_compiled_every_k",
        "auto",
        "auto_compiled_op_ac",
    ):
        for a, b in zip(runs[name], runs["flash"]):
            assert abs(a["loss"] - b["loss"]) < 2e-2 * abs(b["loss"]), (name, a["loss"], b["loss"])
    with open(tmp_path / "auto" / "kernels.json") as f:
        measured = json.load(f)
    times = measured["ms_fwd_bwd"]
    assert set(times) == {"flash", "flex"} and all(math.isfinite(t) and t > 0 for t in times.values())
    assert measured["chosen"] == min(times, key=times.get)
    assert not (
        tmp_path / "auto_compiled_op_ac" / "kernels.json"
    ).exists()  # flash without timing (Flex refused)


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
def test_context_parallel_attention_through_the_triton_kernels(tmp_path, docs):
    """Context-parallel attention on one GPU (a 1-rank NCCL group: both chunks local, three key blocks
    merged by their log-sum-exps) against the kernel on the whole sequence, bf16, GQA; gradients too.
    ``docs``: packed documents crossing the chunk boundary (the off-diagonal block runs the kernel with
    separate query-side and key-side bounds). Across ranks the same code is tested on CPU
    (tests/distributed/test_context_parallel.py)."""
    import torch.distributed as dist

    from loom.kernels.attention.op import flash_attention
    from loom.kernels.attention.reference import doc_ids_from_positions
    from loom.parallel.context_parallel import ContextParallel

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        gen = torch.Generator().manual_seed(5)
        q, k, v, dout = (torch.randn(2, h, 2048, 128, generator=gen).cuda().bfloat16() for h in (8, 2, 2, 8))
        # q/k/v as the model passes them: (B, S, H, D) transposed to (B, H, S, D)
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v))
        whole = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        positions = None
        if docs:  # documents of ~300 tokens on average, boundaries anywhere
            starts = torch.rand(2, 2048, generator=gen) < 1 / 300
            starts[:, 0] = True
            idx = torch.arange(2048).expand(2, 2048)
            positions = (idx - torch.where(starts, idx, 0).cummax(1).values).cuda()
        out = ContextParallel(dist.group.WORLD, 0, 1).attend(q, k, v, positions)
        out.backward(dout)
        ids = None if positions is None else doc_ids_from_positions(positions)
        ref = flash_attention(*whole, causal=True, doc_ids=ids)
        ref.backward(dout)
        assert not out.isnan().any()
        for got, want in [(out, ref)] + [(a.grad, b.grad) for a, b in zip((q, k, v), whole)]:
            assert _rel_err(got, want.float(), torch.ones_like(want, dtype=torch.bool)) < 2e-2
    finally:
        dist.destroy_process_group()


HOPPER_CASES = [  # (B, Hq, Hkv, S, D, causal, model layout (B, S, H, D) seen as (B, H, S, D), packed documents)
    (2, 4, 4, 1000, 64, True, False, False),
    (1, 4, 4, 777, 128, True, True, False),
    (2, 2, 2, 1024, 128, False, False, False),
    (1, 8, 8, 300, 64, False, True, False),
    (2, 2, 2, 64, 128, True, False, False),
    (1, 2, 2, 129, 64, True, True, False),
    (1, 8, 2, 1000, 64, True, True, False),
    (2, 8, 1, 333, 128, True, False, False),
    (1, 16, 2, 2048, 128, True, True, False),
    (1, 4, 1, 517, 64, False, True, False),
    (2, 4, 4, 1000, 64, True, False, True),
    (1, 8, 2, 777, 128, True, True, True),
    (2, 2, 2, 1024, 128, False, False, True),
    (1, 16, 2, 2048, 128, True, True, True),
    (2, 4, 1, 517, 64, True, False, True),
]


def _packed_bounds(b: int, s: int, gen: torch.Generator) -> torch.Tensor:
    """Document bounds of random packed documents (1-400 tokens, boundaries anywhere) and a padded tail."""
    from loom.kernels.attention.reference import document_bounds

    ids = torch.cumsum(torch.rand(b, s, generator=gen) < 1 / 150, dim=1)
    ids[:, s - s // 10 :] = -1  # padding: sees nothing, seen by nothing
    return document_bounds(ids.cuda())


def _check_hopper_forward(q, k, v, causal, bounds, scale, triton_out, triton_lse) -> None:
    """Each Gluon forward config and the autotuned choice: out within twice the Triton forward's error against
    the fp32 reference (plus 1e-3), lse within 1e-4 of the reference, -inf exactly on the rows that see nothing."""
    from loom.kernels.attention import reference as R
    from loom.kernels.attention import triton as T
    from loom.kernels.attention.hopper import launch as hopper

    ref_out, ref_lse = R.attention_forward(q.float(), k.float(), v.float(), causal, bounds, 0, scale)
    seen = torch.isfinite(ref_lse)
    triton_err = (triton_out.float() - ref_out).abs()[seen].max().item()
    for config in [*hopper._CONFIGS["fwd"], None]:
        out, lse = torch.full_like(q, float("nan")), torch.full_like(triton_lse, float("nan"))
        hopper.forward(q, k, v, out, lse, causal, bounds, scale, T.seq_key(q.shape[2]), config=config)
        assert not out.isnan().any() and not lse.isnan().any(), config
        err = (out.float() - ref_out).abs()[seen].max().item()
        assert err <= 2 * triton_err + 1e-3, (config, err, triton_err)
        assert torch.equal(torch.isfinite(lse), seen), config
        torch.testing.assert_close(lse[seen], ref_lse[seen], atol=1e-4, rtol=1e-4, msg=f"lse {config}")
        assert (out[~seen] == 0).all(), config


def _check_item_groups(q, k, v, do, lse2, delta, causal, bounds, scale) -> None:
    """The persistent forward and dQ walking the (batch, head) pairs in groups (``heads_per_group``: L2-sized
    (None), 3 (a smaller last group on most cases), 1) compute every item as when all pairs go in one group:
    outputs bit-identical."""
    from loom.kernels.attention import triton as T
    from loom.kernels.attention.hopper import launch as hopper

    key = T.seq_key(q.shape[2])
    results = {}
    everything = q.shape[0] * q.shape[1]
    for group in (everything, None, 3, 1):
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        hopper.forward(q, k, v, out, lse, causal, bounds, scale, key, heads_per_group=group)
        dq = torch.empty_like(q)
        hopper.dq(q, k, v, do, lse2, delta, dq, causal, bounds, scale, key, heads_per_group=group)
        results[group] = (out, lse, dq)
    for group in (None, 3, 1):
        for name, got, want in zip(("out", "lse", "dq"), results[group], results[everything]):
            assert torch.equal(got, want), (name, group)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="sm_90"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: "x".join(map(str, c)))
def test_hopper_kernels_match_the_triton_kernels(case, dtype, two_configs_per_kernel):
    """The warp-specialized Gluon dK/dV and dQ kernels (every candidate config and the autotuned choice) against
    the Triton kernels on the same inputs: the same arithmetic in the same order, so equal up to rounding. The
    Gluon forward (other blocks than the Triton forward's, so another rounding) against an fp32 reference: its
    error within twice the Triton forward's, the same rows empty."""
    from loom.kernels import dispatch
    from loom.kernels.attention import triton as T
    from loom.kernels.attention.hopper import launch as hopper

    b, hq, hk, s, d, causal, model_layout, docs = case
    gen = torch.Generator().manual_seed(s)
    q, k, v, do = (
        torch.randn(*((b, s, h, d) if model_layout else (b, h, s, d)), generator=gen).cuda().to(dtype)
        for h in (hq, hk, hk, hq)
    )
    if model_layout:
        q, k, v, do = (t.transpose(1, 2) for t in (q, k, v, do))
    bounds = _packed_bounds(b, s, gen) if docs else None
    assert dispatch.backward_kernels(q, k, v, do, bounds, None, 0)[0].startswith("hopper")  # Gluon takes it
    scale = d**-0.5
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    T.triton_forward(
        q, k, v, out, lse, causal, bounds, 0, scale
    )  # the Triton kernel (dispatch would pick Gluon)
    delta, lse2 = T.backward_preprocess(do, out, lse, None)
    _check_hopper_forward(q, k, v, causal, bounds, scale, out, lse)
    tk, tv = torch.empty_like(k), torch.empty_like(v)
    T.triton_dkdv(do, q, k, v, lse2, delta, tk, tv, causal, bounds, 0, scale)
    tq = torch.empty_like(q)
    T.triton_dq(do, q, k, v, lse2, delta, tq, causal, bounds, 0, scale)
    for config in [*hopper._CONFIGS["dkdv"], None]:
        gk, gv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        hopper.dkdv(q, k, v, do, lse2, delta, gk, gv, causal, bounds, scale, T.seq_key(s), config=config)
        torch.testing.assert_close(gk, tk, atol=1e-3, rtol=1e-3, msg=f"dk {config}")
        torch.testing.assert_close(gv, tv, atol=1e-3, rtol=1e-3, msg=f"dv {config}")
    for config, pairs in [(c, None) for c in [*hopper._CONFIGS["dkdv_p"], None]] + [(None, 1), (None, 3)]:
        gk, gv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))  # the persistent variant
        hopper.dkdv(
            q,
            k,
            v,
            do,
            lse2,
            delta,
            gk,
            gv,
            causal,
            bounds,
            scale,
            T.seq_key(s),
            config=config,
            persistent=True,
            pairs_per_group=pairs,
        )
        torch.testing.assert_close(gk, tk, atol=1e-3, rtol=1e-3, msg=f"persistent dk {config} {pairs}")
        torch.testing.assert_close(gv, tv, atol=1e-3, rtol=1e-3, msg=f"persistent dv {config} {pairs}")
    for config in [*hopper._CONFIGS["dq"], None]:
        gq = torch.full_like(q, float("nan"))
        hopper.dq(q, k, v, do, lse2, delta, gq, causal, bounds, scale, T.seq_key(s), config=config)
        torch.testing.assert_close(gq, tq, atol=1e-3, rtol=1e-3, msg=f"dq {config}")
    _check_item_groups(q, k, v, do, lse2, delta, causal, bounds, scale)

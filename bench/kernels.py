"""Attention kernels on one GPU: loom's Triton FlashAttention-2 vs PyTorch SDPA (flash and cuDNN backends),
FlexAttention (compiled, block masks) and the plain PyTorch reference; forward and forward+backward
TFLOP/s. Packed documents count useful FLOPs only (each document's own causal square). Where the suite lists
``auto``, each case also runs ``model.attention = auto``'s start-up timing (loom.kernels.dispatch.measure_attention
through the model's attention call) and reports its choice and that choice's figures against cuDNN's from the same
rounds: the bar is auto >= 1.0x cuDNN forward+backward on every case (``bar_verdict``).

    python -m bench.kernels --suite bar  --out bench/results/kernels_bar_h100.json
    python -m bench.kernels --suite docs --out bench/results/kernels_docs_h100.json
    python -m bench.kernels --suite causal --tensor-desc --out bench/results/kernels_tensor_desc_h200.json

``--tensor-desc`` times loom's portable Triton kernels themselves (called directly: on Hopper ``loom`` runs the Gluon
kernels where they take the call) with plain pointers and with tensor descriptors on the suite's cases, side by
side: the measurement that decides whether descriptors become the default.

FLOPs: 4·B·H·S²·D forward (half of it when causal), ×3.5 for forward+backward (backward = 2.5× forward).
Every row holds the ratios against the baselines of the same run. Each backend is timed in two rounds (the
order reversed in the second; the faster round counts) with q/k/v gradients reset before every call.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.common import bench_ms, command, default_commit, environment

TOKENS = 32768  # batch x sequence per measurement (16 x 2048, 4 x 8192)


def attention_flops(b: int, h: int, d: int, doc_lens: list[list[int]] | None, s: int, causal: bool) -> float:
    if doc_lens is not None:  # useful work: each document attends causally within itself
        return sum(4 * h * n * n * d / 2 for row in doc_lens for n in row)
    return 4 * b * h * s * s * d / (2 if causal else 1)


def random_doc_lens(b: int, s: int, gen: torch.Generator, lo: int = 256, hi: int = 2048) -> list[list[int]]:
    rows = []
    for _ in range(b):
        lens, left = [], s
        while left > 0:
            n = min(left, int(torch.randint(lo, hi + 1, (1,), generator=gen)))
            lens.append(n)
            left -= n
        rows.append(lens)
    return rows


def doc_ids(doc_lens: list[list[int]], device) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in doc_lens]).to(
        device
    )


# --------------------------------------------------------------------------------------------- backends
def loom_fn(q, k, v, causal, ids):
    from loom.kernels.attention import reference as R
    from loom.kernels.attention.op import flash_attention

    bounds = R.document_bounds(ids) if ids is not None else None
    return lambda: flash_attention(q, k, v, causal=causal, bounds=bounds)


class _TritonAttention(torch.autograd.Function):
    """loom's Triton forward and backward kernels as one autograd call, without dispatch (which on Hopper would
    run the Gluon kernels instead)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, bounds, tensor_desc):
        from loom.kernels.attention import triton as T

        scale = q.shape[-1] ** -0.5
        out, lse = T.attention_forward(q, k, v, causal, bounds, 0, scale, tensor_desc=tensor_desc)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = causal, bounds, scale, tensor_desc
        return out

    @staticmethod
    def backward(ctx, dout):
        from loom.kernels.attention import triton as T

        causal, bounds, scale, tensor_desc = ctx.args
        dq, dk, dv = T.attention_backward(
            dout, *ctx.saved_tensors, None, causal, bounds, 0, scale, tensor_desc=tensor_desc
        )
        return dq, dk, dv, None, None, None


def triton_fn(tensor_desc: bool):
    """loom's portable Triton kernels, plain pointers or (``tensor_desc``) tensor descriptors."""

    def make(q, k, v, causal, ids):
        from loom.kernels.attention import reference as R

        bounds = R.document_bounds(ids) if ids is not None else None
        return lambda: _TritonAttention.apply(q, k, v, causal, bounds, tensor_desc)

    return make


def sdpa_fn(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[backend]

    def make(q, k, v, causal, ids):
        gqa = q.shape[1] != k.shape[1]
        mask = None
        if ids is not None:
            from loom.kernels.attention import reference as R

            mask = R.visible(q.shape[2], causal, R.document_bounds(ids), 0, q.device)

        def run():
            with sdpa_kernel([kind]):
                if mask is not None:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        return run

    return make


def flex_fn(q, k, v, causal, ids):
    """FlexAttention compiled for this one shape. A single torch.compile(flex_attention) reused across shapes
    turns dynamic after the second shape and runs much slower kernels: the first version of this script
    did that, and its Flex figures for every shape after the second were too low."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    b, _, s, _ = q.shape
    if ids is not None:

        def mask_mod(bi, h, qi, ki):
            return (ids[bi, qi] == ids[bi, ki]) & (qi >= ki)

        block = create_block_mask(mask_mod, b, None, s, s, device=q.device)
    elif causal:
        block = create_block_mask(lambda bi, h, qi, ki: qi >= ki, None, None, s, s, device=q.device)
    else:
        block = None
    gqa = q.shape[1] != k.shape[1]
    return lambda: flex(q, k, v, block_mask=block, enable_gqa=gqa)


def reference_fn(q, k, v, causal, ids):
    from loom.kernels.attention import reference as R

    bounds = R.document_bounds(ids) if ids is not None else None
    scale = q.shape[-1] ** -0.5
    group = q.shape[1] // k.shape[1]

    def run():  # plain PyTorch in the input dtype (autograd through matmul + masked softmax)
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = (q @ kk.transpose(-1, -2)) * scale
        s = s.masked_fill(~R.visible(q.shape[2], causal, bounds, 0, q.device), float("-inf"))
        return torch.softmax(s.float(), -1).to(q.dtype) @ vv

    return run


def fa4_fn(q, k, v, causal, ids):
    """FlashAttention-4 (the ``flash-attn-4`` package: CuTe DSL kernels for Hopper and Blackwell, forward and
    backward) through loom's ``loom::fa4`` op (``model.attention = fa4``), on the (B, S, H, D) views it reads."""
    if ids is not None:
        raise NotImplementedError("packed documents: loom's fa4 op runs plain causal attention only")
    from loom.kernels.attention.fa4 import fa4_attention

    return lambda: fa4_attention(q, k, v, causal=causal)


BACKENDS = {
    "loom": loom_fn,
    "sdpa_flash": sdpa_fn("flash"),
    "sdpa_cudnn": sdpa_fn("cudnn"),
    "sdpa_efficient": sdpa_fn("efficient"),
    "flex": flex_fn,
    "torch_reference": reference_fn,
    "triton_plain": triton_fn(False),
    "triton_desc": triton_fn(True),
    "fa4": fa4_fn,
}
EXTRA = ("fa4", "sdpa_efficient", "torch_reference")  # --with: backends a suite may add to its own
VARIANTS = ["triton_plain", "triton_desc"]  # --tensor-desc: the backends it times instead of the suite's


ROUNDS = 2  # every backend is timed once per round, the order reversed each round; the faster round counts


def prepare(name, q, k, v, causal, ids):
    """(forward, forward+backward) callables of one backend; raises when the backend does not support the case."""
    fwd = BACKENDS[name](q, k, v, causal, ids)
    dout = torch.randn_like(fwd())

    def fwd_bwd():
        fwd().backward(dout)

    fwd_bwd()
    for t in (q, k, v):
        t.grad = None
    return fwd, fwd_bwd


def timed(fwd, fwd_bwd, q, k, v) -> dict:
    res = {"fwd_ms": bench_ms(fwd), "fwd_bwd_ms": bench_ms(fwd_bwd, grads=[q, k, v])}
    for t in (q, k, v):
        t.grad = None
    return res


def loom_configs() -> dict:
    """The configs loom's autotuners chose for the shape measured last: the Triton kernels' and, on Hopper, the
    Gluon kernels' (keys prefixed ``gluon_``; their candidates differ by 3-7% at some shapes, so a pick is worth
    knowing when two runs disagree)."""
    from loom.kernels.attention import triton as T
    from loom.kernels.triton_support import has_gluon_hopper

    configs = {kind: str(kernel.best_config) for kind, kernel in T._TUNED.items()}
    if has_gluon_hopper():
        from loom.kernels.attention.hopper import launch as hopper

        for kind, kernel in hopper._TUNED.items():
            configs[f"gluon_{kind}"] = str(kernel.best_config)
    return configs


def measure_all(backends: list[str], q, k, v, causal, ids) -> dict:
    """Each backend's best forward and forward+backward time over ROUNDS rounds (alternating order, so that
    no backend always runs on a GPU the previous one just heated), plus each round's figures."""
    ready, results = {}, {}
    for name in backends:
        try:
            ready[name] = prepare(name, q, k, v, causal, ids)
        except (
            Exception
        ) as e:  # a backend that does not support the case (e.g. cuDNN + GQA) is reported, not fatal
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            for t in (q, k, v):
                t.grad = None
        torch.cuda.empty_cache()
    rounds: dict[str, list[dict]] = {name: [] for name in ready}
    for i in range(ROUNDS):
        for name in list(ready) if i % 2 == 0 else list(reversed(ready)):
            rounds[name].append(timed(*ready[name], q, k, v))
            if name == "loom" or name in VARIANTS:
                rounds[name][-1]["configs"] = loom_configs()
    for name, rs in rounds.items():
        best = min(rs, key=lambda r: r["fwd_bwd_ms"])
        results[name] = {
            "fwd_ms": min(r["fwd_ms"] for r in rs),
            "fwd_bwd_ms": best["fwd_bwd_ms"],
            "rounds": rs,
        }
    return {name: results[name] for name in backends if name in results}


# model.attention = auto's backend names -> the backends of this script that run the same kernels
AUTO_AS = {
    "flash": "loom",
    "sdpa_cudnn": "sdpa_cudnn",
    "sdpa_flash": "sdpa_flash",
    "fa4": "fa4",
    "flex": "flex",
}


def positions_from_ids(ids: torch.Tensor) -> torch.Tensor:
    """Per-document positions (B, S) of packed documents' ids (B, S): 0 where a document starts."""
    idx = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return idx - torch.where(starts, idx, 0).cummax(1).values


def auto_choice(q: torch.Tensor, k: torch.Tensor, ids: torch.Tensor | None) -> dict:
    """What ``model.attention = auto`` chooses for this case (causal): the trainer's start-up timing on the case's
    shape and documents, its figures (ms per forward+backward) and the line the run prints."""
    from loom.kernels.dispatch import AttentionShape, describe_choice, fastest, measure_attention
    from loom.models.common.layers import attend

    b, hq, s, d = q.shape
    shape = AttentionShape(b, hq, k.shape[1], s, d, q.dtype)
    positions = None if ids is None else positions_from_ids(ids)
    times = measure_attention(attend, shape, q.device, positions)
    return {"startup_ms_fwd_bwd": times, "chosen": fastest(times), "verdict": describe_choice(times)}


def cudnn_ratios(row: dict) -> dict:
    """Forward+backward against SDPA-cuDNN in one case (its time over theirs): loom's kernel's, and ``auto``'s
    choice's (the same kernel's figures from the same rounds; n/a where cuDNN, or the choice, did not run here)."""
    backends = row["backends"]
    cudnn = backends.get("sdpa_cudnn", {}).get("fwd_bwd_ms")
    out = {}
    if cudnn is None:
        return out
    if "fwd_bwd_ms" in backends.get("loom", {}):
        out["loom"] = cudnn / backends["loom"]["fwd_bwd_ms"]
    auto = row.get("auto")
    if auto is not None:
        same = backends.get(AUTO_AS.get(auto["chosen"], ""), {})
        if "fwd_bwd_ms" in same:
            out["auto"] = cudnn / same["fwd_bwd_ms"]
    return out


def bar_verdict(rows: list[dict], bar: float = 1.0) -> str:
    """One line: whether ``auto`` reached ``bar`` x cuDNN forward+backward on every case that timed both, with the
    lowest ratios of auto and of loom's kernel (a case with no auto figure fails the bar)."""
    autos, looms, missing = [], [], 0
    for r in rows:
        rat = cudnn_ratios(r)
        if "sdpa_cudnn" not in r["backends"] or "fwd_bwd_ms" not in r["backends"]["sdpa_cudnn"]:
            continue  # cuDNN did not run this case: nothing to hold auto against
        if "auto" in rat:
            autos.append(rat["auto"])
        else:
            missing += 1
        if "loom" in rat:
            looms.append(rat["loom"])
    if not autos and not missing:
        return "bar (auto >= 1.0x cuDNN): no case timed both"
    ok = not missing and min(autos) >= bar
    worst = f"lowest auto ÷ cuDNN {min(autos):.2f}" if autos else "no auto figure"
    loom = f", loom's kernel ÷ cuDNN {min(looms):.2f}-{max(looms):.2f}" if looms else ""
    gaps = f", {missing} case(s) without an auto figure" if missing else ""
    return (
        f"bar (auto >= {bar:.1f}x cuDNN fwd+bwd on every case): {'PASS' if ok else 'FAIL'} "
        f"({worst} over {len(autos) + missing} cases{gaps}{loom})"
    )


def run_case(d: int, hq: int, hkv: int, s: int, causal: bool, docs: bool, backends: list[str], dtype) -> dict:
    b = TOKENS // s
    gen = torch.Generator().manual_seed(s)
    q, k, v = (
        torch.randn(b, h, s, d, generator=gen).to("cuda", dtype).requires_grad_() for h in (hq, hkv, hkv)
    )
    lens = random_doc_lens(b, s, gen) if docs else None
    ids = doc_ids(lens, "cuda") if docs else None
    flops = attention_flops(b, hq, d, lens, s, causal)
    row = {
        "head_dim": d,
        "heads": hq,
        "kv_heads": hkv,
        "seq": s,
        "batch": b,
        "causal": causal,
        "docs": docs,
        "flops_fwd": flops,
        "backends": {},
    }
    if docs:
        row["doc_lens_range"] = [min(min(r) for r in lens), max(max(r) for r in lens)]
    if "auto" in backends and causal:
        row["auto"] = auto_choice(q, k, ids)
        torch.cuda.empty_cache()
        print(f"d{d} h{hq}/{hkv} s{s} auto: {row['auto']['verdict']}", flush=True)
    # S x S scores in memory; auto runs no kernel of its own (its choice's figures are that backend's)
    names = [n for n in backends if n != "auto" and not (n == "torch_reference" and s > 4096)]
    for name, r in measure_all(names, q, k, v, causal, ids).items():
        if "fwd_ms" in r:
            r["fwd_tflops"] = flops / r["fwd_ms"] / 1e9
            r["fwd_bwd_tflops"] = 3.5 * flops / r["fwd_bwd_ms"] / 1e9
        row["backends"][name] = r
        print(
            f"d{d} h{hq}/{hkv} s{s} {'causal' if causal else 'full'}{' docs' if docs else ''} {name}: "
            + (
                f"fwd {r['fwd_tflops']:.0f} fwd+bwd {r['fwd_bwd_tflops']:.0f} TFLOP/s"
                if "fwd_ms" in r
                else r["error"]
            ),
            flush=True,
        )
    ours = row["backends"].get("loom", {})
    if "fwd_bwd_tflops" in ours:
        row["ratios_fwd_bwd"] = {
            n: ours["fwd_bwd_tflops"] / r["fwd_bwd_tflops"]
            for n, r in row["backends"].items()
            if n != "loom" and "fwd_bwd_tflops" in r
        }
        row["ratios_fwd"] = {
            n: ours["fwd_tflops"] / r["fwd_tflops"]
            for n, r in row["backends"].items()
            if n != "loom" and "fwd_tflops" in r
        }
    if row.get("auto") is not None:
        row["vs_cudnn_fwd_bwd"] = cudnn_ratios(row)
    if set(VARIANTS) <= set(row["backends"]):
        row["desc_speedup"] = desc_speedup(row)
    return row


def desc_speedup(row: dict) -> dict:
    """Plain-pointer time over tensor-descriptor time, forward and forward+backward (> 1: descriptors faster);
    n/a (absent) where either variant failed."""
    plain, desc = (row["backends"].get(n, {}) for n in VARIANTS)
    return {
        key: plain[f"{key}_ms"] / desc[f"{key}_ms"]
        for key in ("fwd", "fwd_bwd")
        if f"{key}_ms" in desc and f"{key}_ms" in plain
    }


def variant_markdown(rows: list[dict]) -> str:
    """The --tensor-desc table: both variants' TFLOP/s and the descriptors' speedup per case, and a verdict line
    (the lowest and highest forward+backward speedup over the cases both ran)."""
    head = (
        "| d | heads q/kv | seq | mask | plain fwd / fwd+bwd | descriptors fwd / fwd+bwd "
        "| speedup fwd | speedup fwd+bwd |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    speedups = []
    for r in rows:
        cells = []
        for n in VARIANTS:
            x = r["backends"].get(n, {})
            cells.append(f"{x['fwd_tflops']:.0f} / {x['fwd_bwd_tflops']:.0f}" if "fwd_ms" in x else "n/a")
        up = desc_speedup(r)
        if "fwd_bwd" in up:
            speedups.append(up["fwd_bwd"])
        mask = ("docs " if r["docs"] else "") + ("causal" if r["causal"] else "full")
        lines.append(
            f"| {r['head_dim']} | {r['heads']}/{r['kv_heads']} | {r['seq']} | {mask} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(f"{up[key]:.3f}" if key in up else "n/a" for key in ("fwd", "fwd_bwd"))
            + " |"
        )
    verdict = (
        f"tensor descriptors ÷ plain pointers, forward+backward: {min(speedups):.3f}-{max(speedups):.3f}x "
        f"over {len(speedups)} of {len(rows)} cases (> 1: descriptors faster)"
        if speedups
        else "tensor descriptors ÷ plain pointers: no case ran both"
    )
    return "\n".join(lines + ["", verdict])


SUITES = {
    # (head dim, q heads, kv heads) x sequences, causal and full
    "causal": dict(
        dims=[(64, 32, 32), (128, 16, 16)],
        seqs=[1024, 2048, 4096, 8192, 16384],
        causal=[True],
        docs=False,
        backends=["loom", "sdpa_flash", "sdpa_cudnn", "flex", "torch_reference"],
    ),
    "full": dict(
        dims=[(64, 32, 32), (128, 16, 16)],
        seqs=[2048, 8192],
        causal=[False],
        docs=False,
        backends=["loom", "sdpa_flash", "sdpa_cudnn", "flex"],
    ),
    "gqa": dict(
        dims=[(64, 32, 8), (128, 32, 8), (128, 32, 4)],
        seqs=[2048, 8192],
        causal=[True],
        docs=False,
        backends=["loom", "sdpa_flash", "sdpa_cudnn", "flex"],
    ),
    "docs": dict(
        dims=[(64, 32, 8), (128, 16, 16)],
        seqs=[4096, 8192, 16384],
        causal=[True],
        docs=True,
        backends=["loom", "flex", "sdpa_efficient"],
    ),
    "bar": dict(
        dims=[(64, 32, 32), (128, 16, 16)],
        seqs=[4096, 8192, 16384],
        causal=[True],
        docs=False,
        backends=["loom", "sdpa_flash", "sdpa_cudnn", "flex", "auto"],
    ),
    "quick": dict(
        dims=[(64, 32, 32), (128, 16, 16)],
        seqs=[8192],
        causal=[True],
        docs=False,
        backends=["loom", "sdpa_flash", "sdpa_cudnn", "flex", "auto"],
    ),
}


@dataclass(frozen=True)
class SMLimits:
    """One streaming multiprocessor's limits (defaults: H100/H200, sm_90): 32-bit registers, resident warps, shared
    memory in bytes, resident blocks, the shared memory the hardware reserves per block."""

    regs: int = 65536
    warps: int = 64
    shared: int = 233472
    blocks: int = 32
    reserved_shared: int = 1024


def sm_limits(device=None) -> SMLimits:
    """The current GPU's limits from its properties (the sm_90 defaults for those it does not report)."""
    props, base = torch.cuda.get_device_properties(device), SMLimits()
    return SMLimits(
        regs=getattr(props, "regs_per_multiprocessor", base.regs),
        warps=getattr(props, "max_threads_per_multi_processor", base.warps * 32) // 32,
        shared=getattr(props, "shared_memory_per_multiprocessor", base.shared),
    )


def occupancy(n_regs: int, num_warps: int, shared: int, sm: SMLimits = SMLimits()) -> dict:
    """A compiled kernel's theoretical occupancy (as Nsight Compute's): resident blocks per SM under each limit
    (registers, allocated per warp in units of 256; warps; shared memory plus the per-block reserve; blocks),
    the fraction of the SM's warps they fill and the limit that binds."""
    per_warp = -(-n_regs * 32 // 256) * 256
    limits = {
        "registers": sm.regs // (per_warp * num_warps) if per_warp else sm.blocks,
        "warps": sm.warps // num_warps,
        "shared": sm.shared // (shared + sm.reserved_shared),
        "blocks": sm.blocks,
    }
    limiter = min(limits, key=limits.get)
    blocks = limits[limiter]
    return {"blocks_per_sm": blocks, "occupancy": blocks * num_warps / sm.warps, "limited_by": limiter}


def compiled_occupancy(ck) -> dict | None:
    """``occupancy`` of a Triton ``CompiledKernel`` on the current GPU (None where it reports no registers)."""
    n_regs = getattr(ck, "n_regs", None)
    if n_regs is None:
        return None
    meta = ck.metadata
    return occupancy(n_regs, meta.num_warps, meta.shared, sm_limits())


def config_sweep(
    d: int, hq: int, hkv: int, s: int, dtype, docs: bool = False, extra: dict | None = None
) -> dict:
    """Every autotuning candidate of each backward kernel, one at a time (the other kernel at its first
    candidate): whole-backward time, registers, spills and occupancy of the varied kernel; forward candidates (forward
    time) when ``extra`` names some. Explains what autotuning
    picks and whether a kernel spills."""
    from loom.kernels.attention import reference as R
    from loom.kernels.attention import triton as T

    b = TOKENS // s
    gen = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(b, h, s, d, generator=gen).to("cuda", dtype) for h in (hq, hkv, hkv))
    bounds = R.document_bounds(doc_ids(random_doc_lens(b, s, gen), "cuda")) if docs else None
    scale = d**-0.5
    out, lse = T.attention_forward(q, k, v, True, bounds, 0, scale)
    dout = torch.randn_like(out)
    raw = {"fwd": T._attn_fwd, "dkdv": T._attn_bwd_dkdv, "dq": T._attn_bwd_dq}
    extra = extra or {}
    base = {"fwd": T._FWD_CONFIGS, "dkdv": T._DKDV_CONFIGS, "dq": T._DQ_CONFIGS}
    if extra.get("only"):  # the chosen-by-default first candidate, then the extra ones
        base = {kind: c[:1] for kind, c in base.items()}
    candidates = {kind: c + extra.get(kind, []) for kind, c in base.items()}
    compiled: dict = {}

    class Capture:  # launches the raw kernel and keeps the compiled kernel it returns
        def __init__(self, kind):
            self.kind = kind

        def __getitem__(self, grid):
            def launch(*args, **kw):
                compiled[self.kind] = raw[self.kind][grid](*args, **kw)

            return launch

    chosen = {kind: c[0] for kind, c in candidates.items()}
    original = T._kernel
    rows = []
    try:
        for kind in ("fwd", "dkdv", "dq"):
            if kind == "fwd" and not extra.get("fwd"):
                continue  # forward candidates only when asked for (--extra-fwd)
            for cfg in candidates[kind]:
                pick = dict(chosen, **{kind: cfg})

                def forced(name, pick=pick):
                    m, n, w, st, *cap = pick[name]
                    return Capture(name), {
                        "BLOCK_M": m,
                        "BLOCK_N": n,
                        "num_warps": w,
                        "num_stages": st,
                        **({"maxnreg": cap[0]} if cap else {}),
                    }

                T._kernel = forced
                if kind == "fwd":
                    run = lambda: T.triton_forward(
                        q,
                        k,
                        v,
                        torch.empty_like(out),
                        torch.empty_like(lse),
                        True,
                        bounds,
                        0,
                        scale,
                    )
                else:
                    run = lambda: T.attention_backward(
                        dout,
                        q,
                        k,
                        v,
                        out,
                        lse,
                        None,
                        True,
                        bounds,
                        0,
                        scale,
                    )
                try:
                    run()
                except (
                    Exception
                ) as e:  # a candidate the compiler rejects (ptxas has crashed on some): record it
                    rows.append(
                        {"kernel": kind, "config": list(cfg), "error": f"{type(e).__name__}: {str(e)[:200]}"}
                    )
                    print(dict(d=d, s=s, docs=docs, **rows[-1]), flush=True)
                    continue
                ck = compiled[kind]
                rows.append(
                    {
                        "kernel": kind,
                        "config": list(cfg),
                        ("fwd_ms" if kind == "fwd" else "bwd_ms"): bench_ms(run),
                        "n_regs": getattr(ck, "n_regs", None),
                        "n_spills": getattr(ck, "n_spills", None),
                        "occupancy": compiled_occupancy(ck),
                    }
                )
                print(dict(d=d, s=s, docs=docs, **rows[-1]), flush=True)
    finally:
        T._kernel = original
    return {"head_dim": d, "heads": hq, "kv_heads": hkv, "seq": s, "docs": docs, "candidates": rows}


# --breakdown cases: (head dim, q heads, kv heads, seq, packed documents), all causal
BREAKDOWN = [
    (64, 32, 32, 4096, False),
    (64, 32, 32, 8192, False),
    (128, 16, 16, 4096, False),
    (128, 16, 16, 8192, False),
    (64, 32, 8, 8192, False),
    (64, 32, 8, 4096, True),
    (64, 32, 8, 8192, True),
    (128, 16, 16, 8192, True),
]

CONFIG_SWEEP = [(128, 16, 16, 8192, False), (128, 16, 16, 8192, True), (64, 32, 32, 8192, False)]


def markdown(rows: list[dict]) -> str:
    """The suite's table (TFLOP/s; ratios forward+backward); with ``auto`` in the run, its choice, auto ÷ cuDNN
    per case and the bar's verdict under the table."""
    names = sorted({n for r in rows for n in r["backends"]}, key=list(BACKENDS).index)
    auto = any("auto" in r for r in rows)
    head = (
        "| d | heads q/kv | seq | mask | "
        + " | ".join(f"{n} fwd / fwd+bwd" for n in names)
        + " | loom ÷ best of sdpa_flash, flex (fwd+bwd) | loom ÷ cuDNN (fwd+bwd) |"
        + (" auto's choice | auto ÷ cuDNN (fwd+bwd) |" if auto else "")
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = []
        for n in names:
            x = r["backends"].get(n)
            cells.append(
                f"{x['fwd_tflops']:.0f} / {x['fwd_bwd_tflops']:.0f}" if x and "fwd_ms" in x else "n/a"
            )
        rat = r.get("ratios_fwd_bwd", {})
        best = [rat[n] for n in ("sdpa_flash", "flex") if n in rat]
        mask = ("docs " if r["docs"] else "") + ("causal" if r["causal"] else "full")
        ratio_best = f"{min(best):.2f}" if best else "n/a"
        ratio_cudnn = f"{rat['sdpa_cudnn']:.2f}" if "sdpa_cudnn" in rat else "n/a"
        line = (
            f"| {r['head_dim']} | {r['heads']}/{r['kv_heads']} | {r['seq']} | {mask} | "
            + " | ".join(cells)
            + f" | {ratio_best} | {ratio_cudnn} |"
        )
        if auto:
            vs = cudnn_ratios(r)
            choice = r["auto"]["chosen"] if "auto" in r else "n/a"
            line += f" {choice} | {vs['auto']:.2f} |" if "auto" in vs else f" {choice} | n/a |"
        lines.append(line)
    if auto:
        lines += ["", bar_verdict(rows)]
    return "\n".join(lines)


def breakdown(d: int, hq: int, hkv: int, s: int, dtype, docs: bool = False) -> dict:
    """Time of loom's forward and backward and the configs autotuning chose; causal, optionally packed
    documents (useful FLOPs)."""
    from loom.kernels.attention import op as T  # what the model runs (Triton or the Gluon Hopper kernels)
    from loom.kernels.attention import reference as R

    b = TOKENS // s
    gen = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(b, h, s, d, generator=gen).to("cuda", dtype) for h in (hq, hkv, hkv))
    lens = random_doc_lens(b, s, gen) if docs else None
    bounds = R.document_bounds(doc_ids(lens, "cuda")) if docs else None
    scale = d**-0.5
    out, lse = T.attention_forward(q, k, v, True, bounds, 0, scale)
    dout = torch.randn_like(out)
    flops = attention_flops(b, hq, d, lens, s, True)
    row = {
        "head_dim": d,
        "heads": hq,
        "kv_heads": hkv,
        "seq": s,
        "docs": docs,
        "fwd_ms": bench_ms(lambda: T.attention_forward(q, k, v, True, bounds, 0, scale)),
    }

    def bwd():
        T.attention_backward(dout, q, k, v, out, lse, None, True, bounds, 0, scale)

    bwd()
    row["bwd_ms"] = bench_ms(bwd)
    row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
    row["bwd_tflops"] = 2.5 * flops / row["bwd_ms"] / 1e9
    row["configs"] = loom_configs()
    print(row, flush=True)
    return row


PROFILE = [(128, 16, 16, 8192), (64, 32, 32, 8192)]


def loop_times(fn, n: int = 20) -> tuple[float, float]:
    """(GPU ms per call over n back-to-back calls, CPU ms per call to issue them): a GPU time above the
    kernels' sum means the GPU waited for the CPU."""
    import time

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    cpu = (time.perf_counter() - t0) * 1e3 / n
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n, cpu


def profile_case(d: int, hq: int, hkv: int, s: int, dtype, backends: list[str], iters: int = 5) -> dict:
    """GPU kernel time per forward+backward call of each backend, by kernel, from torch.profiler: shows
    what a backend spends besides its attention kernels (preprocessing, copies, gradient handling)."""
    from torch.profiler import ProfilerActivity, profile

    b = TOKENS // s
    gen = torch.Generator().manual_seed(s)
    q, k, v = (
        torch.randn(b, h, s, d, generator=gen).to("cuda", dtype).requires_grad_() for h in (hq, hkv, hkv)
    )
    flops = attention_flops(b, hq, d, None, s, True)
    row = {"head_dim": d, "heads": hq, "kv_heads": hkv, "seq": s, "batch": b, "backends": {}}
    for name in backends:
        fwd = BACKENDS[name](q, k, v, True, None)
        dout = torch.randn_like(fwd())

        def fwd_bwd():
            for t in (q, k, v):
                t.grad = None
            fwd().backward(dout)

        for _ in range(3):
            fwd_bwd()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fwd_bwd()
            torch.cuda.synchronize()
        kernels: dict[str, float] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time / 1e3 / iters
        total = sum(kernels.values())
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
        loop_ms, cpu_ms = loop_times(fwd_bwd)
        bench = bench_ms(fwd_bwd, grads=[q, k, v])
        row["backends"][name] = {
            "gpu_ms_per_call": total,
            "tflops_at_gpu_time": 3.5 * flops / total / 1e9,
            "loop_ms_per_call": loop_ms,
            "cpu_ms_per_call": cpu_ms,
            "do_bench_ms": bench,
            "kernels_ms": {n[:120]: round(t, 4) for n, t in top},
        }
        print(
            f"d{d} s{s} {name}: {total:.3f} ms GPU per fwd+bwd ({3.5 * flops / total / 1e9:.0f} TFLOP/s); "
            f"back-to-back loop {loop_ms:.3f} ms, CPU {cpu_ms:.3f} ms, do_bench {bench:.3f} ms per call",
            flush=True,
        )
        for n, t in top:
            print(f"    {t:8.3f} ms  {n[:110]}", flush=True)
        for t in (q, k, v):
            t.grad = None
        torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--suite", choices=SUITES, default="quick")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--out", default="")
    p.add_argument(
        "--with",
        dest="with_backends",
        default="",
        help=f"comma-separated backends to time beside the suite's (of {', '.join(EXTRA)}; fa4 needs the "
        "flash-attn-4 package)",
    )
    p.add_argument("--commit", default=default_commit())
    p.add_argument(
        "--breakdown", action="store_true", help="time loom's forward and backward (BREAKDOWN cases)"
    )
    p.add_argument(
        "--configs",
        action="store_true",
        help="every backward candidate config one by one (time, registers, spills, occupancy) for CONFIG_SWEEP cases",
    )
    p.add_argument(
        "--extra-dkdv",
        default="",
        help="with --configs: more dK/dV candidates, 'M,N,warps,stages[,maxnreg];...'",
    )
    p.add_argument("--extra-dq", default="", help="with --configs: more dQ candidates (same form)")
    p.add_argument("--extra-fwd", default="", help="with --configs: forward candidates to time (same form)")
    p.add_argument(
        "--extra-only", action="store_true", help="with --configs: the first candidate and the extra ones"
    )
    p.add_argument(
        "--cases", default="", help="with --configs: 'd,hq,hkv,seq,docs;...' instead of CONFIG_SWEEP"
    )
    p.add_argument(
        "--tensor-desc",
        action="store_true",
        help="the suite's cases on loom's Triton kernels only, plain pointers vs tensor descriptors (both columns)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="GPU time per kernel of each backend's forward+backward (PROFILE cases, torch.profiler)",
    )
    a = p.parse_args()
    if a.out and not a.out.endswith(
        ".json"
    ):  # the table goes beside it as .md: another suffix would overwrite it
        print(
            f"bench.kernels: --out {a.out}: allowed a path ending in .json (the table goes beside it as .md)",
            file=sys.stderr,
        )
        sys.exit(2)
    if a.profile:
        rows = [
            profile_case(d, hq, hkv, s, getattr(torch, a.dtype), ["loom", "flex", "sdpa_cudnn"])
            for d, hq, hkv, s in PROFILE
        ]
        write_rows(a, rows)
        return
    if a.configs:
        extra = {
            "fwd": parse_configs(a.extra_fwd),
            "dkdv": parse_configs(a.extra_dkdv),
            "dq": parse_configs(a.extra_dq),
            "only": a.extra_only,
        }
        rows = []
        for d, hq, hkv, s, docs in parse_configs(a.cases) or CONFIG_SWEEP:
            rows.append(config_sweep(d, hq, hkv, s, getattr(torch, a.dtype), bool(docs), extra))
            write_rows(a, rows)
        return
    if a.breakdown:
        rows = [breakdown(d, hq, hkv, s, getattr(torch, a.dtype), docs) for d, hq, hkv, s, docs in BREAKDOWN]
        write_rows(a, rows)
        return
    suite = SUITES[a.suite]
    dtype = getattr(torch, a.dtype)
    extra = extra_backends(a.with_backends, suite["backends"])
    if a.tensor_desc and extra:
        print(
            "bench.kernels: --with: not with --tensor-desc, which times loom's kernels only", file=sys.stderr
        )
        sys.exit(2)
    backends = VARIANTS if a.tensor_desc else suite["backends"] + extra
    rows = []
    for d, hq, hkv in suite["dims"]:
        for s in suite["seqs"]:
            for causal in suite["causal"]:
                rows.append(run_case(d, hq, hkv, s, causal, suite["docs"], backends, dtype))
                if a.out:  # after every row: a run cut short keeps what it measured
                    write_results(a, rows)
    print(table(a, rows))


def extra_backends(text: str, suite: list[str]) -> list[str]:
    """``--with``'s backends not already in the suite; exit 2 with one line on a name it does not take."""
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in EXTRA]
    if bad:
        print(f"bench.kernels: --with {text}: {bad[0]!r} is not one of {', '.join(EXTRA)}", file=sys.stderr)
        sys.exit(2)
    return [n for n in dict.fromkeys(names) if n not in suite]


def parse_configs(text: str) -> list[tuple]:
    """'64,64,8,2,128;32,64,4,3' -> [(64, 64, 8, 2, 128), (32, 64, 4, 3)]"""
    return [tuple(int(x) for x in c.split(",")) for c in text.split(";") if c.strip()]


def write_rows(a, rows: list[dict]) -> None:
    """JSON of a --profile / --configs / --breakdown run (no markdown table)."""
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {
                    "env": environment(a.commit, command()),
                    "dtype": a.dtype,
                    "tokens_per_measurement": TOKENS,
                    "rows": rows,
                },
                f,
                indent=1,
            )


def table(a, rows: list[dict]) -> str:
    return variant_markdown(rows) if a.tensor_desc else markdown(rows)


def write_results(a, rows: list[dict]) -> None:
    result = {
        "env": environment(a.commit, command()),
        "suite": a.suite,
        "tensor_desc": a.tensor_desc,
        "dtype": a.dtype,
        "tokens_per_measurement": TOKENS,
        "rows": rows,
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    with open(a.out.replace(".json", ".md"), "w") as f:
        f.write(
            f"# bench.kernels --suite {a.suite}{' --tensor-desc' if a.tensor_desc else ''} "
            f"({result['env']['device']}, torch {torch.__version__}, {a.dtype})\n\n"
            f"TFLOP/s (forward / forward+backward)\n\n{table(a, rows)}\n"
        )


if __name__ == "__main__":
    main()

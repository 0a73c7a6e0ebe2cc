"""Launchers of the Gluon Hopper attention kernels: configs (autotuned, or one fixed for tests and benchmarks),
grids, and the item groups sized to L2. Which calls run here: ``loom.kernels.dispatch``."""

from __future__ import annotations

import torch
import triton

from loom.kernels.attention.hopper.dkdv import _attn_bwd_dkdv_hopper, _attn_bwd_dkdv_persistent
from loom.kernels.attention.hopper.dq import _attn_bwd_dq_hopper
from loom.kernels.attention.hopper.forward import _attn_fwd_hopper
from loom.kernels.attention.triton import LOG2E

# candidates, chosen by autotuning on the first call of each key; 64 rows (keys for dK/dV, queries for dQ and the
# forward) per warpgroup. dK/dV: (BLOCK_M, BLOCK_N, STAGES, SPLIT), SPLIT two consumer partitions of 4 warps,
# otherwise one of 8; the others: (BLOCK_M, BLOCK_N, STAGES), always two 4-warp consumers.
_CONFIGS = {
    "dkdv": [(64, 128, 2, False), (64, 128, 2, True), (64, 128, 3, True)],
    "dkdv_p": [(64, 128, 2)],  # 3 stages exceed the 227 KB of shared memory at d128
    "dq": [(128, 64, 2), (128, 64, 3)],
    "fwd": [(128, 128, 2)],
}
_KERNELS = {
    "dkdv": _attn_bwd_dkdv_hopper,
    "dkdv_p": _attn_bwd_dkdv_persistent,
    "dq": _attn_bwd_dq_hopper,
    "fwd": _attn_fwd_hopper,
}
_TUNED: dict = {}


def _allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _config(kind: str, config: tuple) -> triton.Config:
    """One entry of ``_CONFIGS[kind]`` as a triton.Config."""
    m, n, stages, *split = config
    consts = {"BLOCK_M": m, "BLOCK_N": n, "STAGES": stages}
    if kind == "dkdv":
        consts["SPLIT"] = split[0]
    elif split:
        raise ValueError(f"{kind}: a config is (BLOCK_M, BLOCK_N, STAGES), got {config}")
    return triton.Config(consts, num_warps=4 if consts.get("SPLIT", True) else 8, num_stages=1)


def _launch(kind: str, grid_of, tensors, rest, causal: bool, bounds, dim: int, config, **extra) -> None:
    """Run kernel ``kind`` on (*tensors, bounds, *rest), autotuned (``config`` None) or with one fixed config of
    ``_CONFIGS[kind]``'s form; ``grid_of(BLOCK_M, BLOCK_N)`` gives the grid; ``extra``: more of the kernel's
    compile-time arguments."""
    triton.set_allocator(_allocator)  # device-side TMA descriptors live in a per-launch scratch buffer
    table = bounds if bounds is not None else torch.empty(1, dtype=torch.int32, device=tensors[0].device)
    args = (*tensors, table, *rest)
    consts = dict(CAUSAL=causal, HAS_DOCS=bounds is not None, HEAD_DIM=dim, **extra)
    if config is None:
        if kind not in _TUNED:
            _TUNED[kind] = triton.autotune(
                configs=[_config(kind, c) for c in _CONFIGS[kind]],
                key=["S_KEY", "GROUP", "HEAD_DIM", "CAUSAL", "HAS_DOCS"],
            )(_KERNELS[kind])
        _TUNED[kind][lambda meta: grid_of(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **consts)
    else:
        c = _config(kind, config)
        _KERNELS[kind][grid_of(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"])](
            *args, **consts, num_warps=c.num_warps, **c.kwargs
        )


def _persistent_grid(q: torch.Tensor):
    """grid_of for the persistent kernels walking (batch, head, query block) items: one program per SM, fewer
    when there are fewer items."""
    bsz, heads, seq, _ = q.shape
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return lambda m, n: (min(sms, triton.cdiv(seq, m) * bsz * heads),)


def _fit_l2(units: int, unit_bytes: int, device) -> int:
    """How many of ``units`` units of ``unit_bytes`` each fill at most half of the device's L2 (at least one)."""
    return max(1, min(units, torch.cuda.get_device_properties(device).L2_cache_size // 2 // unit_bytes))


def _group_size(requested: int | None, fitted, units: int, name: str) -> int:
    """Units per item group: ``requested``, or ``fitted()`` (sized to L2) when None; at most ``units``."""
    if requested is not None and requested < 1:
        raise ValueError(f"{name} must be >= 1, got {requested}")
    return min(units, requested if requested is not None else fitted())


def l2_heads_per_group(q: torch.Tensor, k: torch.Tensor) -> int:
    """(batch, head) pairs per item group of the forward and dQ such that the K and V they read (whole sequences,
    per KV head shared by its query heads) fill at most half of the device's L2, as FlashAttention-3's tile
    scheduler groups heads."""
    bsz, heads, seq, dim = q.shape
    return _fit_l2(
        bsz * heads, 2 * seq * dim * k.element_size() * k.shape[1] // heads, q.device
    )  # K, V per head


def l2_pairs_per_group(q: torch.Tensor, k: torch.Tensor) -> int:
    """(batch, KV head) pairs per item group of the persistent dK/dV such that the Q and dO they read (whole
    sequences of the KV head's query heads) fill at most half of the device's L2."""
    bsz, heads, seq, dim = q.shape
    return _fit_l2(
        bsz * k.shape[1], 2 * seq * dim * q.element_size() * heads // k.shape[1], q.device
    )  # Q, dO


def forward(
    q,
    k,
    v,
    out,
    lse,
    causal: bool,
    bounds,
    scale: float,
    seq_key: int,
    config=None,
    heads_per_group: int | None = None,
) -> None:
    """Fill out (like q) and lse ((B, H, S) float32, natural log, -inf for a row that saw nothing) from q/k/v
    (B, H, S, D); ``bounds`` as for ``dkdv``; ``config``: one of ``_CONFIGS["fwd"]``. Persistent: one program per SM,
    walking the items of ``heads_per_group`` (batch, head) pairs at a time (None: as many as fit L2,
    l2_heads_per_group; B * H: all of them, by query block; see common.item_coords)."""
    bsz, heads, seq, dim = q.shape
    group = _group_size(heads_per_group, lambda: l2_heads_per_group(q, k), bsz * heads, "heads_per_group")
    rest = (
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out.stride()[:3],
        seq,
        heads,
        heads // k.shape[1],
        bsz,
        seq_key,
        scale * LOG2E,
        group,
    )
    _launch(
        "fwd",
        _persistent_grid(q),
        (q, k, v, out, lse),
        rest,
        causal,
        bounds,
        dim,
        config,
        GROUPED=group < bsz * heads,
    )


def dkdv(
    q,
    k,
    v,
    dout,
    lse2,
    delta,
    dk,
    dv,
    causal: bool,
    bounds,
    scale: float,
    seq_key: int,
    config=None,
    persistent: bool = False,
    pairs_per_group: int | None = None,
) -> None:
    """Fill dk, dv (like k, v) from q/k/v/dout (B, H, S, D), ``lse2`` (log-sum-exp in log2 units, +inf for a row
    that saw nothing) and ``delta`` (rowsum(O dO) - dLSE), both (B, H, S) float32; ``bounds``: None or the
    packed documents' per-token (first, last) index, (2, B, S) int32. ``config``: one fixed config of
    ``_CONFIGS["dkdv"]`` (``_CONFIGS["dkdv_p"]`` when persistent) instead of autotuning (benchmarks, tests).
    ``persistent``: the persistent variant (_attn_bwd_dkdv_persistent), walking its items ``pairs_per_group``
    (batch, KV head) pairs at a time (None: as many as fit L2, l2_pairs_per_group; see dkdv._kv_item)."""
    bsz, heads, seq, dim = q.shape
    rest = (
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *dout.stride()[:3],
        *dk.stride()[:3],
        *dv.stride()[:3],
        seq,
        heads,
        heads // k.shape[1],
        bsz,
        seq_key,
        scale * LOG2E,
        scale,
    )
    if persistent:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        pairs = bsz * k.shape[1]
        group = _group_size(pairs_per_group, lambda: l2_pairs_per_group(q, k), pairs, "pairs_per_group")
        _launch(
            "dkdv_p",
            lambda m, n: (min(sms, triton.cdiv(seq, n) * pairs),),
            (q, k, v, dout, lse2, delta, dk, dv),
            (*rest, group),
            causal,
            bounds,
            dim,
            config,
        )
        return
    _launch(
        "dkdv",
        lambda m, n: (triton.cdiv(seq, n), bsz * k.shape[1]),
        (q, k, v, dout, lse2, delta, dk, dv),
        rest,
        causal,
        bounds,
        dim,
        config,
    )


def dq(
    q,
    k,
    v,
    dout,
    lse2,
    delta,
    grad_q,
    causal: bool,
    bounds,
    scale: float,
    seq_key: int,
    config=None,
    heads_per_group: int | None = None,
) -> None:
    """Fill grad_q (like q); ``config``: one of ``_CONFIGS["dq"]``; ``heads_per_group`` as for ``forward``, the
    other arguments as for ``dkdv``."""
    bsz, heads, seq, dim = q.shape
    group = _group_size(heads_per_group, lambda: l2_heads_per_group(q, k), bsz * heads, "heads_per_group")
    rest = (
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *dout.stride()[:3],
        *grad_q.stride()[:3],
        seq,
        heads,
        heads // k.shape[1],
        bsz,
        seq_key,
        scale * LOG2E,
        scale,
        group,
    )
    _launch(
        "dq",
        _persistent_grid(q),
        (q, k, v, dout, lse2, delta, grad_q),
        rest,
        causal,
        bounds,
        dim,
        config,
        GROUPED=group < bsz * heads,
    )

"""The attention backward's dK/dV kernel for Hopper (sm_90) in Gluon, Triton's lower-level language: its five
matmuls per query block are issued asynchronously, so the tensor cores keep working while the warps compute
the softmax terms (Triton 3.6 waits for every matmul before its result's first use: bench/NOTES.md v4-v10).

One program owns BLOCK_N keys of one head; K and V stay in shared memory, each query block's Q and dO arrive by
TMA into two slots (zero-filled past the sequence end), one block ahead. Per query block:

    S^T = K Q^T and dP^T = V dO^T issued together; wait for S^T only
    P^T = exp2(S^T - lse)          (while dP^T runs), stored to shared memory
    dV += P^T dO  issued;          wait for dP^T only
    dS^T = P^T (dP^T - delta)      (while dV runs), stored to shared memory
    dK += dS^T Q  issued, then waited for with dV

P^T and dS^T go through shared memory, stored before the waits that follow them: ptxas keeps shared-memory
stores ahead of a warpgroup-MMA wait, which pins each wait after the work it should overlap (with operands in
registers, the compiled SASS waited first; see NOTES v12). dK and dV are waited for at the end of every block:
left in flight into the next block, ptxas serialized every MMA ("non wgmma instructions defining accumulator
registers", its C7515 note), as it did for zero-initialized accumulators written while others were in flight.

Scope: causal or full attention without document masks or a window, one query head per KV head (MHA), bf16 /
fp16, head dim 64 or 128; ``supports`` says which. Everything else, and dQ, runs the Triton kernels in
``triton.py``.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)


@gluon.jit
def _load_query_block(q_desc, do_desc, m0, bars, q_smem, do_smem, t, pred):
    """TMA-load Q and dO rows [m0, m0 + BLOCK_M) into slot t % 2, signalling that slot's barrier."""
    s = t % 2
    mbarrier.expect(bars.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(q_desc, [m0, 0], bars.index(s), q_smem.index(s), pred=pred)
    tma.async_copy_global_to_shared(do_desc, [m0, 0], bars.index(s), do_smem.index(s), pred=pred)


@gluon.jit
def _attn_bwd_dkdv_hopper(Q, K, V, DO, LSE2, DELTA, DK, DV, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdob, sdoh,
                          sdos, sdkb, sdkh, sdks, sdvb, sdvh, sdvs, S, H, S_KEY, qk_scale, sm_scale,
                          CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          num_warps: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    n0 = gl.program_id(0) * BLOCK_N  # first key blocks first: under causality they see the most queries
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H

    # accumulators: S^T / dP^T (keys x queries) and dK / dV (keys x head dim); rows = keys, split over warps
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)  # per query
    row_layout: gl.constexpr = gl.SliceLayout(1, st_layout)  # per key
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    q_desc = tma.make_tensor_descriptor(Q + b * sqb + h * sqh, [S, HEAD_DIM], [sqs, 1], [BLOCK_M, HEAD_DIM], smem)
    do_desc = tma.make_tensor_descriptor(DO + b * sdob + h * sdoh, [S, HEAD_DIM], [sdos, 1], [BLOCK_M, HEAD_DIM],
                                         smem)
    k_desc = tma.make_tensor_descriptor(K + b * skb + h * skh, [S, HEAD_DIM], [sks, 1], [BLOCK_N, HEAD_DIM], smem)
    v_desc = tma.make_tensor_descriptor(V + b * svb + h * svh, [S, HEAD_DIM], [svs, 1], [BLOCK_N, HEAD_DIM], smem)
    dk_desc = tma.make_tensor_descriptor(DK + b * sdkb + h * sdkh, [S, HEAD_DIM], [sdks, 1], [BLOCK_N, HEAD_DIM],
                                         smem)
    dv_desc = tma.make_tensor_descriptor(DV + b * sdvb + h * sdvh, [S, HEAD_DIM], [sdvs, 1], [BLOCK_N, HEAD_DIM],
                                         smem)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], smem)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], smem)
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], smem)
    do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], smem)
    pt_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], smem)
    dst_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], smem)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(bars.index(i), count=1)

    first = 0
    if CAUSAL:
        first = n0 // BLOCK_M  # query blocks before it see none of these keys
    n_blocks = gl.cdiv(S, BLOCK_M) - first

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [n0, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [n0, 0], kv_bar, v_smem)
    _load_query_block(q_desc, do_desc, first * BLOCK_M, bars, q_smem, do_smem, 0, n_blocks > 0)

    offs_n = n0 + gl.arange(0, BLOCK_N, layout=row_layout)
    # S^T and dP^T start each block from the previous block's registers with use_acc=False (no zeros written)
    st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
    dpt = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    mbarrier.wait(kv_bar, 0)

    for t in range(0, n_blocks):
        slot = t % 2
        m0 = (first + t) * BLOCK_M
        mbarrier.wait(bars.index(slot), (t // 2) & 1)
        st_tok = warpgroup_mma(k_smem, q_smem.index(slot).permute((1, 0)), st, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(v_smem, do_smem.index(slot).permute((1, 0)), dpt, use_acc=False, is_async=True)
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=col_layout)
        in_seq = offs_m < S
        lse2 = gl.load(LSE2 + bh * S + offs_m, mask=in_seq, other=float("inf"))
        delta = gl.load(DELTA + bh * S + offs_m, mask=in_seq, other=0.0)
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok, ))
        # the previous block's slot is free (its dK and dV were waited for): the next block goes there
        _load_query_block(q_desc, do_desc, m0 + BLOCK_M, bars, q_smem, do_smem, t + 1, t + 1 < n_blocks)
        pt = gl.exp2(st * qk_scale - lse2[None, :])  # (N, M)
        if CAUSAL:
            if m0 < n0 + BLOCK_N - 1:  # a block on the diagonal: keys after a query are masked
                pt = gl.where(offs_n[:, None] <= offs_m[None, :], pt, 0.0)
        pt_smem.store(pt.to(dtype))
        fence_async_shared()
        dv = warpgroup_mma(pt_smem, do_smem.index(slot), dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt_tok, ))
        dst = pt * (dpt - delta[None, :])
        dst_smem.store(dst.to(dtype))
        fence_async_shared()
        dk = warpgroup_mma(dst_smem, q_smem.index(slot), dk, is_async=True)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))

    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(2):
        mbarrier.invalidate(bars.index(i))
    # K and V are no longer read: their buffers stage the results for the TMA stores (rows past S are clipped)
    k_smem.store((dk * sm_scale).to(dtype))
    v_smem.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [n0, 0], k_smem)
    tma.async_copy_shared_to_global(dv_desc, [n0, 0], v_smem)
    tma.store_wait(pendings=0)


# (BLOCK_M, BLOCK_N, warps) candidates, chosen by autotuning on the first call of each key
_CONFIGS = {64: [(64, 128, 8), (64, 64, 4)], 128: [(64, 128, 8), (64, 64, 4)]}  # 32-query blocks: rows below the 128-byte swizzle
_TUNED: dict = {}


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, bounds, window: int) -> bool:
    """Whether this kernel computes dK/dV for the call: sm_90, 16-bit, head dim 64/128, MHA, no documents or
    window, and TMA-compatible (16-byte aligned) bases and strides."""
    if bounds is not None or window or q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in (64, 128):
        return False
    if q.shape[1] != k.shape[1] or not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    return all(t.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in t.stride()[:3]) for t in (q, k, v, dout))


def _allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _kernel(head_dim: int):
    if head_dim not in _TUNED:
        configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=1)
                   for m, n, w in _CONFIGS[head_dim]]
        _TUNED[head_dim] = triton.autotune(configs=configs, key=["S_KEY", "HEAD_DIM", "CAUSAL"])(
            _attn_bwd_dkdv_hopper)
    return _TUNED[head_dim]


def dkdv(q, k, v, dout, lse2, delta, dk, dv, causal: bool, scale: float, seq_key: int, config=None) -> None:
    """Fill dk, dv (like k, v) from q/k/v/dout (B, H, S, D), ``lse2`` (log-sum-exp in log2 units, +inf for a row
    that saw nothing) and ``delta`` (rowsum(O dO) - dLSE), both (B, H, S) float32. ``config``: one fixed
    (BLOCK_M, BLOCK_N, warps) instead of autotuning (benchmarks)."""
    triton.set_allocator(_allocator)  # device-side TMA descriptors live in a per-launch scratch buffer
    bsz, heads, seq, dim = q.shape
    args = (q, k, v, dout, lse2, delta, dk, dv, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *dout.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], seq, heads, seq_key, scale * 1.4426950408889634,
            scale)
    if config is None:
        grid = lambda meta: (triton.cdiv(seq, meta["BLOCK_N"]), bsz * heads)  # noqa: E731
        _kernel(dim)[grid](*args, CAUSAL=causal, HEAD_DIM=dim)
    else:
        bm, bn, warps = config
        _attn_bwd_dkdv_hopper[(triton.cdiv(seq, bn), bsz * heads)](*args, CAUSAL=causal, HEAD_DIM=dim, BLOCK_M=bm,
                                                                   BLOCK_N=bn, num_warps=warps)

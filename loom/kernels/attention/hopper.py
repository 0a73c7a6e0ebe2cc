"""The attention backward's dK/dV and dQ kernels for Hopper (sm_90) in Gluon, warp-specialized as in
FlashAttention-3: a one-warp producer loads blocks by TMA into a ring of STAGES slots, and consumer warpgroups run
the matmuls per block asynchronously, releasing a slot through an mbarrier when its matmuls are done. Without a
producer, Triton put CTA-wide barriers around every TMA issue and shared-memory store, keeping the warpgroups in
lockstep (bench/NOTES.md v12, v13); here the loop has no CTA-wide barrier.

dK/dV: a program owns BLOCK_N keys; the producer loads K/V once, then each query block's Q, dO (and its
log-sum-exp and delta). Per query block, for the consumer's keys (rows):

    S^T = K Q^T and dP^T = V dO^T issued together; wait for S^T only
    P^T = exp2(S^T - lse)          (while dP^T runs)
    dV += P^T dO  issued, P^T from registers;  wait for dP^T only
    dS^T = P^T (dP^T - delta)      (while dV runs)
    dK += dS^T Q  issued, dS^T from registers; wait for both; release the slot

dQ: a program owns BLOCK_M queries; the producer loads Q/dO once, then each key block's K and V; per key block
S = Q K^T and dP = dO V^T, P, dS, dQ += dS K (three matmuls).

Two layouts of the consumers: ``SPLIT=False``, one 8-warp partition owning the program's rows (its two
warpgroups meet at one partition barrier per block, before the release); ``SPLIT=True``, two 4-warp partitions
owning half the rows each, never synchronized with each other.

Grouped-query attention: a dK/dV program owns keys of one KV head and walks the query blocks of each query head of
its group in turn (K and V loaded once). Packed documents: a program walks only the blocks its rows' documents
reach, and masks a block only where a document's edge, the causal diagonal or the sequence's end cuts it.

Scope: causal or full attention, packed documents within one sequence, any query-head group, bf16 / fp16, head
dim 64 or 128, no window; ``supports`` says which. The Triton kernels run everything else, and dQ where
``dq_wins`` says the Triton kernel is faster.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from loom.kernels.attention.triton import LOG2E


@triton.constexpr_function
def _mma_layout(warps, cols):
    """The register layout of a (rows, cols) matmul result of a consumer of ``warps`` warps, 64 rows per
    warpgroup (Gluon's constexpr functions return one value, not a tuple)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, cols, 16])


@gluon.jit
def _init_ring(ready, empty, STAGES: gl.constexpr, READY_ARRIVALS: gl.constexpr, SPLIT: gl.constexpr):
    """The ring's mbarriers: a slot is ready after READY_ARRIVALS arrivals (the TMA's expect, plus the
    producer's own arrive where it also stores into the slot) and empty after one arrival per consumer."""
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=READY_ARRIVALS)
        mbarrier.init(empty.index(i), count=2 if SPLIT else 1)


@gluon.jit
def _documents_reach(START, END, p0, S, ROWS: gl.constexpr, num_warps: gl.constexpr):
    """[lo, hi): the tokens that tokens [p0, p0 + ROWS)'s documents span (empty for padding or past S)."""
    offs = p0 + gl.arange(0, ROWS, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
    lo = gl.min(gl.load(START + offs, mask=offs < S, other=S), 0)
    hi = gl.max(gl.load(END + offs, mask=offs < S, other=-1), 0) + 1
    return lo, hi


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, ready,
              empty, LSE2, DELTA, row0, S, n0, first, n_blocks, GROUP, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """K and V once, then for each of the GROUP query heads sharing them, query block first + j into the next slot
    once the consumers freed it: Q and dO by TMA (a [head, row, dim] box of one head),
    its log-sum-exp and delta by this warp's loads (zero past S, where Q and dO are zero-filled), so the consumers
    read them from shared memory instead of waiting on global loads."""
    vec_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [n0, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [n0, 0], kv_bar, v_smem)
    for t in range(GROUP * n_blocks):
        s = t % STAGES
        g = t // n_blocks
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)  # the first pass over a fresh slot goes at once
        mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        m0 = (first + t % n_blocks) * BLOCK_M
        tma.async_copy_global_to_shared(q_desc, [g, m0, 0], ready.index(s), q_smem.index(s).reshape(
            q_desc.block_type.shape))
        tma.async_copy_global_to_shared(do_desc, [g, m0, 0], ready.index(s), do_smem.index(s).reshape(
            do_desc.block_type.shape))
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=vec_layout)
        in_seq = offs_m < S
        lse_smem.index(s).store(gl.load(LSE2 + (row0 + g) * S + offs_m, mask=in_seq, other=0.0))
        delta_smem.index(s).store(gl.load(DELTA + (row0 + g) * S + offs_m, mask=in_seq, other=0.0))
        mbarrier.arrive(ready.index(s))  # the second arrival: the stores above are visible to the waiters


@gluon.jit
def _consumer(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, ready, empty, dk_desc, dv_desc, n0, row0,
              first, n_blocks, GROUP, START, END, S, qk_scale, sm_scale, CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr,
              WARPS: gl.constexpr):
    """dK, dV of keys [n0 + row0, n0 + row0 + ROWS), written by TMA from the K / V buffers' rows they replace.
    Key j sees the queries [lo[j], hi[j]]: its document's (START, END: per-token bounds, symmetric within one
    sequence), from j on when causal; a block inside every key's range is not masked."""
    dtype: gl.constexpr = k_smem.dtype
    # S^T / dP^T (keys x queries) and dK / dV (keys x head dim): rows = keys, 64 per warpgroup
    st_layout: gl.constexpr = _mma_layout(WARPS, BLOCK_M)
    acc_layout: gl.constexpr = _mma_layout(WARPS, HEAD_DIM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)  # per query
    row_layout: gl.constexpr = gl.SliceLayout(1, st_layout)  # per key
    k_mine = k_smem.slice(row0, ROWS)
    v_mine = v_smem.slice(row0, ROWS)
    offs_n = n0 + row0 + gl.arange(0, ROWS, layout=row_layout)
    if HAS_DOCS:  # (without documents only the causal diagonal is masked: two fewer vectors held)
        lo = gl.load(START + offs_n, mask=offs_n < S, other=S)
        hi = gl.load(END + offs_n, mask=offs_n < S, other=-1)
        if CAUSAL:
            lo = gl.maximum(lo, offs_n)
        full_lo = gl.max(lo, 0)  # queries [full_lo, full_hi] need no mask
        full_hi = gl.min(hi, 0)
    # S^T and dP^T start each block from the previous block's registers with use_acc=False: zeros written while
    # other MMAs are in flight make ptxas serialize them all (its note C7515)
    st = gl.zeros([ROWS, BLOCK_M], gl.float32, layout=st_layout)
    dpt = gl.zeros([ROWS, BLOCK_M], gl.float32, layout=st_layout)
    dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    mbarrier.wait(kv_bar, 0)
    for t in range(GROUP * n_blocks):  # the group's query heads one after the other, each over its blocks
        s = t % STAGES
        m0 = (first + t % n_blocks) * BLOCK_M
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        st_tok = warpgroup_mma(k_mine, q_smem.index(s).permute((1, 0)), st, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(v_mine, do_smem.index(s).permute((1, 0)), dpt, use_acc=False, is_async=True)
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=col_layout)
        lse2 = lse_smem.index(s).load(col_layout)
        delta = delta_smem.index(s).load(col_layout)
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok, ))
        pt = gl.exp2(st * qk_scale - lse2[None, :])  # (ROWS, BLOCK_M)
        if HAS_DOCS:
            if (m0 < full_lo) | (m0 + BLOCK_M - 1 > full_hi):  # a document's edge, the diagonal, the end
                pt = gl.where((offs_m[None, :] >= lo[:, None]) & (offs_m[None, :] <= hi[:, None]), pt, 0.0)
        elif CAUSAL:
            if m0 < n0 + row0 + ROWS - 1:  # a block on the diagonal: keys after a query are masked
                pt = gl.where(offs_n[:, None] <= offs_m[None, :], pt, 0.0)
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_smem.index(s), dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt_tok, ))
        dst = pt * (dpt - delta[None, :])
        dk = warpgroup_mma(gl.convert_layout(dst.to(dtype), a_layout), q_smem.index(s), dk, is_async=True)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        mbarrier.arrive(empty.index(s))
    # these keys' K and V are no longer read: their rows stage the results for the TMA stores (rows past S clipped)
    k_mine.store((dk * sm_scale).to(dtype))
    v_mine.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [n0 + row0, 0], k_mine)
    tma.async_copy_shared_to_global(dv_desc, [n0 + row0, 0], v_mine)
    tma.store_wait(pendings=0)


@gluon.jit
def _attn_bwd_dkdv_hopper(Q, K, V, DO, LSE2, DELTA, DK, DV, BOUNDS, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdob,
                          sdoh, sdos, sdkb, sdkh, sdks, sdvb, sdvh, sdvs, S, H, GROUP, B, S_KEY, qk_scale, sm_scale,
                          CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr, HEAD_DIM: gl.constexpr,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                          num_warps: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    ROWS: gl.constexpr = BLOCK_N // 2 if SPLIT else BLOCK_N
    n0 = gl.program_id(0) * BLOCK_N  # first key blocks first: under causality they see the most queries
    bh = gl.program_id(1)  # (batch, KV head); H counts query heads, GROUP of them share each KV head
    b = bh // (H // GROUP)
    h = bh % (H // GROUP)
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    smem3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    # Q and dO of the group's query heads: [head, row, dim], one head per box (rows past S zero-filled)
    q_desc = tma.make_tensor_descriptor(Q + b * sqb + h * GROUP * sqh, [GROUP, S, HEAD_DIM], [sqh, sqs, 1],
                                        [1, BLOCK_M, HEAD_DIM], smem3)
    do_desc = tma.make_tensor_descriptor(DO + b * sdob + h * GROUP * sdoh, [GROUP, S, HEAD_DIM], [sdoh, sdos, 1],
                                         [1, BLOCK_M, HEAD_DIM], smem3)
    k_desc = tma.make_tensor_descriptor(K + b * skb + h * skh, [S, HEAD_DIM], [sks, 1], [BLOCK_N, HEAD_DIM], smem)
    v_desc = tma.make_tensor_descriptor(V + b * svb + h * svh, [S, HEAD_DIM], [svs, 1], [BLOCK_N, HEAD_DIM], smem)
    dk_desc = tma.make_tensor_descriptor(DK + b * sdkb + h * sdkh, [S, HEAD_DIM], [sdks, 1], [ROWS, HEAD_DIM], smem)
    dv_desc = tma.make_tensor_descriptor(DV + b * sdvb + h * sdvh, [S, HEAD_DIM], [sdvs, 1], [ROWS, HEAD_DIM], smem)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], smem)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], smem)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], smem)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], smem)
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    _init_ring(ready, empty, STAGES, 2, SPLIT)  # ready: the TMA's expect and the producer's arrive (lse, delta)
    START = BOUNDS + b * S  # per-token document bounds (2, B, S): first and last index of its document
    END = BOUNDS + (B + b) * S
    q_lo = n0 * 0  # the queries any of these keys can see: [q_lo, q_hi)
    q_hi = n0 * 0 + S
    if HAS_DOCS:
        q_lo, q_hi = _documents_reach(START, END, n0, S, BLOCK_N, num_warps)
    if CAUSAL:
        q_lo = gl.maximum(q_lo, n0)  # queries before the block see none of its keys
    first = q_lo // BLOCK_M
    n_blocks = gl.maximum(gl.cdiv(q_hi, BLOCK_M) - first, 0)
    # each partition's arguments spelled out: Gluon's frontend took neither a tuple built ahead nor tuple addition
    if SPLIT:  # two consumer partitions of ROWS keys each, then the producer
        gl.warp_specialize([
            (_consumer, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, ready, empty, dk_desc,
                         dv_desc, n0, 0, first, n_blocks, GROUP, START, END, S, qk_scale, sm_scale, CAUSAL, HAS_DOCS,
                         HEAD_DIM, BLOCK_M, ROWS, STAGES, num_warps)),
            (_consumer, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, ready, empty, dk_desc,
                         dv_desc, n0, ROWS, first, n_blocks, GROUP, START, END, S, qk_scale, sm_scale, CAUSAL, HAS_DOCS,
                         HEAD_DIM, BLOCK_M, ROWS, STAGES, num_warps)),
            (_producer, (q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                         kv_bar, ready, empty, LSE2, DELTA, b * H + h * GROUP, S, n0, first, n_blocks, GROUP, BLOCK_M,
                         STAGES)),
        ], [num_warps, 1], [240, 24])
    else:  # one consumer partition of all BLOCK_N keys, then the producer
        gl.warp_specialize([
            (_consumer, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, ready, empty, dk_desc,
                         dv_desc, n0, 0, first, n_blocks, GROUP, START, END, S, qk_scale, sm_scale, CAUSAL, HAS_DOCS,
                         HEAD_DIM, BLOCK_M, ROWS, STAGES, num_warps)),
            (_producer, (q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                         kv_bar, ready, empty, LSE2, DELTA, b * H + h * GROUP, S, n0, first, n_blocks, GROUP, BLOCK_M,
                         STAGES)),
        ], [1], [24])


# --------------------------------------------------------------------------------------------------- dQ
@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty, m0, first,
                 n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Q and dO of the program's queries once, then key block first + t's K and V into the next free slot."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [m0, 0], q_bar, q_smem)
    tma.async_copy_global_to_shared(do_desc, [m0, 0], q_bar, do_smem)
    for t in range(n_blocks):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)  # the first pass over a fresh slot goes at once
        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        n0 = (first + t) * BLOCK_N
        tma.async_copy_global_to_shared(k_desc, [n0, 0], ready.index(s), k_smem.index(s))
        tma.async_copy_global_to_shared(v_desc, [n0, 0], ready.index(s), v_smem.index(s))


@gluon.jit
def _dq_consumer(q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty, dq_desc, LSE2, DELTA, START, END, m0, row0,
                 first, n_blocks, S, qk_scale, sm_scale, CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr,
                 HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr,
                 WARPS: gl.constexpr):
    """dQ of queries [m0 + row0, m0 + row0 + ROWS): per key block S = Q K^T and dP = dO V^T issued together,
    P = exp2(S - lse) while dP runs, dS = P (dP - delta), dQ += dS K with dS from registers. Query i sees the
    keys [lo[i], hi[i]]; a block inside every row's range is not masked."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _mma_layout(WARPS, BLOCK_N)
    acc_layout: gl.constexpr = _mma_layout(WARPS, HEAD_DIM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # per query
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per key
    q_mine = q_smem.slice(row0, ROWS)
    do_mine = do_smem.slice(row0, ROWS)
    offs_m = m0 + row0 + gl.arange(0, ROWS, layout=row_layout)
    in_seq = offs_m < S
    lse2 = gl.load(LSE2 + offs_m, mask=in_seq, other=float("inf"))
    delta = gl.load(DELTA + offs_m, mask=in_seq, other=0.0)
    if HAS_DOCS:
        lo = gl.load(START + offs_m, mask=in_seq, other=S)
        hi = gl.minimum(gl.load(END + offs_m, mask=in_seq, other=-1), S - 1)
    else:
        lo = offs_m * 0
        hi = gl.where(in_seq, S - 1, -1)
    if CAUSAL:
        hi = gl.minimum(hi, offs_m)
    full_lo = gl.max(lo, 0)  # keys [full_lo, full_hi] need no mask
    full_hi = gl.min(hi, 0)
    sc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    dp = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    mbarrier.wait(q_bar, 0)
    for t in range(n_blocks):
        s = t % STAGES
        n0 = (first + t) * BLOCK_N
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        s_tok = warpgroup_mma(q_mine, k_smem.index(s).permute((1, 0)), sc, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do_mine, v_smem.index(s).permute((1, 0)), dp, use_acc=False, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        p = gl.exp2(sc * qk_scale - lse2[:, None])  # (ROWS, BLOCK_N)
        if (n0 < full_lo) | (n0 + BLOCK_N - 1 > full_hi):  # the diagonal, a document's edge, the end
            offs_n = n0 + gl.arange(0, BLOCK_N, layout=col_layout)
            p = gl.where((offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] <= hi[:, None]), p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
        ds = p * (dp - delta[:, None])
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), k_smem.index(s), dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        mbarrier.arrive(empty.index(s))
    # these queries' Q is no longer read: its rows stage the result for the TMA store (rows past S clipped)
    q_mine.store((dq * sm_scale).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [m0 + row0, 0], q_mine)
    tma.store_wait(pendings=0)


@gluon.jit
def _attn_bwd_dq_hopper(Q, K, V, DO, LSE2, DELTA, DQ, BOUNDS, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdob, sdoh,
                        sdos, sdqb, sdqh, sdqs, S, H, GROUP, B, S_KEY, qk_scale, sm_scale, CAUSAL: gl.constexpr,
                        HAS_DOCS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    ROWS: gl.constexpr = BLOCK_M // 2 if SPLIT else BLOCK_M
    m0 = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M  # last (longest, when causal) query blocks first
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_desc = tma.make_tensor_descriptor(Q + b * sqb + h * sqh, [S, HEAD_DIM], [sqs, 1], [BLOCK_M, HEAD_DIM], smem)
    do_desc = tma.make_tensor_descriptor(DO + b * sdob + h * sdoh, [S, HEAD_DIM], [sdos, 1], [BLOCK_M, HEAD_DIM],
                                         smem)
    k_desc = tma.make_tensor_descriptor(K + b * skb + hk * skh, [S, HEAD_DIM], [sks, 1], [BLOCK_N, HEAD_DIM], smem)
    v_desc = tma.make_tensor_descriptor(V + b * svb + hk * svh, [S, HEAD_DIM], [svs, 1], [BLOCK_N, HEAD_DIM], smem)
    dq_desc = tma.make_tensor_descriptor(DQ + b * sdqb + h * sdqh, [S, HEAD_DIM], [sdqs, 1], [ROWS, HEAD_DIM], smem)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], smem)
    do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], smem)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    _init_ring(ready, empty, STAGES, 1, SPLIT)
    START = BOUNDS + b * S  # per-token document bounds (2, B, S): first and last index of its document
    END = BOUNDS + (B + b) * S
    k_lo = m0 * 0  # the keys any of these queries can see: [k_lo, k_hi)
    k_hi = m0 * 0 + S
    if HAS_DOCS:
        k_lo, k_hi = _documents_reach(START, END, m0, S, BLOCK_M, num_warps)
    if CAUSAL:
        k_hi = gl.minimum(k_hi, m0 + BLOCK_M)  # keys after the block's last query are seen by none
    first = k_lo // BLOCK_N
    n_blocks = gl.maximum(gl.cdiv(k_hi, BLOCK_N) - first, 0)
    LSE2 = LSE2 + bh * S
    DELTA = DELTA + bh * S
    if SPLIT:  # two consumer partitions of ROWS queries each, then the producer
        gl.warp_specialize([
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty, dq_desc, LSE2, DELTA, START, END,
                            m0, 0, first, n_blocks, S, qk_scale, sm_scale, CAUSAL, HAS_DOCS, HEAD_DIM, BLOCK_N, ROWS,
                            STAGES, num_warps)),
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty, dq_desc, LSE2, DELTA, START, END,
                            m0, ROWS, first, n_blocks, S, qk_scale, sm_scale, CAUSAL, HAS_DOCS, HEAD_DIM, BLOCK_N,
                            ROWS, STAGES, num_warps)),
            (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty,
                            m0, first, n_blocks, BLOCK_N, STAGES)),
        ], [num_warps, 1], [240, 24])
    else:  # one consumer partition of all BLOCK_M queries, then the producer
        gl.warp_specialize([
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty, dq_desc, LSE2, DELTA, START, END,
                            m0, 0, first, n_blocks, S, qk_scale, sm_scale, CAUSAL, HAS_DOCS, HEAD_DIM, BLOCK_N, ROWS,
                            STAGES, num_warps)),
            (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty,
                            m0, first, n_blocks, BLOCK_N, STAGES)),
        ], [1], [24])


# (BLOCK_M, BLOCK_N, STAGES, SPLIT): candidates, chosen by autotuning on the first call of each key. SPLIT runs
# two consumer partitions of 4 warps, otherwise one of 8; 64 rows (keys for dK/dV, queries for dQ) per warpgroup.
_CONFIGS = {"dkdv": [(64, 128, 2, False), (64, 128, 2, True), (64, 128, 3, True)],
            "dq": [(128, 64, 2, True), (128, 64, 3, True), (128, 128, 2, True)]}  # 8-warp dQ: slower everywhere
_KERNELS = {"dkdv": _attn_bwd_dkdv_hopper, "dq": _attn_bwd_dq_hopper}
_TUNED: dict = {}


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, window: int, key_bounds) -> bool:
    """Whether these kernels compute the call's gradients: sm_90, 16-bit, head dim 64/128, no window, documents
    only within one sequence (no ``key_bounds``), and TMA-compatible (16-byte aligned) bases and strides."""
    if key_bounds is not None or window or q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in (64, 128):
        return False
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    return all(t.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in t.stride()[:3]) for t in (q, k, v, dout))


def dq_wins(head_dim: int, bounds) -> bool:
    """Whether the Gluon dQ kernel beats the Triton one here (same-run H100 timings, bench/NOTES.md v15):
    1.06-1.18x at head dim 128 without documents; 5% more time on d128 documents, 8-56% more at head dim 64."""
    return head_dim == 128 and bounds is None


def _allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _config(m: int, n: int, stages: int, split: bool) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "STAGES": stages, "SPLIT": split}, num_warps=4 if split else 8,
                         num_stages=1)


def _launch(kind: str, grid_of, tensors, rest, causal: bool, bounds, dim: int, config) -> None:
    """Run kernel ``kind`` on (*tensors, bounds, *rest), autotuned (``config`` None) or with one fixed
    (BLOCK_M, BLOCK_N, STAGES, SPLIT); ``grid_of(BLOCK_M, BLOCK_N)`` gives the grid."""
    triton.set_allocator(_allocator)  # device-side TMA descriptors live in a per-launch scratch buffer
    table = bounds if bounds is not None else torch.empty(1, dtype=torch.int32, device=tensors[0].device)
    args = (*tensors, table, *rest)
    consts = dict(CAUSAL=causal, HAS_DOCS=bounds is not None, HEAD_DIM=dim)
    if config is None:
        if kind not in _TUNED:
            _TUNED[kind] = triton.autotune(configs=[_config(*c) for c in _CONFIGS[kind]],
                                           key=["S_KEY", "GROUP", "HEAD_DIM", "CAUSAL", "HAS_DOCS"])(_KERNELS[kind])
        _TUNED[kind][lambda meta: grid_of(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **consts)
    else:
        c = _config(*config)
        _KERNELS[kind][grid_of(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"])](*args, **consts,
                                                                          num_warps=c.num_warps, **c.kwargs)


def dkdv(q, k, v, dout, lse2, delta, dk, dv, causal: bool, bounds, scale: float, seq_key: int, config=None) -> None:
    """Fill dk, dv (like k, v) from q/k/v/dout (B, H, S, D), ``lse2`` (log-sum-exp in log2 units, +inf for a row
    that saw nothing) and ``delta`` (rowsum(O dO) - dLSE), both (B, H, S) float32; ``bounds``: None or the
    packed documents' per-token (first, last) index, (2, B, S) int32. ``config``: one fixed
    (BLOCK_M, BLOCK_N, STAGES, SPLIT) instead of autotuning (benchmarks, tests)."""
    bsz, heads, seq, dim = q.shape
    rest = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dk.stride()[:3],
            *dv.stride()[:3], seq, heads, heads // k.shape[1], bsz, seq_key, scale * LOG2E, scale)
    _launch("dkdv", lambda m, n: (triton.cdiv(seq, n), bsz * k.shape[1]), (q, k, v, dout, lse2, delta, dk, dv), rest,
            causal, bounds, dim, config)


def dq(q, k, v, dout, lse2, delta, grad_q, causal: bool, bounds, scale: float, seq_key: int, config=None) -> None:
    """Fill grad_q (like q); the other arguments as for ``dkdv``."""
    bsz, heads, seq, dim = q.shape
    rest = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *grad_q.stride()[:3], seq, heads,
            heads // k.shape[1], bsz, seq_key, scale * LOG2E, scale)
    _launch("dq", lambda m, n: (triton.cdiv(seq, m), bsz * heads), (q, k, v, dout, lse2, delta, grad_q), rest,
            causal, bounds, dim, config)

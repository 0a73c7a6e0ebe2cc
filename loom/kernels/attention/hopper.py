"""The attention kernels for Hopper (sm_90) in Gluon: the backward's dK/dV and dQ and the forward, warp-specialized
as in FlashAttention-3: a one-warp producer loads blocks by TMA into a ring of STAGES slots, and consumer
warpgroups run the matmuls per block asynchronously, releasing a slot through an mbarrier when its matmuls are
done. Without a producer, Triton put CTA-wide barriers around every TMA issue and shared-memory store, keeping the
warpgroups in lockstep (bench/NOTES.md v12, v13); here the loop has no CTA-wide barrier.

dK/dV: a program owns BLOCK_N keys; the producer loads K/V once, then each query block's Q, dO (and its
log-sum-exp and delta). Per query block, for the consumer's keys (rows):

    S^T = K Q^T and dP^T = V dO^T issued together; wait for S^T only
    P^T = exp2(S^T - lse)          (while dP^T runs)
    dV += P^T dO  issued, P^T from registers;  wait for dP^T only
    dS^T = P^T (dP^T - delta)      (while dV runs)
    dK += dS^T Q  issued, dS^T from registers; wait for both; release the slot

dQ and the forward are persistent: one program per SM walks work items (batch, head, query block), its producer
loading an item's Q (and dO) into one of two buffers and the item's K/V blocks into the ring, running ahead into
the next item while the consumers finish the current one. With packed documents the producer also stores the
item's set-up with its Q (the key-block range, each consumer's block bounds, each row's visible keys), so that no
consumer waits on global loads or cross-warp reductions between items. dQ per key block: S = Q K^T and
dP = dO V^T, P, dS, dQ += dS K (three matmuls). Forward per key block: S = Q K^T, the online softmax in
registers, O += P V with P from registers; O leaves through a staging buffer by TMA. A persistent dK/dV of the
same kind (``dkdv(..., persistent=True)``: K/V double-buffered, each item's key ranges from the producer, results
stored from the K/V rows while the next item starts) runs where ``persistent_dkdv_wins``. The persistent kernels
walk their items in groups of (batch, head) pairs sized to L2 (FlashAttention-3's head grouping).

Two layouts of the consumers: ``SPLIT=False``, one 8-warp partition owning the program's rows (its two
warpgroups meet at one partition barrier per block, before the release); ``SPLIT=True``, two 4-warp partitions
owning half the rows each, never synchronized with each other (the forward has only this one). A consumer skips
the blocks none of its own rows reach.

Grouped-query attention: a dK/dV program owns keys of one KV head and walks the query blocks of each query head of
its group in turn (K and V loaded once); dQ and forward items read K/V at head ``h // GROUP``. Packed documents: a
program walks only the blocks its rows' documents reach, and masks a block only where a document's edge, the
causal diagonal or the sequence's end cuts it.

Scope: causal or full attention, packed documents within one sequence, any query-head group, bf16 / fp16, head
dim 64 or 128, no window; ``supports`` says which. The Triton kernels run everything else, and dQ where ``dq_wins``
says the Triton kernel is faster.
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
def _block_bounds(lo, hi):
    """From per-row visible ranges [lo, hi]: [full_lo, full_hi], seen by every row (a block inside needs no
    mask), and [any_lo, any_hi], outside which no row sees anything (a block there is skipped)."""
    return gl.max(lo, 0), gl.min(hi, 0), gl.min(lo, 0), gl.max(hi, 0)


@gluon.jit
def _mask_cut(x, start, lo, hi, full_lo, full_hi, other, BLOCK: gl.constexpr, col_layout: gl.constexpr,
              ONE_SIDED: gl.constexpr):
    """x (rows, BLOCK) over the columns [start, start + BLOCK), set to ``other`` outside each row's visible range
    [lo, hi] where the block is cut. ``ONE_SIDED`` (packed documents): only the sides that cut the block are
    compared, so a block holding a document's start but no row's last visible column (the first block of a
    document) costs one comparison per element, not two; without documents only the diagonal blocks are cut,
    where the one combined test is as fast (and keeps the kernels' code as it was measured)."""
    if ONE_SIDED:
        if start < full_lo:  # some row's range starts after the block's first column
            x = gl.where(start + gl.arange(0, BLOCK, layout=col_layout)[None, :] >= lo[:, None], x, other)
        if start + BLOCK - 1 > full_hi:  # some row's range ends before the block's last column
            x = gl.where(start + gl.arange(0, BLOCK, layout=col_layout)[None, :] <= hi[:, None], x, other)
    elif (start < full_lo) | (start + BLOCK - 1 > full_hi):
        offs = start + gl.arange(0, BLOCK, layout=col_layout)
        x = gl.where((offs[None, :] >= lo[:, None]) & (offs[None, :] <= hi[:, None]), x, other)
    return x


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
        full_lo, full_hi, any_lo, any_hi = _block_bounds(lo, hi)  # the queries all / any of these keys see
    elif CAUSAL:
        any_lo = n0 + row0
        any_hi = S
    else:
        any_lo = 0
        any_hi = S
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
        if (m0 <= any_hi) & (m0 + BLOCK_M > any_lo):  # a block none of these keys' queries lie in: skipped
            if HAS_DOCS:
                st, dpt, dk, dv = _dkdv_block(k_mine, v_mine, q_smem.index(s), do_smem.index(s), lse_smem.index(s),
                                              delta_smem.index(s), st, dpt, dk, dv, m0, n0 + row0, offs_n, lo, hi,
                                              full_lo, full_hi, qk_scale, CAUSAL, True, BLOCK_M, ROWS, col_layout,
                                              a_layout)
            else:  # no per-key ranges (the block bounds stand in for them, unused)
                st, dpt, dk, dv = _dkdv_block(k_mine, v_mine, q_smem.index(s), do_smem.index(s), lse_smem.index(s),
                                              delta_smem.index(s), st, dpt, dk, dv, m0, n0 + row0, offs_n, any_lo,
                                              any_hi, any_lo, any_hi, qk_scale, CAUSAL, False, BLOCK_M, ROWS,
                                              col_layout, a_layout)
        mbarrier.arrive(empty.index(s))
    # these keys' K and V are no longer read: their rows stage the results for the TMA stores (rows past S clipped)
    k_mine.store((dk * sm_scale).to(dtype))
    v_mine.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [n0 + row0, 0], k_mine)
    tma.async_copy_shared_to_global(dv_desc, [n0 + row0, 0], v_mine)
    tma.store_wait(pendings=0)


@gluon.jit
def _dkdv_block(k_mine, v_mine, q_s, do_s, lse_s, delta_s, st, dpt, dk, dv, m0, key0, offs_n, lo, hi, full_lo,
                full_hi, qk_scale, CAUSAL: gl.constexpr, RANGES: gl.constexpr, BLOCK_M: gl.constexpr,
                ROWS: gl.constexpr, col_layout: gl.constexpr, a_layout: gl.constexpr):
    """One query block's share of dK, dV for a consumer's keys (rows key0 + i, ``offs_n``) from one ring slot (Q,
    dO, their log-sum-exp and delta): returns (S^T, dP^T, dK, dV), the first two for the next block's registers.
    ``RANGES``: mask by each key's visible query range [lo, hi] where the block is cut; otherwise only a causal
    diagonal block (lo, hi and the bounds unused; with ranges offs_n is unused)."""
    dtype: gl.constexpr = k_mine.dtype
    st_tok = warpgroup_mma(k_mine, q_s.permute((1, 0)), st, use_acc=False, is_async=True)
    dpt_tok = warpgroup_mma(v_mine, do_s.permute((1, 0)), dpt, use_acc=False, is_async=True)
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=col_layout)
    lse2 = lse_s.load(col_layout)
    delta = delta_s.load(col_layout)
    st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok, ))
    pt = gl.exp2(st * qk_scale - lse2[None, :])  # (ROWS, BLOCK_M)
    if RANGES:  # a document's edge, the diagonal, the end
        pt = _mask_cut(pt, m0, lo, hi, full_lo, full_hi, 0.0, BLOCK_M, col_layout, True)
    elif CAUSAL:
        if m0 < key0 + ROWS - 1:  # a block on the diagonal: keys after a query are masked
            pt = gl.where(offs_n[:, None] <= offs_m[None, :], pt, 0.0)
    dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_s, dv, is_async=True)
    dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt_tok, ))
    dst = pt * (dpt - delta[None, :])
    dk = warpgroup_mma(gl.convert_layout(dst.to(dtype), a_layout), q_s, dk, is_async=True)
    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    return st, dpt, dk, dv


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


# ------------------------------------------------------------------------------------ persistent dK/dV
@gluon.jit
def _kv_item(w, S, HKV, B, ITEM_PAIRS, BLOCK_N: gl.constexpr):
    """Work item w of the persistent dK/dV: (batch, KV head, first key). The B * HKV (batch, KV head) pairs go in
    groups of ITEM_PAIRS (the last group may hold fewer; fewer pairs at a time: less Q and dO to keep in L2), one
    group after the other; within a group items go by key block, the first (seen by the most queries, when
    causal) first, every pair of the group at a block before the next block."""
    n_kb = gl.cdiv(S, BLOCK_N)
    g = w // (ITEM_PAIRS * n_kb)
    r = w - g * ITEM_PAIRS * n_kb
    pairs = gl.minimum(ITEM_PAIRS, B * HKV - g * ITEM_PAIRS)
    bh = g * ITEM_PAIRS + r % pairs
    return bh // HKV, bh % HKV, (r // pairs) * BLOCK_N


@gluon.jit
def _store_kv_item(rows_smem, meta_smem, kb, BOUNDS, b, B, S, n0, first, n_blocks, CAUSAL: gl.constexpr,
                   HAS_DOCS: gl.constexpr, BLOCK_N: gl.constexpr, ROWS: gl.constexpr):
    """The producer's share of a key block's set-up (as _store_item for queries): per key the queries that see it,
    [lo, hi] (its document's, from the key on when causal; empty past S), and the block counts and bounds."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=layout)
    in_seq = offs_n < S
    if HAS_DOCS:
        lo = gl.load(BOUNDS + b * S + offs_n, mask=in_seq, other=S)
        hi = gl.load(BOUNDS + (B + b) * S + offs_n, mask=in_seq, other=-1)
    else:
        lo = offs_n * 0
        hi = gl.where(in_seq, S - 1, -1)
    if CAUSAL:
        lo = gl.maximum(lo, offs_n)
    _store_ranges(rows_smem, meta_smem, kb, lo, hi, first, n_blocks, BLOCK_N, ROWS)


@gluon.jit
def _dkdv_producer_p(q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                     rows_smem, meta_smem, kv_ready, kv_empty, ready, empty, LSE2, DELTA, BOUNDS, S, H, GROUP, B,
                     n_items, ITEM_PAIRS, CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr):
    """Per item: its K and V into one of two buffers once the consumers freed it, with the item's set-up
    (_store_kv_item), then for each query head of the group the query blocks into the ring as in _producer,
    running ahead into the next item while the consumers finish this one."""
    vec_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    t = 0
    i = 0
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, hk, n0 = _kv_item(w, S, H // GROUP, B, ITEM_PAIRS, BLOCK_N)
        q_lo = n0 * 0
        q_hi = n0 * 0 + S
        if HAS_DOCS:
            q_lo, q_hi = _documents_reach(BOUNDS + b * S, BOUNDS + (B + b) * S, n0, S, BLOCK_N, 1)
        if CAUSAL:
            q_lo = gl.maximum(q_lo, n0)
        first = q_lo // BLOCK_M
        n_blocks = gl.maximum(gl.cdiv(q_hi, BLOCK_M) - first, 0)
        kb = i % 2
        mbarrier.wait(kv_empty.index(kb), ((i // 2) & 1) ^ 1)
        mbarrier.expect(kv_ready.index(kb), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], kv_ready.index(kb), k_smem.index(kb).reshape(
            k_desc.block_type.shape))
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], kv_ready.index(kb), v_smem.index(kb).reshape(
            v_desc.block_type.shape))
        _store_kv_item(rows_smem, meta_smem, kb, BOUNDS, b, B, S, n0, first, n_blocks, CAUSAL, HAS_DOCS, BLOCK_N,
                       ROWS)
        mbarrier.arrive(kv_ready.index(kb))
        for u in range(GROUP * n_blocks):
            s = t % STAGES
            h = hk * GROUP + u // n_blocks
            mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            m0 = (first + u % n_blocks) * BLOCK_M
            tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], ready.index(s), q_smem.index(s).reshape(
                q_desc.block_type.shape))
            tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], ready.index(s), do_smem.index(s).reshape(
                do_desc.block_type.shape))
            offs_m = m0 + gl.arange(0, BLOCK_M, layout=vec_layout)
            in_seq = offs_m < S
            lse_smem.index(s).store(gl.load(LSE2 + (b * H + h) * S + offs_m, mask=in_seq, other=0.0))
            delta_smem.index(s).store(gl.load(DELTA + (b * H + h) * S + offs_m, mask=in_seq, other=0.0))
            mbarrier.arrive(ready.index(s))
            t += 1
        i += 1


@gluon.jit
def _dkdv_consumer_p(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, meta_smem, kv_ready, kv_empty,
                     ready, empty, dk_desc, dv_desc, S, H, GROUP, B, n_items, ITEM_PAIRS, row0, qk_scale,
                     sm_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ROWS: gl.constexpr,
                     STAGES: gl.constexpr, WARPS: gl.constexpr):
    """Per item, dK, dV of keys [n0 + row0, n0 + row0 + ROWS) as _consumer computes them, with the key ranges and
    block bounds from the producer; the results leave by TMA from the K / V rows they replace, and the K/V
    buffer goes back to the producer once those stores have read it, checked at the next item's start."""
    dtype: gl.constexpr = k_smem.dtype
    st_layout: gl.constexpr = _mma_layout(WARPS, BLOCK_M)
    acc_layout: gl.constexpr = _mma_layout(WARPS, HEAD_DIM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)  # per query
    row_layout: gl.constexpr = gl.SliceLayout(1, st_layout)  # per key
    box: gl.constexpr = [1, 1, BLOCK_N, HEAD_DIM]
    st = gl.zeros([ROWS, BLOCK_M], gl.float32, layout=st_layout)
    dpt = gl.zeros([ROWS, BLOCK_M], gl.float32, layout=st_layout)
    t = 0
    i = 0
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, hk, n0 = _kv_item(w, S, H // GROUP, B, ITEM_PAIRS, BLOCK_N)
        kb = i % 2
        mbarrier.wait(kv_ready.index(kb), (i // 2) & 1)
        first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi = _load_item(rows_smem, meta_smem, kb, row0, ROWS,
                                                                              row_layout, WARPS)
        if i > 0:  # the previous item's dK/dV stores have read its K/V buffer: back to the producer
            tma.store_wait(pendings=0)
            mbarrier.arrive(kv_empty.index(1 - kb))
        k_mine = k_smem.index(kb).slice(row0, ROWS)
        v_mine = v_smem.index(kb).slice(row0, ROWS)
        dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
        dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
        for u in range(GROUP * n_blocks):
            s = t % STAGES
            m0 = (first + u % n_blocks) * BLOCK_M
            mbarrier.wait(ready.index(s), (t // STAGES) & 1)
            if (m0 <= any_hi) & (m0 + BLOCK_M > any_lo):  # a block none of these keys' queries lie in: skipped
                st, dpt, dk, dv = _dkdv_block(k_mine, v_mine, q_smem.index(s), do_smem.index(s), lse_smem.index(s),
                                              delta_smem.index(s), st, dpt, dk, dv, m0, n0 + row0, lo, lo, hi,
                                              full_lo, full_hi, qk_scale, True, True, BLOCK_M, ROWS, col_layout,
                                              a_layout)
            mbarrier.arrive(empty.index(s))
            t += 1
        k_mine.store((dk * sm_scale).to(dtype))
        v_mine.store(dv.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [b, hk, n0 + row0, 0],
                                        k_smem.index(kb).reshape(box).slice(row0, ROWS, dim=2))
        tma.async_copy_shared_to_global(dv_desc, [b, hk, n0 + row0, 0],
                                        v_smem.index(kb).reshape(box).slice(row0, ROWS, dim=2))
        i += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _head_descriptors(Q, K, V, DO, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdob, sdoh, sdos, S, H, HKV, B,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """4-D TMA descriptors of Q and dO ([batch, head, row, dim] boxes of BLOCK_M rows of one head) and of K and V
    (BLOCK_N rows of one KV head); rows past S zero-filled on loads."""
    smem4: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    return (tma.make_tensor_descriptor(Q, [B, H, S, HEAD_DIM], [sqb, sqh, sqs, 1], [1, 1, BLOCK_M, HEAD_DIM], smem4),
            tma.make_tensor_descriptor(DO, [B, H, S, HEAD_DIM], [sdob, sdoh, sdos, 1], [1, 1, BLOCK_M, HEAD_DIM],
                                       smem4),
            tma.make_tensor_descriptor(K, [B, HKV, S, HEAD_DIM], [skb, skh, sks, 1], [1, 1, BLOCK_N, HEAD_DIM], smem4),
            tma.make_tensor_descriptor(V, [B, HKV, S, HEAD_DIM], [svb, svh, svs, 1], [1, 1, BLOCK_N, HEAD_DIM], smem4))


@gluon.jit
def _attn_bwd_dkdv_persistent(Q, K, V, DO, LSE2, DELTA, DK, DV, BOUNDS, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
                              sdob, sdoh, sdos, sdkb, sdkh, sdks, sdvb, sdvh, sdvs, S, H, GROUP, B, S_KEY, qk_scale,
                              sm_scale, ITEM_PAIRS, CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr, HEAD_DIM: gl.constexpr,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                              SPLIT: gl.constexpr, num_warps: gl.constexpr):
    """dK/dV made persistent (one program per SM over (batch, KV head, key block) items; two 4-warp consumers,
    ``SPLIT`` must be set): K/V double-buffered and each item's key ranges stored by the producer, so that an
    item's K/V loads, set-up and result stores overlap the neighbouring items' matmuls."""
    dtype: gl.constexpr = Q.dtype.element_ty
    ROWS: gl.constexpr = BLOCK_N // 2
    HKV = H // GROUP
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    smem4: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    q_desc, do_desc, k_desc, v_desc = _head_descriptors(Q, K, V, DO, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
                                                        sdob, sdoh, sdos, S, H, HKV, B, HEAD_DIM, BLOCK_M, BLOCK_N)
    dk_desc = tma.make_tensor_descriptor(DK, [B, HKV, S, HEAD_DIM], [sdkb, sdkh, sdks, 1], [1, 1, ROWS, HEAD_DIM],
                                         smem4)
    dv_desc = tma.make_tensor_descriptor(DV, [B, HKV, S, HEAD_DIM], [sdvb, sdvh, sdvs, 1], [1, 1, ROWS, HEAD_DIM],
                                         smem4)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], smem)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], smem)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], smem)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], smem)
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)
    rows_smem, meta_smem = _item_buffers(BLOCK_N, True)
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    _init_ring(kv_ready, kv_empty, 2, 2, True)  # ready: the TMA's expect and the producer's arrive (the set-up)
    _init_ring(ready, empty, STAGES, 2, True)  # ready: the TMA's expect and the producer's arrive (lse, delta)
    n_items = gl.cdiv(S, BLOCK_N) * B * HKV
    gl.warp_specialize([
        (_dkdv_consumer_p, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, meta_smem, kv_ready,
                            kv_empty, ready, empty, dk_desc, dv_desc, S, H, GROUP, B, n_items, ITEM_PAIRS, 0, qk_scale,
                            sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, ROWS, STAGES, num_warps)),
        (_dkdv_consumer_p, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, meta_smem, kv_ready,
                            kv_empty, ready, empty, dk_desc, dv_desc, S, H, GROUP, B, n_items, ITEM_PAIRS, ROWS,
                            qk_scale, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, ROWS, STAGES, num_warps)),
        (_dkdv_producer_p, (q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                            rows_smem, meta_smem, kv_ready, kv_empty, ready, empty, LSE2, DELTA, BOUNDS, S, H, GROUP,
                            B, n_items, ITEM_PAIRS, CAUSAL, HAS_DOCS, BLOCK_M, BLOCK_N, STAGES, ROWS)),
    ], [num_warps, 1], [240, 24])


# --------------------------------------------------------------------------------------------------- dQ
@gluon.jit
def _key_blocks(START, END, m0, S, CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """(first, count): the key blocks that queries [m0, m0 + BLOCK_M) can see."""
    k_lo = m0 * 0
    k_hi = m0 * 0 + S
    if HAS_DOCS:
        k_lo, k_hi = _documents_reach(START, END, m0, S, BLOCK_M, num_warps)
    if CAUSAL:
        k_hi = gl.minimum(k_hi, m0 + BLOCK_M)  # keys after the block's last query are seen by none
    first = k_lo // BLOCK_N
    return first, gl.maximum(gl.cdiv(k_hi, BLOCK_N) - first, 0)


@gluon.jit
def _item_coords(w, S, H, B, ITEM_HEADS, BLOCK_M: gl.constexpr, GROUPED: gl.constexpr):
    """Work item w of the persistent forward and dQ: (batch, query head, first query). Items go by query block, the
    last (longest, when causal) first, every (batch, head) pair of a block before the next. ``GROUPED``: the B * H
    pairs go in groups of ITEM_HEADS, one group after the other (fewer heads at a time: less K/V to keep in L2),
    each group in that order (the last group may hold fewer pairs)."""
    if GROUPED:
        n_mb = gl.cdiv(S, BLOCK_M)
        g = w // (ITEM_HEADS * n_mb)
        r = w - g * ITEM_HEADS * n_mb
        heads = gl.minimum(ITEM_HEADS, B * H - g * ITEM_HEADS)
        bh = g * ITEM_HEADS + r % heads
        b = bh // H
        h = bh % H
        m0 = (n_mb - 1 - r // heads) * BLOCK_M
    else:
        b = (w % (B * H)) // H
        h = w % H
        m0 = (gl.cdiv(S, BLOCK_M) - 1 - w // (B * H)) * BLOCK_M
    return b, h, m0


@gluon.jit
def _part_bounds(rows, lo, hi, r0, ROWS: gl.constexpr):
    """_block_bounds of rows [r0, r0 + ROWS) among ``rows`` (the others neutral)."""
    mine = (rows >= r0) & (rows < r0 + ROWS)
    big = 1 << 30
    return (gl.max(gl.where(mine, lo, -big), 0), gl.min(gl.where(mine, hi, big), 0),
            gl.min(gl.where(mine, lo, big), 0), gl.max(gl.where(mine, hi, -big), 0))


@gluon.jit
def _store_item(rows_smem, meta_smem, qb, BOUNDS, b, B, S, m0, first, n_blocks, CAUSAL: gl.constexpr,
                HAS_DOCS: gl.constexpr, BLOCK_M: gl.constexpr, ROWS: gl.constexpr):
    """The producer's share of an item's set-up, stored with its Q so that no consumer waits on global loads or
    cross-warp reductions between items: each row's visible keys [lo, hi] (rows_smem[2 qb], [2 qb + 1]) and 16
    int32 (meta_smem[qb]): the key blocks (first, count), then per consumer of ROWS rows its block-level bounds
    (_block_bounds)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=layout)
    lo, hi = _visible_keys(BOUNDS, b, B, S, offs_m, offs_m < S, CAUSAL, HAS_DOCS)
    _store_ranges(rows_smem, meta_smem, qb, lo, hi, first, n_blocks, BLOCK_M, ROWS)


@gluon.jit
def _store_ranges(rows_smem, meta_smem, qb, lo, hi, first, n_blocks, BLOCK_M: gl.constexpr, ROWS: gl.constexpr):
    """Per row [lo, hi] into rows_smem[2 qb], [2 qb + 1]; (first, n_blocks) and each consumer's block-level bounds
    into meta_smem[qb] (see _store_item); one warp."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    rows = gl.arange(0, BLOCK_M, layout=layout)
    rows_smem.index(2 * qb).store(lo)
    rows_smem.index(2 * qb + 1).store(hi)
    slot = gl.arange(0, 16, layout=layout)
    meta = gl.where(slot == 0, first, n_blocks)
    for c in gl.static_range(BLOCK_M // ROWS):
        full_lo, full_hi, any_lo, any_hi = _part_bounds(rows, lo, hi, c * ROWS, ROWS)
        meta = gl.where(slot == 2 + 4 * c, full_lo, meta)
        meta = gl.where(slot == 3 + 4 * c, full_hi, meta)
        meta = gl.where(slot == 4 + 4 * c, any_lo, meta)
        meta = gl.where(slot == 5 + 4 * c, any_hi, meta)
    meta_smem.index(qb).store(meta)


@gluon.jit
def _load_item(rows_smem, meta_smem, qb, row0: gl.constexpr, ROWS: gl.constexpr, row_layout: gl.constexpr,
               WARPS: gl.constexpr):
    """A consumer's view of what _store_item stored: (first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi)
    for its rows [row0, row0 + ROWS)."""
    layout: gl.constexpr = gl.BlockedLayout([16], [32], [WARPS], [0])  # every thread holds all 16
    meta = meta_smem.index(qb).load(layout)
    slot = gl.arange(0, 16, layout=layout)
    c = 2 + 4 * (row0 // ROWS)
    lo = rows_smem.index(2 * qb).slice(row0, ROWS).load(row_layout)
    hi = rows_smem.index(2 * qb + 1).slice(row0, ROWS).load(row_layout)
    return (gl.sum(gl.where(slot == 0, meta, 0), 0), gl.sum(gl.where(slot == 1, meta, 0), 0),
            gl.sum(gl.where(slot == c, meta, 0), 0), gl.sum(gl.where(slot == c + 1, meta, 0), 0),
            gl.sum(gl.where(slot == c + 2, meta, 0), 0), gl.sum(gl.where(slot == c + 3, meta, 0), 0), lo, hi)


@gluon.jit
def _item_bounds(BOUNDS, b, B, S, m0, offs_m, in_seq, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, WARPS: gl.constexpr):
    """Without packed documents, a consumer's (first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi) of an item,
    computed without loads (with documents it reads what the producer stored: _load_item)."""
    first, n_blocks = _key_blocks(BOUNDS, BOUNDS, m0, S, CAUSAL, False, BLOCK_M, BLOCK_N, WARPS)
    lo, hi = _visible_keys(BOUNDS, b, B, S, offs_m, in_seq, CAUSAL, False)
    full_lo, full_hi, any_lo, any_hi = _block_bounds(lo, hi)  # the keys all / any of these rows see
    return first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi


@gluon.jit
def _query_rings(STAGES: gl.constexpr, SPLIT: gl.constexpr, HAS_DOCS: gl.constexpr):
    """The persistent dQ's and forward's mbarriers: (ready, empty) of the two Q buffers (ready after the TMA's
    expect, and with packed documents the producer's arrive, see _store_item), then of the K/V ring."""
    Q_ARRIVALS: gl.constexpr = 2 if HAS_DOCS else 1
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    _init_ring(q_ready, q_empty, 2, Q_ARRIVALS, SPLIT)
    _init_ring(ready, empty, STAGES, 1, SPLIT)
    return q_ready, q_empty, ready, empty


@gluon.jit
def _item_buffers(BLOCK_M: gl.constexpr, HAS_DOCS: gl.constexpr):
    """Per Q buffer, what _store_item stores: the rows' visible key ranges and 16 int32 of block counts and bounds
    (a token size without documents, where nothing is stored: the shared memory laid out as before)."""
    layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    ROWS_STORED: gl.constexpr = BLOCK_M if HAS_DOCS else 1
    META: gl.constexpr = 16 if HAS_DOCS else 1
    return (gl.allocate_shared_memory(gl.int32, [4, ROWS_STORED], layout),
            gl.allocate_shared_memory(gl.int32, [2, META], layout))


@gluon.jit
def _visible_keys(BOUNDS, b, B, S, offs_m, in_seq, CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr):
    """Per query ``offs_m`` of batch row b: the keys it sees, [lo, hi] (empty past S or for padding)."""
    if HAS_DOCS:
        lo = gl.load(BOUNDS + b * S + offs_m, mask=in_seq, other=S)
        hi = gl.minimum(gl.load(BOUNDS + (B + b) * S + offs_m, mask=in_seq, other=-1), S - 1)
    else:
        lo = offs_m * 0
        hi = gl.where(in_seq, S - 1, -1)
    if CAUSAL:
        hi = gl.minimum(hi, offs_m)
    return lo, hi


@gluon.jit
def _query_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, rows_smem, meta_smem, q_ready,
                    q_empty, ready, empty, BOUNDS, S, H, GROUP, B, ITEM_HEADS, n_items, CAUSAL: gl.constexpr,
                    HAS_DOCS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    WITH_DO: gl.constexpr, ROWS: gl.constexpr, GROUPED: gl.constexpr):
    """The persistent dQ's and forward's producer. Per work item: its queries' Q (and dO, ``WITH_DO``) into one of
    two buffers once the consumers freed it, with the item's set-up (_store_item), then its key blocks' K and V
    into the ring, running ahead into the next item while the consumers finish this one."""
    t = 0  # key blocks loaded so far: the ring's position and phase
    i = 0  # items so far: the Q/dO buffer's position and phase
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, m0 = _item_coords(w, S, H, B, ITEM_HEADS, BLOCK_M, GROUPED)
        first, n_blocks = _key_blocks(BOUNDS + b * S, BOUNDS + (B + b) * S, m0, S, CAUSAL, HAS_DOCS, BLOCK_M, BLOCK_N,
                                      1)
        qb = i % 2
        mbarrier.wait(q_empty.index(qb), ((i // 2) & 1) ^ 1)  # the first pass over a fresh buffer goes at once
        if WITH_DO:
            mbarrier.expect(q_ready.index(qb), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        else:
            mbarrier.expect(q_ready.index(qb), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], q_ready.index(qb), q_smem.index(qb).reshape(
            q_desc.block_type.shape))
        if WITH_DO:
            tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], q_ready.index(qb), do_smem.index(qb).reshape(
                do_desc.block_type.shape))
        if HAS_DOCS:  # (without, the consumers compute the item's bounds themselves, without loads)
            _store_item(rows_smem, meta_smem, qb, BOUNDS, b, B, S, m0, first, n_blocks, CAUSAL, HAS_DOCS, BLOCK_M,
                        ROWS)
            mbarrier.arrive(q_ready.index(qb))  # the second arrival: the stores above are visible to the waiters
        for j in range(n_blocks):
            s = t % STAGES
            mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            n0 = (first + j) * BLOCK_N
            tma.async_copy_global_to_shared(k_desc, [b, h // GROUP, n0, 0], ready.index(s), k_smem.index(s).reshape(
                k_desc.block_type.shape))
            tma.async_copy_global_to_shared(v_desc, [b, h // GROUP, n0, 0], ready.index(s), v_smem.index(s).reshape(
                v_desc.block_type.shape))
            t += 1
        i += 1


@gluon.jit
def _dq_consumer(q_smem, do_smem, k_smem, v_smem, rows_smem, meta_smem, q_ready, q_empty, ready, empty, dq_desc, LSE2,
                 DELTA, BOUNDS, S, H, B, ITEM_HEADS, n_items, row0, qk_scale, sm_scale, CAUSAL: gl.constexpr,
                 HAS_DOCS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 ROWS: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, GROUPED: gl.constexpr):
    """Per work item, dQ of queries [m0 + row0, m0 + row0 + ROWS): per key block S = Q K^T and dP = dO V^T issued
    together, P = exp2(S - lse) while dP runs, dS = P (dP - delta), dQ += dS K with dS from registers. Query i
    sees the keys [lo[i], hi[i]]; a block inside every row's range is not masked. dQ leaves by TMA from the Q
    buffer's rows it replaces; the buffer goes back to the producer once the store has read it, checked only
    after the next item's set-up."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _mma_layout(WARPS, BLOCK_N)
    acc_layout: gl.constexpr = _mma_layout(WARPS, HEAD_DIM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # per query
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per key
    sc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    dp = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    t = 0
    i = 0
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, m0 = _item_coords(w, S, H, B, ITEM_HEADS, BLOCK_M, GROUPED)
        offs_m = m0 + row0 + gl.arange(0, ROWS, layout=row_layout)
        in_seq = offs_m < S
        # first read after the first S = Q K^T: these loads' latency hides behind the waits and that matmul
        lse2 = gl.load(LSE2 + (b * H + h) * S + offs_m, mask=in_seq, other=float("inf"))
        delta = gl.load(DELTA + (b * H + h) * S + offs_m, mask=in_seq, other=0.0)
        if not HAS_DOCS:
            first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi = _item_bounds(
                BOUNDS, b, B, S, m0, offs_m, in_seq, CAUSAL, BLOCK_M, BLOCK_N, WARPS)
        qb = i % 2
        q_mine = q_smem.index(qb).slice(row0, ROWS)
        do_mine = do_smem.index(qb).slice(row0, ROWS)
        dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
        mbarrier.wait(q_ready.index(qb), (i // 2) & 1)
        if HAS_DOCS:
            first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi = _load_item(rows_smem, meta_smem, qb, row0,
                                                                                  ROWS, row_layout, WARPS)
            if i > 0:  # short items: the previous item's dQ store was left to read its Q buffer till now
                tma.store_wait(pendings=0)
                mbarrier.arrive(q_empty.index(1 - qb))
        for j in range(n_blocks):
            s = t % STAGES
            n0 = (first + j) * BLOCK_N
            mbarrier.wait(ready.index(s), (t // STAGES) & 1)
            if (n0 <= any_hi) & (n0 + BLOCK_N > any_lo):  # a block none of these rows sees: skipped
                s_tok = warpgroup_mma(q_mine, k_smem.index(s).permute((1, 0)), sc, use_acc=False, is_async=True)
                dp_tok = warpgroup_mma(do_mine, v_smem.index(s).permute((1, 0)), dp, use_acc=False, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
                p = gl.exp2(sc * qk_scale - lse2[:, None])  # (ROWS, BLOCK_N)
                p = _mask_cut(p, n0, lo, hi, full_lo, full_hi, 0.0, BLOCK_N, col_layout, HAS_DOCS)  # diagonal, edges
                dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
                ds = p * (dp - delta[:, None])
                dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), k_smem.index(s), dq, is_async=True)
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
            mbarrier.arrive(empty.index(s))
            t += 1
        # these queries' Q is no longer read: its rows stage the result for the TMA store (rows past S clipped)
        q_mine.store((dq * sm_scale).to(dtype))
        fence_async_shared()
        box: gl.constexpr = [1, 1, BLOCK_M, HEAD_DIM]  # Gluon reshapes a buffer, not a slice: reshape, then slice
        tma.async_copy_shared_to_global(dq_desc, [b, h, m0 + row0, 0],
                                        q_smem.index(qb).reshape(box).slice(row0, ROWS, dim=2))
        if not HAS_DOCS:
            tma.store_wait(pendings=0)
            mbarrier.arrive(q_empty.index(qb))
        i += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _attn_bwd_dq_hopper(Q, K, V, DO, LSE2, DELTA, DQ, BOUNDS, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdob, sdoh,
                        sdos, sdqb, sdqh, sdqs, S, H, GROUP, B, S_KEY, qk_scale, sm_scale, ITEM_HEADS,
                        CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, GROUPED: gl.constexpr,
                        num_warps: gl.constexpr):
    """Persistent: one program per SM walks work items (batch, head, query block)."""
    dtype: gl.constexpr = Q.dtype.element_ty
    ROWS: gl.constexpr = BLOCK_M // 2 if SPLIT else BLOCK_M
    HKV = H // GROUP
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    smem4: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    # [batch, head, row, dim] boxes of one head: rows past S zero-filled on loads and clipped on stores
    q_desc, do_desc, k_desc, v_desc = _head_descriptors(Q, K, V, DO, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
                                                        sdob, sdoh, sdos, S, H, HKV, B, HEAD_DIM, BLOCK_M, BLOCK_N)
    dq_desc = tma.make_tensor_descriptor(DQ, [B, H, S, HEAD_DIM], [sdqb, sdqh, sdqs, 1], [1, 1, ROWS, HEAD_DIM],
                                         smem4)
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], smem)
    do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], smem)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem)
    q_ready, q_empty, ready, empty = _query_rings(STAGES, SPLIT, HAS_DOCS)
    rows_smem, meta_smem = _item_buffers(BLOCK_M, HAS_DOCS)
    n_items = gl.cdiv(S, BLOCK_M) * B * H
    if SPLIT:  # two consumer partitions of ROWS queries each, then the producer
        gl.warp_specialize([
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, rows_smem, meta_smem, q_ready, q_empty, ready, empty,
                            dq_desc, LSE2, DELTA, BOUNDS, S, H, B, ITEM_HEADS, n_items, 0, qk_scale, sm_scale,
                            CAUSAL, HAS_DOCS, HEAD_DIM, BLOCK_M, BLOCK_N, ROWS, STAGES, num_warps, GROUPED)),
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, rows_smem, meta_smem, q_ready, q_empty, ready, empty,
                            dq_desc, LSE2, DELTA, BOUNDS, S, H, B, ITEM_HEADS, n_items, ROWS, qk_scale, sm_scale,
                            CAUSAL, HAS_DOCS, HEAD_DIM, BLOCK_M, BLOCK_N, ROWS, STAGES, num_warps, GROUPED)),
            (_query_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, rows_smem,
                               meta_smem, q_ready, q_empty, ready, empty, BOUNDS, S, H, GROUP, B, ITEM_HEADS,
                               n_items, CAUSAL, HAS_DOCS, BLOCK_M, BLOCK_N, STAGES, True, ROWS, GROUPED)),
        ], [num_warps, 1], [240, 24])
    else:  # one consumer partition of all BLOCK_M queries, then the producer
        gl.warp_specialize([
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, rows_smem, meta_smem, q_ready, q_empty, ready, empty,
                            dq_desc, LSE2, DELTA, BOUNDS, S, H, B, ITEM_HEADS, n_items, 0, qk_scale, sm_scale,
                            CAUSAL, HAS_DOCS, HEAD_DIM, BLOCK_M, BLOCK_N, ROWS, STAGES, num_warps, GROUPED)),
            (_query_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, rows_smem,
                               meta_smem, q_ready, q_empty, ready, empty, BOUNDS, S, H, GROUP, B, ITEM_HEADS,
                               n_items, CAUSAL, HAS_DOCS, BLOCK_M, BLOCK_N, STAGES, True, ROWS, GROUPED)),
        ], [1], [24])


# ---------------------------------------------------------------------------------------------- forward
@gluon.jit
def _fwd_consumer(q_smem, k_smem, v_smem, o_smem, rows_smem, meta_smem, q_ready, q_empty, ready, empty, o_desc, LSE,
                  BOUNDS, S, H, B, ITEM_HEADS, n_items, qk_scale, row0, CAUSAL: gl.constexpr,
                  HAS_DOCS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  ROWS: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, GROUPED: gl.constexpr):
    """Per work item, O and the log-sum-exp of queries [m0 + row0, m0 + row0 + ROWS): per key block S = Q K^T,
    the online softmax in registers, O += P V with P from registers. Query i sees the keys [lo[i], hi[i]]; a block
    inside every row's range is not masked, a block outside all of them is skipped. O leaves through this
    consumer's staging buffer by TMA, whose store is waited for only before the next item's."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _mma_layout(WARPS, BLOCK_N)
    acc_layout: gl.constexpr = _mma_layout(WARPS, HEAD_DIM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # per query
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per key
    acc_rows: gl.constexpr = gl.SliceLayout(1, acc_layout)
    sc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    t = 0
    i = 0
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, m0 = _item_coords(w, S, H, B, ITEM_HEADS, BLOCK_M, GROUPED)
        offs_m = m0 + row0 + gl.arange(0, ROWS, layout=row_layout)
        in_seq = offs_m < S
        if not HAS_DOCS:
            first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi = _item_bounds(
                BOUNDS, b, B, S, m0, offs_m, in_seq, CAUSAL, BLOCK_M, BLOCK_N, WARPS)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)  # running max, raw scores
        l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
        qb = i % 2
        q_mine = q_smem.index(qb).slice(row0, ROWS)
        mbarrier.wait(q_ready.index(qb), (i // 2) & 1)
        if HAS_DOCS:
            first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi = _load_item(rows_smem, meta_smem, qb, row0,
                                                                                  ROWS, row_layout, WARPS)
        for j in range(n_blocks):
            s = t % STAGES
            n0 = (first + j) * BLOCK_N
            mbarrier.wait(ready.index(s), (t // STAGES) & 1)
            if (n0 <= any_hi) & (n0 + BLOCK_N > any_lo):
                s_tok = warpgroup_mma(q_mine, k_smem.index(s).permute((1, 0)), sc, use_acc=False, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
                sc = _mask_cut(sc, n0, lo, hi, full_lo, full_hi, float("-inf"), BLOCK_N, col_layout, HAS_DOCS)
                m_new = gl.maximum(m_i, gl.max(sc, 1))
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new) * qk_scale  # a row masked so far: no NaN
                p = gl.exp2(sc * qk_scale - m_use[:, None])  # (ROWS, BLOCK_N)
                alpha = gl.exp2(m_i * qk_scale - m_use)
                l_i = l_i * alpha + gl.sum(p, 1)
                acc = acc * gl.convert_layout(alpha, acc_rows)[:, None]
                acc = warpgroup_mma(gl.convert_layout(p.to(dtype), a_layout), v_smem.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                m_i = m_new
            mbarrier.arrive(empty.index(s))
            t += 1
        mbarrier.arrive(q_empty.index(qb))  # the last S = Q K^T is done: the producer may load the next Q here
        seen = l_i > 0.0
        lse = gl.where(seen, (m_i * qk_scale + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        out = acc / gl.convert_layout(gl.where(seen, l_i, 1.0), acc_rows)[:, None]
        gl.store(LSE + (b * H + h) * S + offs_m, lse, mask=in_seq)
        tma.store_wait(pendings=0)  # the previous item's O has left the staging buffer
        o_smem.store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, h, m0 + row0, 0], o_smem.reshape(o_desc.block_type.shape))
        i += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _attn_fwd_hopper(Q, K, V, O, LSE, BOUNDS, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos, S, H, GROUP,
                     B, S_KEY, qk_scale, ITEM_HEADS, CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     SPLIT: gl.constexpr, GROUPED: gl.constexpr, num_warps: gl.constexpr):
    """Persistent: one program per SM walks work items (batch, head, query block); two consumer partitions of
    BLOCK_M // 2 queries each (``SPLIT`` must be set), one producer warp."""
    dtype: gl.constexpr = Q.dtype.element_ty
    ROWS: gl.constexpr = BLOCK_M // 2
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    smem4: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    # [batch, head, row, dim] boxes of one head: rows past S zero-filled on loads and clipped on stores
    q_desc = tma.make_tensor_descriptor(Q, [B, H, S, HEAD_DIM], [sqb, sqh, sqs, 1], [1, 1, BLOCK_M, HEAD_DIM], smem4)
    k_desc = tma.make_tensor_descriptor(K, [B, H // GROUP, S, HEAD_DIM], [skb, skh, sks, 1],
                                        [1, 1, BLOCK_N, HEAD_DIM], smem4)
    v_desc = tma.make_tensor_descriptor(V, [B, H // GROUP, S, HEAD_DIM], [svb, svh, svs, 1],
                                        [1, 1, BLOCK_N, HEAD_DIM], smem4)
    o_desc = tma.make_tensor_descriptor(O, [B, H, S, HEAD_DIM], [sob, soh, sos, 1], [1, 1, ROWS, HEAD_DIM], smem4)
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], smem)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem)
    o_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], smem)
    q_ready, q_empty, ready, empty = _query_rings(STAGES, True, HAS_DOCS)
    rows_smem, meta_smem = _item_buffers(BLOCK_M, HAS_DOCS)
    n_items = gl.cdiv(S, BLOCK_M) * B * H
    gl.warp_specialize([
        (_fwd_consumer, (q_smem, k_smem, v_smem, o_smem.index(0), rows_smem, meta_smem, q_ready, q_empty,
                         ready, empty, o_desc, LSE, BOUNDS, S, H, B, ITEM_HEADS, n_items, qk_scale, 0, CAUSAL,
                         HAS_DOCS, HEAD_DIM, BLOCK_M, BLOCK_N, ROWS, STAGES, num_warps, GROUPED)),
        (_fwd_consumer, (q_smem, k_smem, v_smem, o_smem.index(1), rows_smem, meta_smem, q_ready, q_empty,
                         ready, empty, o_desc, LSE, BOUNDS, S, H, B, ITEM_HEADS, n_items, qk_scale, ROWS, CAUSAL,
                         HAS_DOCS, HEAD_DIM, BLOCK_M, BLOCK_N, ROWS, STAGES, num_warps, GROUPED)),
        (_query_producer, (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_smem, v_smem, rows_smem, meta_smem,
                           q_ready, q_empty, ready, empty, BOUNDS, S, H, GROUP, B, ITEM_HEADS, n_items, CAUSAL,
                           HAS_DOCS, BLOCK_M, BLOCK_N, STAGES, False, ROWS, GROUPED)),
    ], [num_warps, 1], [240, 24])


# (BLOCK_M, BLOCK_N, STAGES, SPLIT): candidates, chosen by autotuning on the first call of each key. SPLIT runs
# two consumer partitions of 4 warps, otherwise one of 8; 64 rows (keys for dK/dV, queries for dQ) per warpgroup.
_CONFIGS = {"dkdv": [(64, 128, 2, False), (64, 128, 2, True), (64, 128, 3, True)],
            "dkdv_p": [(64, 128, 2, True)],  # persistent: two 4-warp consumers; 3 stages exceed 227 KB at d128
            "dq": [(128, 64, 2, True), (128, 64, 3, True)],  # 8-warp dQ: slower everywhere
            "fwd": [(128, 128, 2, True)]}  # (128, 64, 3 | 4 stages) measured 0-15% slower on 9 shapes (NOTES v21)
_KERNELS = {"dkdv": _attn_bwd_dkdv_hopper, "dkdv_p": _attn_bwd_dkdv_persistent, "dq": _attn_bwd_dq_hopper,
            "fwd": _attn_fwd_hopper}
_TUNED: dict = {}


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, other: torch.Tensor, window: int, key_bounds) -> bool:
    """Whether these kernels compute the call (``other``: dout for the backward, out for the forward): sm_90,
    16-bit, head dim 64/128, no window, documents only within one sequence (no ``key_bounds``), and
    TMA-compatible (16-byte aligned) bases and strides."""
    if key_bounds is not None or window or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if q.shape[-1] not in (64, 128):
        return False
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    return all(t.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in t.stride()[:3]) for t in (q, k, v, other))


def dq_wins(head_dim: int, bounds) -> bool:
    """Whether the Gluon dQ kernel beats the Triton one here (same-run H100 timings, bench/NOTES.md v16): at
    head dim 128 1.08x causal, 1.09-1.12x on packed documents at 8k-16k (0.98x at 4k); at head dim 64 it takes
    10-20% more time."""
    return head_dim == 128


def persistent_dkdv_wins(head_dim: int, heads: int, kv_heads: int, bounds) -> bool:
    """Whether the persistent dK/dV (L2-sized item groups) beats the dK/dV kernel here (same-run H100 A/B,
    bench/NOTES.md v21): 1.09-1.20x on packed documents at head dim 128 without query-head groups; 0.97-1.00x
    causal, 0.82-0.85x on grouped-query documents (head dims 64 and 128)."""
    return head_dim == 128 and heads == kv_heads and bounds is not None


def _allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _config(m: int, n: int, stages: int, split: bool) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "STAGES": stages, "SPLIT": split}, num_warps=4 if split else 8,
                         num_stages=1)


def _launch(kind: str, grid_of, tensors, rest, causal: bool, bounds, dim: int, config, **extra) -> None:
    """Run kernel ``kind`` on (*tensors, bounds, *rest), autotuned (``config`` None) or with one fixed
    (BLOCK_M, BLOCK_N, STAGES, SPLIT); ``grid_of(BLOCK_M, BLOCK_N)`` gives the grid; ``extra``: more of the
    kernel's compile-time arguments."""
    triton.set_allocator(_allocator)  # device-side TMA descriptors live in a per-launch scratch buffer
    table = bounds if bounds is not None else torch.empty(1, dtype=torch.int32, device=tensors[0].device)
    args = (*tensors, table, *rest)
    consts = dict(CAUSAL=causal, HAS_DOCS=bounds is not None, HEAD_DIM=dim, **extra)
    if config is None:
        if kind not in _TUNED:
            _TUNED[kind] = triton.autotune(configs=[_config(*c) for c in _CONFIGS[kind]],
                                           key=["S_KEY", "GROUP", "HEAD_DIM", "CAUSAL", "HAS_DOCS"])(_KERNELS[kind])
        _TUNED[kind][lambda meta: grid_of(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **consts)
    else:
        c = _config(*config)
        _KERNELS[kind][grid_of(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"])](*args, **consts,
                                                                          num_warps=c.num_warps, **c.kwargs)


def _persistent_grid(q: torch.Tensor):
    """grid_of for the persistent kernels walking (batch, head, query block) items: one program per SM, fewer
    when there are fewer items."""
    bsz, heads, seq, _ = q.shape
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return lambda m, n: (min(sms, triton.cdiv(seq, m) * bsz * heads), )


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
    return _fit_l2(bsz * heads, 2 * seq * dim * k.element_size() * k.shape[1] // heads, q.device)  # K, V per head


def l2_pairs_per_group(q: torch.Tensor, k: torch.Tensor) -> int:
    """(batch, KV head) pairs per item group of the persistent dK/dV such that the Q and dO they read (whole
    sequences of the KV head's query heads) fill at most half of the device's L2."""
    bsz, heads, seq, dim = q.shape
    return _fit_l2(bsz * k.shape[1], 2 * seq * dim * q.element_size() * heads // k.shape[1], q.device)  # Q, dO


def forward(q, k, v, out, lse, causal: bool, bounds, scale: float, seq_key: int, config=None,
            heads_per_group: int | None = None) -> None:
    """Fill out (like q) and lse ((B, H, S) float32, natural log, -inf for a row that saw nothing) from q/k/v
    (B, H, S, D); ``bounds`` and ``config`` as for ``dkdv``. Persistent: one program per SM, walking the items of
    ``heads_per_group`` (batch, head) pairs at a time (None: as many as fit L2, l2_heads_per_group; B * H: all of
    them, by query block; see _item_coords)."""
    bsz, heads, seq, dim = q.shape
    group = _group_size(heads_per_group, lambda: l2_heads_per_group(q, k), bsz * heads, "heads_per_group")
    rest = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], seq, heads, heads // k.shape[1],
            bsz, seq_key, scale * LOG2E, group)
    _launch("fwd", _persistent_grid(q), (q, k, v, out, lse), rest, causal, bounds, dim, config,
            GROUPED=group < bsz * heads)


def dkdv(q, k, v, dout, lse2, delta, dk, dv, causal: bool, bounds, scale: float, seq_key: int, config=None,
         persistent: bool = False, pairs_per_group: int | None = None) -> None:
    """Fill dk, dv (like k, v) from q/k/v/dout (B, H, S, D), ``lse2`` (log-sum-exp in log2 units, +inf for a row
    that saw nothing) and ``delta`` (rowsum(O dO) - dLSE), both (B, H, S) float32; ``bounds``: None or the
    packed documents' per-token (first, last) index, (2, B, S) int32. ``config``: one fixed
    (BLOCK_M, BLOCK_N, STAGES, SPLIT) instead of autotuning (benchmarks, tests). ``persistent``: the persistent
    variant (_attn_bwd_dkdv_persistent), walking its items ``pairs_per_group`` (batch, KV head) pairs at a time
    (None: as many as fit L2, l2_pairs_per_group; see _kv_item)."""
    bsz, heads, seq, dim = q.shape
    rest = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dk.stride()[:3],
            *dv.stride()[:3], seq, heads, heads // k.shape[1], bsz, seq_key, scale * LOG2E, scale)
    if persistent:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        pairs = bsz * k.shape[1]
        group = _group_size(pairs_per_group, lambda: l2_pairs_per_group(q, k), pairs, "pairs_per_group")
        _launch("dkdv_p", lambda m, n: (min(sms, triton.cdiv(seq, n) * pairs), ),
                (q, k, v, dout, lse2, delta, dk, dv), (*rest, group), causal, bounds, dim, config)
        return
    _launch("dkdv", lambda m, n: (triton.cdiv(seq, n), bsz * k.shape[1]), (q, k, v, dout, lse2, delta, dk, dv), rest,
            causal, bounds, dim, config)


def dq(q, k, v, dout, lse2, delta, grad_q, causal: bool, bounds, scale: float, seq_key: int, config=None,
       heads_per_group: int | None = None) -> None:
    """Fill grad_q (like q); ``heads_per_group`` as for ``forward``, the other arguments as for ``dkdv``."""
    bsz, heads, seq, dim = q.shape
    group = _group_size(heads_per_group, lambda: l2_heads_per_group(q, k), bsz * heads, "heads_per_group")
    rest = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *grad_q.stride()[:3], seq, heads,
            heads // k.shape[1], bsz, seq_key, scale * LOG2E, scale, group)
    _launch("dq", _persistent_grid(q), (q, k, v, dout, lse2, delta, grad_q), rest, causal, bounds, dim, config,
            GROUPED=group < bsz * heads)

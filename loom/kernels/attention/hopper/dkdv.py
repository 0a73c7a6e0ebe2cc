"""The Gluon dK/dV kernels for Hopper: one program per key block (a producer warp loads K/V once, then each
query block's Q, dO, log-sum-exp and delta into a ring; one 8-warp or two 4-warp consumers issue the four matmuls
per block asynchronously), and its persistent variant (one program per SM walking (batch, KV head, key block)
items, K/V double-buffered)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from loom.kernels.attention.hopper.common import (
    block_bounds,
    documents_reach,
    head_descriptors,
    init_ring,
    item_buffers,
    load_item,
    mask_cut,
    mma_layout,
    store_ranges,
)


@gluon.jit
def _producer(
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    kv_bar,
    ready,
    empty,
    LSE2,
    DELTA,
    row0,
    S,
    n0,
    first,
    n_blocks,
    GROUP,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
):
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
        mbarrier.wait(
            empty.index(s), ((t // STAGES) & 1) ^ 1
        )  # the first pass over a fresh slot goes at once
        mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        m0 = (first + t % n_blocks) * BLOCK_M
        tma.async_copy_global_to_shared(
            q_desc, [g, m0, 0], ready.index(s), q_smem.index(s).reshape(q_desc.block_type.shape)
        )
        tma.async_copy_global_to_shared(
            do_desc, [g, m0, 0], ready.index(s), do_smem.index(s).reshape(do_desc.block_type.shape)
        )
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=vec_layout)
        in_seq = offs_m < S
        lse_smem.index(s).store(gl.load(LSE2 + (row0 + g) * S + offs_m, mask=in_seq, other=0.0))
        delta_smem.index(s).store(gl.load(DELTA + (row0 + g) * S + offs_m, mask=in_seq, other=0.0))
        mbarrier.arrive(ready.index(s))  # the second arrival: the stores above are visible to the waiters


@gluon.jit
def _consumer(
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    kv_bar,
    ready,
    empty,
    dk_desc,
    dv_desc,
    n0,
    row0,
    first,
    n_blocks,
    GROUP,
    START,
    END,
    S,
    qk_scale,
    sm_scale,
    CAUSAL: gl.constexpr,
    HAS_DOCS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    ROWS: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
):
    """dK, dV of keys [n0 + row0, n0 + row0 + ROWS), written by TMA from the K / V buffers' rows they replace.
    Key j sees the queries [lo[j], hi[j]]: its document's (START, END: per-token bounds, symmetric within one
    sequence), from j on when causal; a block inside every key's range is not masked."""
    dtype: gl.constexpr = k_smem.dtype
    # S^T / dP^T (keys x queries) and dK / dV (keys x head dim): rows = keys, 64 per warpgroup
    st_layout: gl.constexpr = mma_layout(WARPS, BLOCK_M)
    acc_layout: gl.constexpr = mma_layout(WARPS, HEAD_DIM)
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
        full_lo, full_hi, any_lo, any_hi = block_bounds(lo, hi)  # the queries all / any of these keys see
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
                st, dpt, dk, dv = _dkdv_block(
                    k_mine,
                    v_mine,
                    q_smem.index(s),
                    do_smem.index(s),
                    lse_smem.index(s),
                    delta_smem.index(s),
                    st,
                    dpt,
                    dk,
                    dv,
                    m0,
                    n0 + row0,
                    offs_n,
                    lo,
                    hi,
                    full_lo,
                    full_hi,
                    qk_scale,
                    CAUSAL,
                    True,
                    BLOCK_M,
                    ROWS,
                    col_layout,
                    a_layout,
                )
            else:  # no per-key ranges (the block bounds stand in for them, unused)
                st, dpt, dk, dv = _dkdv_block(
                    k_mine,
                    v_mine,
                    q_smem.index(s),
                    do_smem.index(s),
                    lse_smem.index(s),
                    delta_smem.index(s),
                    st,
                    dpt,
                    dk,
                    dv,
                    m0,
                    n0 + row0,
                    offs_n,
                    any_lo,
                    any_hi,
                    any_lo,
                    any_hi,
                    qk_scale,
                    CAUSAL,
                    False,
                    BLOCK_M,
                    ROWS,
                    col_layout,
                    a_layout,
                )
        mbarrier.arrive(empty.index(s))
    # these keys' K and V are no longer read: their rows stage the results for the TMA stores (rows past S clipped)
    k_mine.store((dk * sm_scale).to(dtype))
    v_mine.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [n0 + row0, 0], k_mine)
    tma.async_copy_shared_to_global(dv_desc, [n0 + row0, 0], v_mine)
    tma.store_wait(pendings=0)


@gluon.jit
def _dkdv_block(
    k_mine,
    v_mine,
    q_s,
    do_s,
    lse_s,
    delta_s,
    st,
    dpt,
    dk,
    dv,
    m0,
    key0,
    offs_n,
    lo,
    hi,
    full_lo,
    full_hi,
    qk_scale,
    CAUSAL: gl.constexpr,
    RANGES: gl.constexpr,
    BLOCK_M: gl.constexpr,
    ROWS: gl.constexpr,
    col_layout: gl.constexpr,
    a_layout: gl.constexpr,
):
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
    st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok,))
    pt = gl.exp2(st * qk_scale - lse2[None, :])  # (ROWS, BLOCK_M)
    if RANGES:  # a document's edge, the diagonal, the end
        pt = mask_cut(pt, m0, lo, hi, full_lo, full_hi, 0.0, BLOCK_M, col_layout, True)
    elif CAUSAL:
        if m0 < key0 + ROWS - 1:  # a block on the diagonal: keys after a query are masked
            pt = gl.where(offs_n[:, None] <= offs_m[None, :], pt, 0.0)
    dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_s, dv, is_async=True)
    dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt_tok,))
    dst = pt * (dpt - delta[None, :])
    dk = warpgroup_mma(gl.convert_layout(dst.to(dtype), a_layout), q_s, dk, is_async=True)
    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    return st, dpt, dk, dv


@gluon.jit
def _attn_bwd_dkdv_hopper(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DK,
    DV,
    BOUNDS,
    sqb,
    sqh,
    sqs,
    skb,
    skh,
    sks,
    svb,
    svh,
    svs,
    sdob,
    sdoh,
    sdos,
    sdkb,
    sdkh,
    sdks,
    sdvb,
    sdvh,
    sdvs,
    S,
    H,
    GROUP,
    B,
    S_KEY,
    qk_scale,
    sm_scale,
    CAUSAL: gl.constexpr,
    HAS_DOCS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    SPLIT: gl.constexpr,
    num_warps: gl.constexpr,
):
    dtype: gl.constexpr = Q.dtype.element_ty
    ROWS: gl.constexpr = BLOCK_N // 2 if SPLIT else BLOCK_N
    n0 = gl.program_id(0) * BLOCK_N  # first key blocks first: under causality they see the most queries
    bh = gl.program_id(1)  # (batch, KV head); H counts query heads, GROUP of them share each KV head
    b = bh // (H // GROUP)
    h = bh % (H // GROUP)
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    smem3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    # Q and dO of the group's query heads: [head, row, dim], one head per box (rows past S zero-filled)
    q_desc = tma.make_tensor_descriptor(
        Q + b * sqb + h * GROUP * sqh, [GROUP, S, HEAD_DIM], [sqh, sqs, 1], [1, BLOCK_M, HEAD_DIM], smem3
    )
    do_desc = tma.make_tensor_descriptor(
        DO + b * sdob + h * GROUP * sdoh, [GROUP, S, HEAD_DIM], [sdoh, sdos, 1], [1, BLOCK_M, HEAD_DIM], smem3
    )
    k_desc = tma.make_tensor_descriptor(
        K + b * skb + h * skh, [S, HEAD_DIM], [sks, 1], [BLOCK_N, HEAD_DIM], smem
    )
    v_desc = tma.make_tensor_descriptor(
        V + b * svb + h * svh, [S, HEAD_DIM], [svs, 1], [BLOCK_N, HEAD_DIM], smem
    )
    dk_desc = tma.make_tensor_descriptor(
        DK + b * sdkb + h * sdkh, [S, HEAD_DIM], [sdks, 1], [ROWS, HEAD_DIM], smem
    )
    dv_desc = tma.make_tensor_descriptor(
        DV + b * sdvb + h * sdvh, [S, HEAD_DIM], [sdvs, 1], [ROWS, HEAD_DIM], smem
    )
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
    init_ring(
        ready, empty, STAGES, 2, SPLIT
    )  # ready: the TMA's expect and the producer's arrive (lse, delta)
    START = BOUNDS + b * S  # per-token document bounds (2, B, S): first and last index of its document
    END = BOUNDS + (B + b) * S
    q_lo = n0 * 0  # the queries any of these keys can see: [q_lo, q_hi)
    q_hi = n0 * 0 + S
    if HAS_DOCS:
        q_lo, q_hi = documents_reach(START, END, n0, S, BLOCK_N, num_warps)
    if CAUSAL:
        q_lo = gl.maximum(q_lo, n0)  # queries before the block see none of its keys
    first = q_lo // BLOCK_M
    n_blocks = gl.maximum(gl.cdiv(q_hi, BLOCK_M) - first, 0)
    # each partition's arguments spelled out: Gluon's frontend took neither a tuple built ahead nor tuple addition
    if SPLIT:  # two consumer partitions of ROWS keys each, then the producer
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        k_smem,
                        v_smem,
                        q_smem,
                        do_smem,
                        lse_smem,
                        delta_smem,
                        kv_bar,
                        ready,
                        empty,
                        dk_desc,
                        dv_desc,
                        n0,
                        0,
                        first,
                        n_blocks,
                        GROUP,
                        START,
                        END,
                        S,
                        qk_scale,
                        sm_scale,
                        CAUSAL,
                        HAS_DOCS,
                        HEAD_DIM,
                        BLOCK_M,
                        ROWS,
                        STAGES,
                        num_warps,
                    ),
                ),
                (
                    _consumer,
                    (
                        k_smem,
                        v_smem,
                        q_smem,
                        do_smem,
                        lse_smem,
                        delta_smem,
                        kv_bar,
                        ready,
                        empty,
                        dk_desc,
                        dv_desc,
                        n0,
                        ROWS,
                        first,
                        n_blocks,
                        GROUP,
                        START,
                        END,
                        S,
                        qk_scale,
                        sm_scale,
                        CAUSAL,
                        HAS_DOCS,
                        HEAD_DIM,
                        BLOCK_M,
                        ROWS,
                        STAGES,
                        num_warps,
                    ),
                ),
                (
                    _producer,
                    (
                        q_desc,
                        do_desc,
                        k_desc,
                        v_desc,
                        k_smem,
                        v_smem,
                        q_smem,
                        do_smem,
                        lse_smem,
                        delta_smem,
                        kv_bar,
                        ready,
                        empty,
                        LSE2,
                        DELTA,
                        b * H + h * GROUP,
                        S,
                        n0,
                        first,
                        n_blocks,
                        GROUP,
                        BLOCK_M,
                        STAGES,
                    ),
                ),
            ],
            [num_warps, 1],
            [240, 24],
        )
    else:  # one consumer partition of all BLOCK_N keys, then the producer
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        k_smem,
                        v_smem,
                        q_smem,
                        do_smem,
                        lse_smem,
                        delta_smem,
                        kv_bar,
                        ready,
                        empty,
                        dk_desc,
                        dv_desc,
                        n0,
                        0,
                        first,
                        n_blocks,
                        GROUP,
                        START,
                        END,
                        S,
                        qk_scale,
                        sm_scale,
                        CAUSAL,
                        HAS_DOCS,
                        HEAD_DIM,
                        BLOCK_M,
                        ROWS,
                        STAGES,
                        num_warps,
                    ),
                ),
                (
                    _producer,
                    (
                        q_desc,
                        do_desc,
                        k_desc,
                        v_desc,
                        k_smem,
                        v_smem,
                        q_smem,
                        do_smem,
                        lse_smem,
                        delta_smem,
                        kv_bar,
                        ready,
                        empty,
                        LSE2,
                        DELTA,
                        b * H + h * GROUP,
                        S,
                        n0,
                        first,
                        n_blocks,
                        GROUP,
                        BLOCK_M,
                        STAGES,
                    ),
                ),
            ],
            [1],
            [24],
        )


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
def _store_kv_item(
    rows_smem,
    meta_smem,
    kb,
    BOUNDS,
    b,
    B,
    S,
    n0,
    first,
    n_blocks,
    CAUSAL: gl.constexpr,
    HAS_DOCS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    ROWS: gl.constexpr,
):
    """The producer's share of a key block's set-up (as store_item for queries): per key the queries that see it,
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
    store_ranges(rows_smem, meta_smem, kb, lo, hi, first, n_blocks, BLOCK_N, ROWS)


@gluon.jit
def _dkdv_producer_p(
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    rows_smem,
    meta_smem,
    kv_ready,
    kv_empty,
    ready,
    empty,
    LSE2,
    DELTA,
    BOUNDS,
    S,
    H,
    GROUP,
    B,
    n_items,
    ITEM_PAIRS,
    CAUSAL: gl.constexpr,
    HAS_DOCS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    ROWS: gl.constexpr,
):
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
            q_lo, q_hi = documents_reach(BOUNDS + b * S, BOUNDS + (B + b) * S, n0, S, BLOCK_N, 1)
        if CAUSAL:
            q_lo = gl.maximum(q_lo, n0)
        first = q_lo // BLOCK_M
        n_blocks = gl.maximum(gl.cdiv(q_hi, BLOCK_M) - first, 0)
        kb = i % 2
        mbarrier.wait(kv_empty.index(kb), ((i // 2) & 1) ^ 1)
        mbarrier.expect(kv_ready.index(kb), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            k_desc, [b, hk, n0, 0], kv_ready.index(kb), k_smem.index(kb).reshape(k_desc.block_type.shape)
        )
        tma.async_copy_global_to_shared(
            v_desc, [b, hk, n0, 0], kv_ready.index(kb), v_smem.index(kb).reshape(v_desc.block_type.shape)
        )
        _store_kv_item(
            rows_smem, meta_smem, kb, BOUNDS, b, B, S, n0, first, n_blocks, CAUSAL, HAS_DOCS, BLOCK_N, ROWS
        )
        mbarrier.arrive(kv_ready.index(kb))
        for u in range(GROUP * n_blocks):
            s = t % STAGES
            h = hk * GROUP + u // n_blocks
            mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            m0 = (first + u % n_blocks) * BLOCK_M
            tma.async_copy_global_to_shared(
                q_desc, [b, h, m0, 0], ready.index(s), q_smem.index(s).reshape(q_desc.block_type.shape)
            )
            tma.async_copy_global_to_shared(
                do_desc, [b, h, m0, 0], ready.index(s), do_smem.index(s).reshape(do_desc.block_type.shape)
            )
            offs_m = m0 + gl.arange(0, BLOCK_M, layout=vec_layout)
            in_seq = offs_m < S
            lse_smem.index(s).store(gl.load(LSE2 + (b * H + h) * S + offs_m, mask=in_seq, other=0.0))
            delta_smem.index(s).store(gl.load(DELTA + (b * H + h) * S + offs_m, mask=in_seq, other=0.0))
            mbarrier.arrive(ready.index(s))
            t += 1
        i += 1


@gluon.jit
def _dkdv_consumer_p(
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    rows_smem,
    meta_smem,
    kv_ready,
    kv_empty,
    ready,
    empty,
    dk_desc,
    dv_desc,
    S,
    H,
    GROUP,
    B,
    n_items,
    ITEM_PAIRS,
    row0,
    qk_scale,
    sm_scale,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    ROWS: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
):
    """Per item, dK, dV of keys [n0 + row0, n0 + row0 + ROWS) as _consumer computes them, with the key ranges and
    block bounds from the producer; the results leave by TMA from the K / V rows they replace, and the K/V
    buffer goes back to the producer once those stores have read it, checked at the next item's start."""
    dtype: gl.constexpr = k_smem.dtype
    st_layout: gl.constexpr = mma_layout(WARPS, BLOCK_M)
    acc_layout: gl.constexpr = mma_layout(WARPS, HEAD_DIM)
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
        first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi = load_item(
            rows_smem, meta_smem, kb, row0, ROWS, row_layout, WARPS
        )
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
            if (m0 <= any_hi) & (
                m0 + BLOCK_M > any_lo
            ):  # a block none of these keys' queries lie in: skipped
                st, dpt, dk, dv = _dkdv_block(
                    k_mine,
                    v_mine,
                    q_smem.index(s),
                    do_smem.index(s),
                    lse_smem.index(s),
                    delta_smem.index(s),
                    st,
                    dpt,
                    dk,
                    dv,
                    m0,
                    n0 + row0,
                    lo,
                    lo,
                    hi,
                    full_lo,
                    full_hi,
                    qk_scale,
                    True,
                    True,
                    BLOCK_M,
                    ROWS,
                    col_layout,
                    a_layout,
                )
            mbarrier.arrive(empty.index(s))
            t += 1
        k_mine.store((dk * sm_scale).to(dtype))
        v_mine.store(dv.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(
            dk_desc, [b, hk, n0 + row0, 0], k_smem.index(kb).reshape(box).slice(row0, ROWS, dim=2)
        )
        tma.async_copy_shared_to_global(
            dv_desc, [b, hk, n0 + row0, 0], v_smem.index(kb).reshape(box).slice(row0, ROWS, dim=2)
        )
        i += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _attn_bwd_dkdv_persistent(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DK,
    DV,
    BOUNDS,
    sqb,
    sqh,
    sqs,
    skb,
    skh,
    sks,
    svb,
    svh,
    svs,
    sdob,
    sdoh,
    sdos,
    sdkb,
    sdkh,
    sdks,
    sdvb,
    sdvh,
    sdvs,
    S,
    H,
    GROUP,
    B,
    S_KEY,
    qk_scale,
    sm_scale,
    ITEM_PAIRS,
    CAUSAL: gl.constexpr,
    HAS_DOCS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """dK/dV made persistent (one program per SM over (batch, KV head, key block) items; two 4-warp consumers):
    K/V double-buffered and each item's key ranges stored by the producer, so that an item's K/V loads, set-up
    and result stores overlap the neighbouring items' matmuls."""
    dtype: gl.constexpr = Q.dtype.element_ty
    ROWS: gl.constexpr = BLOCK_N // 2
    HKV = H // GROUP
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    smem4: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    q_desc, do_desc, k_desc, v_desc = head_descriptors(
        Q,
        K,
        V,
        DO,
        sqb,
        sqh,
        sqs,
        skb,
        skh,
        sks,
        svb,
        svh,
        svs,
        sdob,
        sdoh,
        sdos,
        S,
        H,
        HKV,
        B,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_N,
    )
    dk_desc = tma.make_tensor_descriptor(
        DK, [B, HKV, S, HEAD_DIM], [sdkb, sdkh, sdks, 1], [1, 1, ROWS, HEAD_DIM], smem4
    )
    dv_desc = tma.make_tensor_descriptor(
        DV, [B, HKV, S, HEAD_DIM], [sdvb, sdvh, sdvs, 1], [1, 1, ROWS, HEAD_DIM], smem4
    )
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], smem)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], smem)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], smem)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], smem)
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)
    rows_smem, meta_smem = item_buffers(BLOCK_N, True)
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    init_ring(
        kv_ready, kv_empty, 2, 2, True
    )  # ready: the TMA's expect and the producer's arrive (the set-up)
    init_ring(ready, empty, STAGES, 2, True)  # ready: the TMA's expect and the producer's arrive (lse, delta)
    n_items = gl.cdiv(S, BLOCK_N) * B * HKV
    gl.warp_specialize(
        [
            (
                _dkdv_consumer_p,
                (
                    k_smem,
                    v_smem,
                    q_smem,
                    do_smem,
                    lse_smem,
                    delta_smem,
                    rows_smem,
                    meta_smem,
                    kv_ready,
                    kv_empty,
                    ready,
                    empty,
                    dk_desc,
                    dv_desc,
                    S,
                    H,
                    GROUP,
                    B,
                    n_items,
                    ITEM_PAIRS,
                    0,
                    qk_scale,
                    sm_scale,
                    HEAD_DIM,
                    BLOCK_M,
                    BLOCK_N,
                    ROWS,
                    STAGES,
                    num_warps,
                ),
            ),
            (
                _dkdv_consumer_p,
                (
                    k_smem,
                    v_smem,
                    q_smem,
                    do_smem,
                    lse_smem,
                    delta_smem,
                    rows_smem,
                    meta_smem,
                    kv_ready,
                    kv_empty,
                    ready,
                    empty,
                    dk_desc,
                    dv_desc,
                    S,
                    H,
                    GROUP,
                    B,
                    n_items,
                    ITEM_PAIRS,
                    ROWS,
                    qk_scale,
                    sm_scale,
                    HEAD_DIM,
                    BLOCK_M,
                    BLOCK_N,
                    ROWS,
                    STAGES,
                    num_warps,
                ),
            ),
            (
                _dkdv_producer_p,
                (
                    q_desc,
                    do_desc,
                    k_desc,
                    v_desc,
                    k_smem,
                    v_smem,
                    q_smem,
                    do_smem,
                    lse_smem,
                    delta_smem,
                    rows_smem,
                    meta_smem,
                    kv_ready,
                    kv_empty,
                    ready,
                    empty,
                    LSE2,
                    DELTA,
                    BOUNDS,
                    S,
                    H,
                    GROUP,
                    B,
                    n_items,
                    ITEM_PAIRS,
                    CAUSAL,
                    HAS_DOCS,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                    ROWS,
                ),
            ),
        ],
        [num_warps, 1],
        [240, 24],
    )

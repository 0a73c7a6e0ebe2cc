"""The Gluon dQ kernel for Hopper: persistent, one program per SM walking (batch, head, query block) items; per
key block two 4-warp consumers issue S = Q K^T and dP = dO V^T together, then dQ += dS K."""

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
    head_descriptors,
    item_bounds,
    item_buffers,
    item_coords,
    load_item,
    mask_cut,
    mma_layout,
    query_producer,
    query_rings,
)


@gluon.jit
def _dq_consumer(
    q_smem,
    do_smem,
    k_smem,
    v_smem,
    rows_smem,
    meta_smem,
    q_ready,
    q_empty,
    ready,
    empty,
    dq_desc,
    LSE2,
    DELTA,
    BOUNDS,
    S,
    H,
    B,
    ITEM_HEADS,
    n_items,
    row0,
    qk_scale,
    sm_scale,
    CAUSAL: gl.constexpr,
    HAS_DOCS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    ROWS: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    GROUPED: gl.constexpr,
):
    """Per work item, dQ of queries [m0 + row0, m0 + row0 + ROWS): per key block S = Q K^T and dP = dO V^T issued
    together, P = exp2(S - lse) while dP runs, dS = P (dP - delta), dQ += dS K with dS from registers. Query i
    sees the keys [lo[i], hi[i]]; a block inside every row's range is not masked. dQ leaves by TMA from the Q
    buffer's rows it replaces; the buffer goes back to the producer once the store has read it, checked only
    after the next item's set-up."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = mma_layout(WARPS, BLOCK_N)
    acc_layout: gl.constexpr = mma_layout(WARPS, HEAD_DIM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # per query
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per key
    sc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    dp = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    t = 0
    i = 0
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, m0 = item_coords(w, S, H, B, ITEM_HEADS, BLOCK_M, GROUPED)
        offs_m = m0 + row0 + gl.arange(0, ROWS, layout=row_layout)
        in_seq = offs_m < S
        # first read after the first S = Q K^T: these loads' latency hides behind the waits and that matmul
        lse2 = gl.load(LSE2 + (b * H + h) * S + offs_m, mask=in_seq, other=float("inf"))
        delta = gl.load(DELTA + (b * H + h) * S + offs_m, mask=in_seq, other=0.0)
        if not HAS_DOCS:
            first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi = item_bounds(
                BOUNDS, b, B, S, m0, offs_m, in_seq, CAUSAL, BLOCK_M, BLOCK_N, WARPS
            )
        qb = i % 2
        q_mine = q_smem.index(qb).slice(row0, ROWS)
        do_mine = do_smem.index(qb).slice(row0, ROWS)
        dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
        mbarrier.wait(q_ready.index(qb), (i // 2) & 1)
        if HAS_DOCS:
            first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi = load_item(
                rows_smem, meta_smem, qb, row0, ROWS, row_layout, WARPS
            )
            if i > 0:  # short items: the previous item's dQ store was left to read its Q buffer till now
                tma.store_wait(pendings=0)
                mbarrier.arrive(q_empty.index(1 - qb))
        for j in range(n_blocks):
            s = t % STAGES
            n0 = (first + j) * BLOCK_N
            mbarrier.wait(ready.index(s), (t // STAGES) & 1)
            if (n0 <= any_hi) & (n0 + BLOCK_N > any_lo):  # a block none of these rows sees: skipped
                s_tok = warpgroup_mma(
                    q_mine, k_smem.index(s).permute((1, 0)), sc, use_acc=False, is_async=True
                )
                dp_tok = warpgroup_mma(
                    do_mine, v_smem.index(s).permute((1, 0)), dp, use_acc=False, is_async=True
                )
                sc = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
                p = gl.exp2(sc * qk_scale - lse2[:, None])  # (ROWS, BLOCK_N)
                p = mask_cut(
                    p, n0, lo, hi, full_lo, full_hi, 0.0, BLOCK_N, col_layout, HAS_DOCS
                )  # diagonal, edges
                dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok,))
                ds = p * (dp - delta[:, None])
                dq = warpgroup_mma(
                    gl.convert_layout(ds.to(dtype), a_layout), k_smem.index(s), dq, is_async=True
                )
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
            mbarrier.arrive(empty.index(s))
            t += 1
        # these queries' Q is no longer read: its rows stage the result for the TMA store (rows past S clipped)
        q_mine.store((dq * sm_scale).to(dtype))
        fence_async_shared()
        box: gl.constexpr = [
            1,
            1,
            BLOCK_M,
            HEAD_DIM,
        ]  # Gluon reshapes a buffer, not a slice: reshape, then slice
        tma.async_copy_shared_to_global(
            dq_desc, [b, h, m0 + row0, 0], q_smem.index(qb).reshape(box).slice(row0, ROWS, dim=2)
        )
        if not HAS_DOCS:
            tma.store_wait(pendings=0)
            mbarrier.arrive(q_empty.index(qb))
        i += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _attn_bwd_dq_hopper(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DQ,
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
    sdqb,
    sdqh,
    sdqs,
    S,
    H,
    GROUP,
    B,
    S_KEY,
    qk_scale,
    sm_scale,
    ITEM_HEADS,
    CAUSAL: gl.constexpr,
    HAS_DOCS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    GROUPED: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Persistent: one program per SM walks work items (batch, head, query block); two consumer partitions of
    BLOCK_M // 2 queries each, one producer warp."""
    dtype: gl.constexpr = Q.dtype.element_ty
    ROWS: gl.constexpr = BLOCK_M // 2
    HKV = H // GROUP
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    smem4: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    # [batch, head, row, dim] boxes of one head: rows past S zero-filled on loads and clipped on stores
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
    dq_desc = tma.make_tensor_descriptor(
        DQ, [B, H, S, HEAD_DIM], [sdqb, sdqh, sdqs, 1], [1, 1, ROWS, HEAD_DIM], smem4
    )
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], smem)
    do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], smem)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem)
    q_ready, q_empty, ready, empty = query_rings(STAGES, HAS_DOCS)
    rows_smem, meta_smem = item_buffers(BLOCK_M, HAS_DOCS)
    n_items = gl.cdiv(S, BLOCK_M) * B * H
    gl.warp_specialize(
        [
            (
                _dq_consumer,
                (
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    rows_smem,
                    meta_smem,
                    q_ready,
                    q_empty,
                    ready,
                    empty,
                    dq_desc,
                    LSE2,
                    DELTA,
                    BOUNDS,
                    S,
                    H,
                    B,
                    ITEM_HEADS,
                    n_items,
                    0,
                    qk_scale,
                    sm_scale,
                    CAUSAL,
                    HAS_DOCS,
                    HEAD_DIM,
                    BLOCK_M,
                    BLOCK_N,
                    ROWS,
                    STAGES,
                    num_warps,
                    GROUPED,
                ),
            ),
            (
                _dq_consumer,
                (
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    rows_smem,
                    meta_smem,
                    q_ready,
                    q_empty,
                    ready,
                    empty,
                    dq_desc,
                    LSE2,
                    DELTA,
                    BOUNDS,
                    S,
                    H,
                    B,
                    ITEM_HEADS,
                    n_items,
                    ROWS,
                    qk_scale,
                    sm_scale,
                    CAUSAL,
                    HAS_DOCS,
                    HEAD_DIM,
                    BLOCK_M,
                    BLOCK_N,
                    ROWS,
                    STAGES,
                    num_warps,
                    GROUPED,
                ),
            ),
            (
                query_producer,
                (
                    q_desc,
                    do_desc,
                    k_desc,
                    v_desc,
                    q_smem,
                    do_smem,
                    k_smem,
                    v_smem,
                    rows_smem,
                    meta_smem,
                    q_ready,
                    q_empty,
                    ready,
                    empty,
                    BOUNDS,
                    S,
                    H,
                    GROUP,
                    B,
                    ITEM_HEADS,
                    n_items,
                    CAUSAL,
                    HAS_DOCS,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                    True,
                    ROWS,
                    GROUPED,
                ),
            ),
        ],
        [num_warps, 1],
        [240, 24],
    )

"""The Gluon forward for Hopper: persistent, one program per SM walking (batch, head, query block) items; per key
block two 4-warp consumers run S = Q K^T, the online softmax in registers and O += P V, P from registers."""

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
def _fwd_consumer(
    q_smem,
    k_smem,
    v_smem,
    o_smem,
    rows_smem,
    meta_smem,
    q_ready,
    q_empty,
    ready,
    empty,
    o_desc,
    LSE,
    BOUNDS,
    S,
    H,
    B,
    ITEM_HEADS,
    n_items,
    qk_scale,
    row0,
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
    """Per work item, O and the log-sum-exp of queries [m0 + row0, m0 + row0 + ROWS): per key block S = Q K^T,
    the online softmax in registers, O += P V with P from registers. Query i sees the keys [lo[i], hi[i]]; a block
    inside every row's range is not masked, a block outside all of them is skipped. O leaves through this
    consumer's staging buffer by TMA, whose store is waited for only before the next item's."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = mma_layout(WARPS, BLOCK_N)
    acc_layout: gl.constexpr = mma_layout(WARPS, HEAD_DIM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # per query
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per key
    acc_rows: gl.constexpr = gl.SliceLayout(1, acc_layout)
    sc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    t = 0
    i = 0
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, m0 = item_coords(w, S, H, B, ITEM_HEADS, BLOCK_M, GROUPED)
        offs_m = m0 + row0 + gl.arange(0, ROWS, layout=row_layout)
        in_seq = offs_m < S
        if not HAS_DOCS:
            first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi = item_bounds(
                BOUNDS, b, B, S, m0, offs_m, in_seq, CAUSAL, BLOCK_M, BLOCK_N, WARPS
            )
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)  # running max, raw scores
        l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
        qb = i % 2
        q_mine = q_smem.index(qb).slice(row0, ROWS)
        mbarrier.wait(q_ready.index(qb), (i // 2) & 1)
        if HAS_DOCS:
            first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi = load_item(
                rows_smem, meta_smem, qb, row0, ROWS, row_layout, WARPS
            )
        for j in range(n_blocks):
            s = t % STAGES
            n0 = (first + j) * BLOCK_N
            mbarrier.wait(ready.index(s), (t // STAGES) & 1)
            if (n0 <= any_hi) & (n0 + BLOCK_N > any_lo):
                s_tok = warpgroup_mma(
                    q_mine, k_smem.index(s).permute((1, 0)), sc, use_acc=False, is_async=True
                )
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
                sc = mask_cut(sc, n0, lo, hi, full_lo, full_hi, float("-inf"), BLOCK_N, col_layout, HAS_DOCS)
                m_new = gl.maximum(m_i, gl.max(sc, 1))
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new) * qk_scale  # a row masked so far: no NaN
                p = gl.exp2(sc * qk_scale - m_use[:, None])  # (ROWS, BLOCK_N)
                alpha = gl.exp2(m_i * qk_scale - m_use)
                l_i = l_i * alpha + gl.sum(p, 1)
                acc = acc * gl.convert_layout(alpha, acc_rows)[:, None]
                acc = warpgroup_mma(
                    gl.convert_layout(p.to(dtype), a_layout), v_smem.index(s), acc, is_async=True
                )
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                m_i = m_new
            mbarrier.arrive(empty.index(s))
            t += 1
        mbarrier.arrive(
            q_empty.index(qb)
        )  # the last S = Q K^T is done: the producer may load the next Q here
        seen = l_i > 0.0
        lse = gl.where(
            seen, (m_i * qk_scale + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf")
        )
        out = acc / gl.convert_layout(gl.where(seen, l_i, 1.0), acc_rows)[:, None]
        gl.store(LSE + (b * H + h) * S + offs_m, lse, mask=in_seq)
        tma.store_wait(pendings=0)  # the previous item's O has left the staging buffer
        o_smem.store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, h, m0 + row0, 0], o_smem.reshape(o_desc.block_type.shape))
        i += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _attn_fwd_hopper(
    Q,
    K,
    V,
    O,
    LSE,
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
    sob,
    soh,
    sos,
    S,
    H,
    GROUP,
    B,
    S_KEY,
    qk_scale,
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
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    smem4: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    # [batch, head, row, dim] boxes of one head: rows past S zero-filled on loads and clipped on stores
    q_desc = tma.make_tensor_descriptor(
        Q, [B, H, S, HEAD_DIM], [sqb, sqh, sqs, 1], [1, 1, BLOCK_M, HEAD_DIM], smem4
    )
    k_desc = tma.make_tensor_descriptor(
        K, [B, H // GROUP, S, HEAD_DIM], [skb, skh, sks, 1], [1, 1, BLOCK_N, HEAD_DIM], smem4
    )
    v_desc = tma.make_tensor_descriptor(
        V, [B, H // GROUP, S, HEAD_DIM], [svb, svh, svs, 1], [1, 1, BLOCK_N, HEAD_DIM], smem4
    )
    o_desc = tma.make_tensor_descriptor(
        O, [B, H, S, HEAD_DIM], [sob, soh, sos, 1], [1, 1, ROWS, HEAD_DIM], smem4
    )
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], smem)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem)
    o_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], smem)
    q_ready, q_empty, ready, empty = query_rings(STAGES, HAS_DOCS)
    rows_smem, meta_smem = item_buffers(BLOCK_M, HAS_DOCS)
    n_items = gl.cdiv(S, BLOCK_M) * B * H
    gl.warp_specialize(
        [
            (
                _fwd_consumer,
                (
                    q_smem,
                    k_smem,
                    v_smem,
                    o_smem.index(0),
                    rows_smem,
                    meta_smem,
                    q_ready,
                    q_empty,
                    ready,
                    empty,
                    o_desc,
                    LSE,
                    BOUNDS,
                    S,
                    H,
                    B,
                    ITEM_HEADS,
                    n_items,
                    qk_scale,
                    0,
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
                _fwd_consumer,
                (
                    q_smem,
                    k_smem,
                    v_smem,
                    o_smem.index(1),
                    rows_smem,
                    meta_smem,
                    q_ready,
                    q_empty,
                    ready,
                    empty,
                    o_desc,
                    LSE,
                    BOUNDS,
                    S,
                    H,
                    B,
                    ITEM_HEADS,
                    n_items,
                    qk_scale,
                    ROWS,
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
                    q_desc,
                    k_desc,
                    v_desc,
                    q_smem,
                    q_smem,
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
                    False,
                    ROWS,
                    GROUPED,
                ),
            ),
        ],
        [num_warps, 1],
        [240, 24],
    )

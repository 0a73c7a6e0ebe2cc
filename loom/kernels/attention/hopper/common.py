"""What the Gluon Hopper attention kernels share: matmul layouts, mbarrier rings, block masks and bounds, the
per-item set-up a producer stores for its consumers, and the item walk and producer of the persistent forward and
dQ (both walk (batch, head, query block) items)."""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma


@triton.constexpr_function
def mma_layout(warps, cols):
    """The register layout of a (rows, cols) matmul result of a consumer of ``warps`` warps, 64 rows per
    warpgroup (Gluon's constexpr functions return one value, not a tuple)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, cols, 16])


@gluon.jit
def init_ring(ready, empty, STAGES: gl.constexpr, READY_ARRIVALS: gl.constexpr, SPLIT: gl.constexpr):
    """The ring's mbarriers: a slot is ready after READY_ARRIVALS arrivals (the TMA's expect, plus the
    producer's own arrive where it also stores into the slot) and empty after one arrival per consumer."""
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=READY_ARRIVALS)
        mbarrier.init(empty.index(i), count=2 if SPLIT else 1)


@gluon.jit
def block_bounds(lo, hi):
    """From per-row visible ranges [lo, hi]: [full_lo, full_hi], seen by every row (a block inside needs no
    mask), and [any_lo, any_hi], outside which no row sees anything (a block there is skipped)."""
    return gl.max(lo, 0), gl.min(hi, 0), gl.min(lo, 0), gl.max(hi, 0)


@gluon.jit
def mask_cut(
    x,
    start,
    lo,
    hi,
    full_lo,
    full_hi,
    other,
    BLOCK: gl.constexpr,
    col_layout: gl.constexpr,
    ONE_SIDED: gl.constexpr,
):
    """x (rows, BLOCK) over the columns [start, start + BLOCK), set to ``other`` outside each row's visible range
    [lo, hi] where the block is cut. ``ONE_SIDED`` (packed documents): only the sides that cut the block are
    compared, so a block holding a document's start but no row's last visible column (the first block of a
    document) costs one comparison per element, not two; without documents only the diagonal blocks are cut,
    where the one combined test is as fast."""
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
def documents_reach(START, END, p0, S, ROWS: gl.constexpr, num_warps: gl.constexpr):
    """[lo, hi): the tokens that tokens [p0, p0 + ROWS)'s documents span (empty for padding or past S)."""
    offs = p0 + gl.arange(0, ROWS, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
    lo = gl.min(gl.load(START + offs, mask=offs < S, other=S), 0)
    hi = gl.max(gl.load(END + offs, mask=offs < S, other=-1), 0) + 1
    return lo, hi


@gluon.jit
def head_descriptors(
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
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """4-D TMA descriptors of Q and dO ([batch, head, row, dim] boxes of BLOCK_M rows of one head) and of K and V
    (BLOCK_N rows of one KV head); rows past S zero-filled on loads."""
    smem4: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    return (
        tma.make_tensor_descriptor(
            Q, [B, H, S, HEAD_DIM], [sqb, sqh, sqs, 1], [1, 1, BLOCK_M, HEAD_DIM], smem4
        ),
        tma.make_tensor_descriptor(
            DO, [B, H, S, HEAD_DIM], [sdob, sdoh, sdos, 1], [1, 1, BLOCK_M, HEAD_DIM], smem4
        ),
        tma.make_tensor_descriptor(
            K, [B, HKV, S, HEAD_DIM], [skb, skh, sks, 1], [1, 1, BLOCK_N, HEAD_DIM], smem4
        ),
        tma.make_tensor_descriptor(
            V, [B, HKV, S, HEAD_DIM], [svb, svh, svs, 1], [1, 1, BLOCK_N, HEAD_DIM], smem4
        ),
    )


@gluon.jit
def key_blocks(
    START,
    END,
    m0,
    S,
    CAUSAL: gl.constexpr,
    HAS_DOCS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    num_warps: gl.constexpr,
):
    """(first, count): the key blocks that queries [m0, m0 + BLOCK_M) can see."""
    k_lo = m0 * 0
    k_hi = m0 * 0 + S
    if HAS_DOCS:
        k_lo, k_hi = documents_reach(START, END, m0, S, BLOCK_M, num_warps)
    if CAUSAL:
        k_hi = gl.minimum(k_hi, m0 + BLOCK_M)  # keys after the block's last query are seen by none
    first = k_lo // BLOCK_N
    return first, gl.maximum(gl.cdiv(k_hi, BLOCK_N) - first, 0)


@gluon.jit
def item_coords(w, S, H, B, ITEM_HEADS, BLOCK_M: gl.constexpr, GROUPED: gl.constexpr):
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
    """block_bounds of rows [r0, r0 + ROWS) among ``rows`` (the others neutral)."""
    mine = (rows >= r0) & (rows < r0 + ROWS)
    big = 1 << 30
    return (
        gl.max(gl.where(mine, lo, -big), 0),
        gl.min(gl.where(mine, hi, big), 0),
        gl.min(gl.where(mine, lo, big), 0),
        gl.max(gl.where(mine, hi, -big), 0),
    )


@gluon.jit
def store_item(
    rows_smem,
    meta_smem,
    qb,
    BOUNDS,
    b,
    B,
    S,
    m0,
    first,
    n_blocks,
    CAUSAL: gl.constexpr,
    HAS_DOCS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    ROWS: gl.constexpr,
):
    """The producer's share of an item's set-up, stored with its Q so that no consumer waits on global loads or
    cross-warp reductions between items: each row's visible keys [lo, hi] (rows_smem[2 qb], [2 qb + 1]) and 16
    int32 (meta_smem[qb]): the key blocks (first, count), then per consumer of ROWS rows its block-level bounds
    (block_bounds)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=layout)
    lo, hi = visible_keys(BOUNDS, b, B, S, offs_m, offs_m < S, CAUSAL, HAS_DOCS)
    store_ranges(rows_smem, meta_smem, qb, lo, hi, first, n_blocks, BLOCK_M, ROWS)


@gluon.jit
def store_ranges(
    rows_smem, meta_smem, qb, lo, hi, first, n_blocks, BLOCK_M: gl.constexpr, ROWS: gl.constexpr
):
    """Per row [lo, hi] into rows_smem[2 qb], [2 qb + 1]; (first, n_blocks) and each consumer's block-level bounds
    into meta_smem[qb] (see store_item); one warp."""
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
def load_item(
    rows_smem,
    meta_smem,
    qb,
    row0: gl.constexpr,
    ROWS: gl.constexpr,
    row_layout: gl.constexpr,
    WARPS: gl.constexpr,
):
    """A consumer's view of what store_item stored: (first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi)
    for its rows [row0, row0 + ROWS)."""
    layout: gl.constexpr = gl.BlockedLayout([16], [32], [WARPS], [0])  # every thread holds all 16
    meta = meta_smem.index(qb).load(layout)
    slot = gl.arange(0, 16, layout=layout)
    c = 2 + 4 * (row0 // ROWS)
    lo = rows_smem.index(2 * qb).slice(row0, ROWS).load(row_layout)
    hi = rows_smem.index(2 * qb + 1).slice(row0, ROWS).load(row_layout)
    return (
        gl.sum(gl.where(slot == 0, meta, 0), 0),
        gl.sum(gl.where(slot == 1, meta, 0), 0),
        gl.sum(gl.where(slot == c, meta, 0), 0),
        gl.sum(gl.where(slot == c + 1, meta, 0), 0),
        gl.sum(gl.where(slot == c + 2, meta, 0), 0),
        gl.sum(gl.where(slot == c + 3, meta, 0), 0),
        lo,
        hi,
    )


@gluon.jit
def item_bounds(
    BOUNDS,
    b,
    B,
    S,
    m0,
    offs_m,
    in_seq,
    CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    WARPS: gl.constexpr,
):
    """Without packed documents, a consumer's (first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi) of an item,
    computed without loads (with documents it reads what the producer stored: load_item)."""
    first, n_blocks = key_blocks(BOUNDS, BOUNDS, m0, S, CAUSAL, False, BLOCK_M, BLOCK_N, WARPS)
    lo, hi = visible_keys(BOUNDS, b, B, S, offs_m, in_seq, CAUSAL, False)
    full_lo, full_hi, any_lo, any_hi = block_bounds(lo, hi)  # the keys all / any of these rows see
    return first, n_blocks, full_lo, full_hi, any_lo, any_hi, lo, hi


@gluon.jit
def query_rings(STAGES: gl.constexpr, HAS_DOCS: gl.constexpr):
    """The persistent dQ's and forward's mbarriers (two consumers): (ready, empty) of the two Q buffers (ready after
    the TMA's expect, and with packed documents the producer's arrive, see store_item), then of the K/V ring."""
    Q_ARRIVALS: gl.constexpr = 2 if HAS_DOCS else 1
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    init_ring(q_ready, q_empty, 2, Q_ARRIVALS, True)
    init_ring(ready, empty, STAGES, 1, True)
    return q_ready, q_empty, ready, empty


@gluon.jit
def item_buffers(BLOCK_M: gl.constexpr, HAS_DOCS: gl.constexpr):
    """Per Q buffer, what store_item stores: the rows' visible key ranges and 16 int32 of block counts and bounds
    (a token size without documents, where nothing is stored: the shared memory laid out as before)."""
    layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    ROWS_STORED: gl.constexpr = BLOCK_M if HAS_DOCS else 1
    META: gl.constexpr = 16 if HAS_DOCS else 1
    return (
        gl.allocate_shared_memory(gl.int32, [4, ROWS_STORED], layout),
        gl.allocate_shared_memory(gl.int32, [2, META], layout),
    )


@gluon.jit
def visible_keys(BOUNDS, b, B, S, offs_m, in_seq, CAUSAL: gl.constexpr, HAS_DOCS: gl.constexpr):
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
def query_producer(
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
    CAUSAL: gl.constexpr,
    HAS_DOCS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    WITH_DO: gl.constexpr,
    ROWS: gl.constexpr,
    GROUPED: gl.constexpr,
):
    """The persistent dQ's and forward's producer. Per work item: its queries' Q (and dO, ``WITH_DO``) into one of
    two buffers once the consumers freed it, with the item's set-up (store_item), then its key blocks' K and V
    into the ring, running ahead into the next item while the consumers finish this one."""
    t = 0  # key blocks loaded so far: the ring's position and phase
    i = 0  # items so far: the Q/dO buffer's position and phase
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, m0 = item_coords(w, S, H, B, ITEM_HEADS, BLOCK_M, GROUPED)
        first, n_blocks = key_blocks(
            BOUNDS + b * S, BOUNDS + (B + b) * S, m0, S, CAUSAL, HAS_DOCS, BLOCK_M, BLOCK_N, 1
        )
        qb = i % 2
        mbarrier.wait(
            q_empty.index(qb), ((i // 2) & 1) ^ 1
        )  # the first pass over a fresh buffer goes at once
        if WITH_DO:
            mbarrier.expect(q_ready.index(qb), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        else:
            mbarrier.expect(q_ready.index(qb), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            q_desc, [b, h, m0, 0], q_ready.index(qb), q_smem.index(qb).reshape(q_desc.block_type.shape)
        )
        if WITH_DO:
            tma.async_copy_global_to_shared(
                do_desc, [b, h, m0, 0], q_ready.index(qb), do_smem.index(qb).reshape(do_desc.block_type.shape)
            )
        if HAS_DOCS:  # (without, the consumers compute the item's bounds themselves, without loads)
            store_item(
                rows_smem,
                meta_smem,
                qb,
                BOUNDS,
                b,
                B,
                S,
                m0,
                first,
                n_blocks,
                CAUSAL,
                HAS_DOCS,
                BLOCK_M,
                ROWS,
            )
            mbarrier.arrive(
                q_ready.index(qb)
            )  # the second arrival: the stores above are visible to the waiters
        for j in range(n_blocks):
            s = t % STAGES
            mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            n0 = (first + j) * BLOCK_N
            tma.async_copy_global_to_shared(
                k_desc,
                [b, h // GROUP, n0, 0],
                ready.index(s),
                k_smem.index(s).reshape(k_desc.block_type.shape),
            )
            tma.async_copy_global_to_shared(
                v_desc,
                [b, h // GROUP, n0, 0],
                ready.index(s),
                v_smem.index(s).reshape(v_desc.block_type.shape),
            )
            t += 1
        i += 1

"""FlashAttention-2 in Triton: forward, and backward as two kernels (dK/dV per key block, dQ per query block).

Masks (see reference.py): causal, packed documents through per-token (start, end) bounds, sliding window.
Every program visits only the key (or query) blocks its mask can reach, and applies the mask only on
blocks the mask cuts: the block range is split into masked head / unmasked body / masked tail.
Grouped-query attention reads K/V at head ``h // group``: K and V are never repeated in memory; the
dK/dV program of a KV head loops over its query heads, so no atomics are needed.

Plain pointer arithmetic by default; TENSOR_DESC=True compiles a variant whose Q/K/V/O/dO/dQ/dK/dV tiles go
through tensor descriptors (``tensor_desc=`` on the launchers; not the default until a GPU measures it
faster). Both run on triton 3.6 and newer, and in the CPU interpreter for small fp32 cases. Kernels and
launchers only: which kernels run a call is ``loom.kernels.dispatch``'s choice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.kernels.triton_support import check_tensor, interpreting

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128)


# ----------------------------------------------------------------------------------------------- helpers
@triton.jit
def _cdiv_floor(x, block):
    return (x // block) * block


@triton.jit
def _cdiv_ceil(x, block):
    return ((x + block - 1) // block) * block


@triton.jit
def _split(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Block-aligned [a, b) masked head, [b, c) unmasked body, [c, d) masked tail covering [lo, hi)."""
    lo = tl.maximum(lo, 0)
    a = _cdiv_floor(lo, BLOCK)
    d = tl.maximum(_cdiv_ceil(hi, BLOCK), a)
    b = tl.minimum(tl.maximum(_cdiv_ceil(full_lo, BLOCK), a), d)
    c = tl.minimum(tl.maximum(_cdiv_floor(full_hi, BLOCK), b), d)
    return a, b, c, d


@triton.jit
def _doc_bounds(START, END, S, offs, in_seq, HAS_DOCS: tl.constexpr):
    """(start, end) document bounds of tokens ``offs``; without documents the whole sequence."""
    if HAS_DOCS:
        start = tl.load(START + offs, mask=in_seq, other=S)
        end = tl.load(END + offs, mask=in_seq, other=-1)
    else:
        start = offs * 0
        end = offs * 0 + S - 1
    return start, end


@triton.jit
def _row_range(offs, S, start, end, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Per query ``offs``: the keys it may see, [lo, hi] (empty past S), from its document bounds
    (start, end), causality and the window. One range per row makes a block's mask two comparisons."""
    lo = start
    hi = tl.minimum(end, S - 1)
    if CAUSAL:
        hi = tl.minimum(hi, offs)
    if WINDOW > 0:
        lo = tl.maximum(lo, offs - WINDOW + 1)
        if not CAUSAL:
            hi = tl.minimum(hi, offs + WINDOW - 1)
    return lo, tl.where(offs < S, hi, -1)


@triton.jit
def _in_range(offs_n, lo, hi):
    """(M, N) bool: key offs_n[j] lies in row i's visible range [lo[i], hi[i]]."""
    return (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] <= hi[:, None])


@triton.jit
def _key_range(
    m0,
    S,
    start_q,
    end_q,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Key blocks the queries [m0, m0 + BLOCK_M) can see, split into masked / unmasked parts."""
    lo = 0
    hi = S
    full_lo = 0
    full_hi = S
    if CAUSAL:
        hi = tl.minimum(hi, m0 + BLOCK_M)
        full_hi = tl.minimum(full_hi, m0 + 1)
    if HAS_DOCS:
        lo = tl.maximum(lo, tl.min(start_q, 0))
        hi = tl.minimum(hi, tl.max(end_q, 0) + 1)
        full_lo = tl.maximum(full_lo, tl.max(start_q, 0))
        full_hi = tl.minimum(full_hi, tl.min(end_q, 0) + 1)
    if WINDOW > 0:
        lo = tl.maximum(lo, m0 - WINDOW + 1)
        full_lo = tl.maximum(full_lo, m0 + BLOCK_M - WINDOW)
        if not CAUSAL:
            hi = tl.minimum(hi, m0 + BLOCK_M - 1 + WINDOW)
            full_hi = tl.minimum(full_hi, m0 + WINDOW)
    full_hi = tl.minimum(full_hi, S)
    return _split(lo, hi, full_lo, full_hi, BLOCK_N)


@triton.jit
def _query_range(
    n0,
    S,
    start_k,
    end_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Query blocks that can see some key of [n0, n0 + BLOCK_N). A document is a contiguous run, so
    query i sees key j only if i lies in j's document: the key bounds give the query range."""
    lo = 0
    hi = S
    full_lo = 0
    full_hi = S
    if CAUSAL:
        lo = tl.maximum(lo, n0)
        full_lo = tl.maximum(full_lo, n0 + BLOCK_N - 1)
    if HAS_DOCS:
        lo = tl.maximum(lo, tl.min(start_k, 0))
        hi = tl.minimum(hi, tl.max(end_k, 0) + 1)
        full_lo = tl.maximum(full_lo, tl.max(start_k, 0))
        full_hi = tl.minimum(full_hi, tl.min(end_k, 0) + 1)
    if WINDOW > 0:
        hi = tl.minimum(hi, n0 + BLOCK_N - 1 + WINDOW)
        full_hi = tl.minimum(full_hi, n0 + WINDOW)
        if not CAUSAL:
            lo = tl.maximum(lo, n0 - WINDOW + 1)
            full_lo = tl.maximum(full_lo, n0 + BLOCK_N - WINDOW)
    full_hi = tl.minimum(full_hi, S)
    return _split(lo, hi, full_lo, full_hi, BLOCK_M)


# --------------------------------------------------------------------------------- tensor descriptors
# The TENSOR_DESC variant reads and writes the (rows, head dim) tiles of Q, K, V, O, dO and the gradients
# through tensor descriptors (tl.make_tensor_descriptor, one per (batch, head) matrix of S x HEAD_DIM: TMA on
# Hopper and newer, pointer arithmetic elsewhere); the descriptor clips ragged sequence ends itself (zero
# padding on loads, nothing stored past S). Not block pointers (tl.make_block_ptr): Triton 3.9 removed them
# (NotImplementedError, compiled or interpreted), while tensor descriptors are in 3.6 and 3.9 alike. The
# default stays plain pointers until a GPU measures the variant faster (bench.kernels --tensor-desc).
@triton.jit
def _rows_desc(base, stride, S, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Descriptor of the (S, HEAD_DIM) matrix at ``base`` (row stride ``stride``) in (BLOCK, HEAD_DIM) tiles."""
    return tl.make_tensor_descriptor(base, [S, HEAD_DIM], [stride, 1], [BLOCK, HEAD_DIM])


@triton.jit
def _load_rows(
    base,
    stride,
    S,
    row0,
    offs,
    offs_d,
    in_seq,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TENSOR_DESC: tl.constexpr,
):
    """A kernel's own tile: rows ``offs`` (= row0 + arange(BLOCK); ``in_seq``: those below S) of the (S, HEAD_DIM)
    matrix at ``base``, zeros past S."""
    if TENSOR_DESC:
        tile = _rows_desc(base, stride, S, BLOCK, HEAD_DIM).load([row0, 0])
    else:
        tile = tl.load(base + offs[:, None] * stride + offs_d[None, :], mask=in_seq[:, None], other=0.0)
    return tile


@triton.jit
def _store_rows(
    base,
    stride,
    S,
    row0,
    offs,
    offs_d,
    in_seq,
    tile,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TENSOR_DESC: tl.constexpr,
):
    """``tile`` in the matrix's dtype into rows ``offs`` of the (S, HEAD_DIM) matrix at ``base``, none past S
    (``_load_rows``' layout)."""
    if TENSOR_DESC:
        _rows_desc(base, stride, S, BLOCK, HEAD_DIM).store([row0, 0], tile.to(base.dtype.element_ty))
    else:
        tl.store(
            base + offs[:, None] * stride + offs_d[None, :],
            tile.to(base.dtype.element_ty),
            mask=in_seq[:, None],
        )


# ----------------------------------------------------------------------------------------------- forward
@triton.jit
def _fwd_blocks(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    stride_ks,
    stride_vs,
    offs_d,
    S,
    lo_q,
    hi_q,
    qk_scale,
    lo,
    hi,
    full_lo,
    full_hi,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TENSOR_DESC: tl.constexpr,
):
    """Key blocks [lo, hi). MASKED: 0 none is masked, 1 every one, 2 those outside [full_lo, full_hi) (one
    software-pipelined loop where a split into three would each fill and drain the pipeline: documents).
    k_base, v_base: the head's K and V, base pointers or (TENSOR_DESC) descriptors made once per program."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if TENSOR_DESC:
            kt = tl.trans(k_base.load([n0, 0]))  # (D, N)
        elif MASKED > 0:
            kt = tl.load(
                k_base + offs_n[None, :] * stride_ks + offs_d[:, None], mask=offs_n[None, :] < S, other=0.0
            )  # (D, N)
        else:
            kt = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None])
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # (M, N) fp32, log2 units
        if MASKED == 1:
            s = tl.where(_in_range(offs_n, lo_q, hi_q), s, float("-inf"))
        if MASKED == 2:
            if (n0 < full_lo) | (n0 >= full_hi):
                s = tl.where(_in_range(offs_n, lo_q, hi_q), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED > 0:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked so far: no NaN
        else:
            m_use = m_new
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TENSOR_DESC:
            v = v_base.load([n0, 0])
        elif MASKED > 0:
            v = tl.load(
                v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=offs_n[:, None] < S, other=0.0
            )
        else:
            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :])
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
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
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    WINDOW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TENSOR_DESC: tl.constexpr,
):
    m0 = (
        tl.num_programs(0) - 1 - tl.program_id(0)
    ) * BLOCK_M  # last (longest, when causal) query blocks first
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_m < S
    q = _load_rows(Q + b * sqb + h * sqh, sqs, S, m0, offs_m, offs_d, in_seq, BLOCK_M, HEAD_DIM, TENSOR_DESC)
    start_q, end_q = _doc_bounds(BOUNDS + b * S, BOUNDS + (B + b) * S, S, offs_m, in_seq, HAS_DOCS)
    lo_q, hi_q = _row_range(offs_m, S, start_q, end_q, CAUSAL, WINDOW)
    a, bb, c, d = _key_range(m0, S, start_q, end_q, BLOCK_M, BLOCK_N, CAUSAL, HAS_DOCS, WINDOW)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    if TENSOR_DESC:
        k_base = _rows_desc(k_base, sks, S, BLOCK_N, HEAD_DIM)
        v_base = _rows_desc(v_base, svs, S, BLOCK_N, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if HAS_DOCS:  # short key ranges with masked blocks at both ends: one loop
        acc, l_i, m_i = _fwd_blocks(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            sks,
            svs,
            offs_d,
            S,
            lo_q,
            hi_q,
            qk_scale,
            a,
            d,
            bb,
            c,
            2,
            BLOCK_N,
            DOT_PRECISION,
            HEAD_DIM,
            TENSOR_DESC,
        )
    else:
        acc, l_i, m_i = _fwd_blocks(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            sks,
            svs,
            offs_d,
            S,
            lo_q,
            hi_q,
            qk_scale,
            a,
            bb,
            a,
            d,
            1,
            BLOCK_N,
            DOT_PRECISION,
            HEAD_DIM,
            TENSOR_DESC,
        )
        acc, l_i, m_i = _fwd_blocks(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            sks,
            svs,
            offs_d,
            S,
            lo_q,
            hi_q,
            qk_scale,
            bb,
            c,
            a,
            d,
            0,
            BLOCK_N,
            DOT_PRECISION,
            HEAD_DIM,
            TENSOR_DESC,
        )
        acc, l_i, m_i = _fwd_blocks(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            sks,
            svs,
            offs_d,
            S,
            lo_q,
            hi_q,
            qk_scale,
            c,
            d,
            a,
            d,
            1,
            BLOCK_N,
            DOT_PRECISION,
            HEAD_DIM,
            TENSOR_DESC,
        )
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    _store_rows(
        O + b * sob + h * soh, sos, S, m0, offs_m, offs_d, in_seq, out, BLOCK_M, HEAD_DIM, TENSOR_DESC
    )
    tl.store(LSE + bh * S + offs_m, lse, mask=in_seq)


# ---------------------------------------------------------------------------------------------- backward
@triton.jit
def _bwd_dkdv_blocks(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    stride_qs,
    stride_dos,
    offs_n,
    offs_d,
    S,
    START_B,
    END_B,
    qk_scale,
    lo,
    hi,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TENSOR_DESC: tl.constexpr,
):
    """Query blocks [lo, hi) of one query head: q_base, do_base its Q and dO, base pointers or (TENSOR_DESC)
    descriptors made once per head."""
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        in_seq = offs_m < S
        if TENSOR_DESC:
            q = q_base.load([m0, 0])
            do = do_base.load([m0, 0])
        elif MASKED:
            q = tl.load(
                q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=in_seq[:, None], other=0.0
            )
            do = tl.load(
                do_base + offs_m[:, None] * stride_dos + offs_d[None, :], mask=in_seq[:, None], other=0.0
            )
        else:
            q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :])
            do = tl.load(do_base + offs_m[:, None] * stride_dos + offs_d[None, :])
        if MASKED:
            lse2 = tl.load(lse_base + offs_m, mask=in_seq, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=in_seq, other=0.0)
        else:
            lse2 = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        st = (
            tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
        )  # (N, M): scores transposed, log2 units
        pt = tl.math.exp2(st - lse2[None, :])
        if MASKED:
            start_q, end_q = _doc_bounds(START_B, END_B, S, offs_m, in_seq, HAS_DOCS)
            lo_q, hi_q = _row_range(offs_m, S, start_q, end_q, CAUSAL, WINDOW)
            pt = tl.where((offs_n[:, None] >= lo_q[None, :]) & (offs_n[:, None] <= hi_q[None, :]), pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (N, M)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_program(
    n0,
    b,
    hk,
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DK,
    DV,
    BOUNDS,
    KBOUNDS,
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
    qk_scale,
    sm_scale,
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    WINDOW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TENSOR_DESC: tl.constexpr,
):
    """dK, dV of keys [n0, n0 + BLOCK_N) of KV head ``hk``, summed over the query heads of its group. The
    queries' mask reads BOUNDS; which query blocks to visit, KBOUNDS (the keys' side: the same table when
    queries and keys are one sequence)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_n < S
    k = _load_rows(K + b * skb + hk * skh, sks, S, n0, offs_n, offs_d, in_seq, BLOCK_N, HEAD_DIM, TENSOR_DESC)
    v = _load_rows(V + b * svb + hk * svh, svs, S, n0, offs_n, offs_d, in_seq, BLOCK_N, HEAD_DIM, TENSOR_DESC)
    start_k, end_k = _doc_bounds(KBOUNDS + b * S, KBOUNDS + (B + b) * S, S, offs_n, in_seq, HAS_DOCS)
    a, bb, c, d = _query_range(n0, S, start_k, end_k, BLOCK_M, BLOCK_N, CAUSAL, HAS_DOCS, WINDOW)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        if TENSOR_DESC:
            q_base = _rows_desc(q_base, sqs, S, BLOCK_M, HEAD_DIM)
            do_base = _rows_desc(do_base, sdos, S, BLOCK_M, HEAD_DIM)
        lse_base = LSE2 + (b * H + h) * S
        delta_base = DELTA + (b * H + h) * S
        dk, dv = _bwd_dkdv_blocks(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse_base,
            delta_base,
            sqs,
            sdos,
            offs_n,
            offs_d,
            S,
            BOUNDS + b * S,
            BOUNDS + (B + b) * S,
            qk_scale,
            a,
            bb,
            True,
            CAUSAL,
            HAS_DOCS,
            WINDOW,
            BLOCK_M,
            DOT_PRECISION,
            HEAD_DIM,
            TENSOR_DESC,
        )
        dk, dv = _bwd_dkdv_blocks(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse_base,
            delta_base,
            sqs,
            sdos,
            offs_n,
            offs_d,
            S,
            BOUNDS + b * S,
            BOUNDS + (B + b) * S,
            qk_scale,
            bb,
            c,
            False,
            CAUSAL,
            HAS_DOCS,
            WINDOW,
            BLOCK_M,
            DOT_PRECISION,
            HEAD_DIM,
            TENSOR_DESC,
        )
        dk, dv = _bwd_dkdv_blocks(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse_base,
            delta_base,
            sqs,
            sdos,
            offs_n,
            offs_d,
            S,
            BOUNDS + b * S,
            BOUNDS + (B + b) * S,
            qk_scale,
            c,
            d,
            True,
            CAUSAL,
            HAS_DOCS,
            WINDOW,
            BLOCK_M,
            DOT_PRECISION,
            HEAD_DIM,
            TENSOR_DESC,
        )
    dk = dk * sm_scale
    _store_rows(
        DK + b * sdkb + hk * sdkh, sdks, S, n0, offs_n, offs_d, in_seq, dk, BLOCK_N, HEAD_DIM, TENSOR_DESC
    )
    _store_rows(
        DV + b * sdvb + hk * sdvh, sdvs, S, n0, offs_n, offs_d, in_seq, dv, BLOCK_N, HEAD_DIM, TENSOR_DESC
    )


@triton.jit
def _bwd_dq_blocks(
    dq,
    q,
    do,
    lse2,
    delta,
    k_base,
    v_base,
    stride_ks,
    stride_vs,
    offs_d,
    S,
    lo_q,
    hi_q,
    qk_scale,
    lo,
    hi,
    full_lo,
    full_hi,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TENSOR_DESC: tl.constexpr,
):
    """Key blocks [lo, hi); MASKED, k_base and v_base as in _fwd_blocks."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if TENSOR_DESC:
            kt = tl.trans(k_base.load([n0, 0]))  # (D, N)
            vt = tl.trans(v_base.load([n0, 0]))  # (D, N)
        elif MASKED > 0:
            kt = tl.load(
                k_base + offs_n[None, :] * stride_ks + offs_d[:, None], mask=offs_n[None, :] < S, other=0.0
            )
            vt = tl.load(
                v_base + offs_n[None, :] * stride_vs + offs_d[:, None], mask=offs_n[None, :] < S, other=0.0
            )
        else:
            kt = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None])  # (D, N)
            vt = tl.load(v_base + offs_n[None, :] * stride_vs + offs_d[:, None])  # (D, N)
        p = tl.math.exp2(tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])  # (M, N)
        if MASKED == 1:
            p = tl.where(_in_range(offs_n, lo_q, hi_q), p, 0.0)
        if MASKED == 2:
            if (n0 < full_lo) | (n0 >= full_hi):
                p = tl.where(_in_range(offs_n, lo_q, hi_q), p, 0.0)
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION)  # (M, N)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dq_program(
    m0,
    b,
    h,
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
    qk_scale,
    sm_scale,
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    WINDOW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TENSOR_DESC: tl.constexpr,
):
    """dQ of queries [m0, m0 + BLOCK_M) of head ``h``."""
    bh = b * H + h
    hk = h // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_m < S
    q = _load_rows(Q + b * sqb + h * sqh, sqs, S, m0, offs_m, offs_d, in_seq, BLOCK_M, HEAD_DIM, TENSOR_DESC)
    do = _load_rows(
        DO + b * sdob + h * sdoh, sdos, S, m0, offs_m, offs_d, in_seq, BLOCK_M, HEAD_DIM, TENSOR_DESC
    )
    lse2 = tl.load(LSE2 + bh * S + offs_m, mask=in_seq, other=float("inf"))
    delta = tl.load(DELTA + bh * S + offs_m, mask=in_seq, other=0.0)
    start_q, end_q = _doc_bounds(BOUNDS + b * S, BOUNDS + (B + b) * S, S, offs_m, in_seq, HAS_DOCS)
    lo_q, hi_q = _row_range(offs_m, S, start_q, end_q, CAUSAL, WINDOW)
    a, bb, c, d = _key_range(m0, S, start_q, end_q, BLOCK_M, BLOCK_N, CAUSAL, HAS_DOCS, WINDOW)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    if TENSOR_DESC:
        k_base = _rows_desc(k_base, sks, S, BLOCK_N, HEAD_DIM)
        v_base = _rows_desc(v_base, svs, S, BLOCK_N, HEAD_DIM)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if HAS_DOCS:  # one loop, as in the forward
        dq = _bwd_dq_blocks(
            dq,
            q,
            do,
            lse2,
            delta,
            k_base,
            v_base,
            sks,
            svs,
            offs_d,
            S,
            lo_q,
            hi_q,
            qk_scale,
            a,
            d,
            bb,
            c,
            2,
            BLOCK_N,
            DOT_PRECISION,
            HEAD_DIM,
            TENSOR_DESC,
        )
    else:
        dq = _bwd_dq_blocks(
            dq,
            q,
            do,
            lse2,
            delta,
            k_base,
            v_base,
            sks,
            svs,
            offs_d,
            S,
            lo_q,
            hi_q,
            qk_scale,
            a,
            bb,
            a,
            d,
            1,
            BLOCK_N,
            DOT_PRECISION,
            HEAD_DIM,
            TENSOR_DESC,
        )
        dq = _bwd_dq_blocks(
            dq,
            q,
            do,
            lse2,
            delta,
            k_base,
            v_base,
            sks,
            svs,
            offs_d,
            S,
            lo_q,
            hi_q,
            qk_scale,
            bb,
            c,
            a,
            d,
            0,
            BLOCK_N,
            DOT_PRECISION,
            HEAD_DIM,
            TENSOR_DESC,
        )
        dq = _bwd_dq_blocks(
            dq,
            q,
            do,
            lse2,
            delta,
            k_base,
            v_base,
            sks,
            svs,
            offs_d,
            S,
            lo_q,
            hi_q,
            qk_scale,
            c,
            d,
            a,
            d,
            1,
            BLOCK_N,
            DOT_PRECISION,
            HEAD_DIM,
            TENSOR_DESC,
        )
    dq = dq * sm_scale
    _store_rows(
        DQ + b * sdqb + h * sdqh, sdqs, S, m0, offs_m, offs_d, in_seq, dq, BLOCK_M, HEAD_DIM, TENSOR_DESC
    )


@triton.jit
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DK,
    DV,
    BOUNDS,
    KBOUNDS,
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
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    WINDOW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TENSOR_DESC: tl.constexpr,
):
    HK = H // GROUP
    _dkdv_program(
        tl.program_id(0) * BLOCK_N,
        tl.program_id(1) // HK,
        tl.program_id(1) % HK,
        Q,
        K,
        V,
        DO,
        LSE2,
        DELTA,
        DK,
        DV,
        BOUNDS,
        KBOUNDS,
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
        qk_scale,
        sm_scale,
        CAUSAL,
        HAS_DOCS,
        WINDOW,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_N,
        DOT_PRECISION,
        TENSOR_DESC,
    )


@triton.jit
def _attn_bwd_dq(
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
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    WINDOW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TENSOR_DESC: tl.constexpr,
):
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # longest first, as in the forward
    _dq_program(
        m0,
        tl.program_id(1) // H,
        tl.program_id(1) % H,
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
        qk_scale,
        sm_scale,
        CAUSAL,
        HAS_DOCS,
        WINDOW,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_N,
        DOT_PRECISION,
        TENSOR_DESC,
    )


# --------------------------------------------------------------------------------------------- launchers
@triton.jit
def _bwd_preprocess(
    O,
    DO,
    LSE,
    DLSE,
    DELTA,
    LSE2,
    sob,
    soh,
    sos,
    sdob,
    sdoh,
    sdos,
    S,
    H,
    HAS_DLSE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """delta = rowsum(O * dO) - dLSE, and the log-sum-exp in log2 units (+inf where a row saw nothing)."""
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_m < S
    o = tl.load(
        O + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], mask=in_seq[:, None], other=0.0
    )
    do = tl.load(
        DO + b * sdob + h * sdoh + offs_m[:, None] * sdos + offs_d[None, :], mask=in_seq[:, None], other=0.0
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + bh * S + offs_m, mask=in_seq, other=0.0)
    lse = tl.load(LSE + bh * S + offs_m, mask=in_seq, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(DELTA + bh * S + offs_m, delta, mask=in_seq)
    tl.store(LSE2 + bh * S + offs_m, lse2, mask=in_seq)


def _configs(shapes) -> list:
    """(BLOCK_M, BLOCK_N, warps, stages[, register cap]) -> triton.Config; a cap (maxnreg) below the compiler's
    255 lets two or three programs share an SM."""
    return [
        triton.Config(
            {"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s, maxnreg=cap[0] if cap else None
        )
        for m, n, w, s, *cap in shapes
    ]


# candidates measured by autotuning on the first call of each (sequence bucket, group, head dim, mask) key
_FWD_CONFIGS = [
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (128, 32, 4, 4),
    (64, 64, 4, 4),
    (128, 64, 8, 4),
]
_DKDV_CONFIGS = [
    (64, 128, 8, 3),
    (32, 128, 4, 5),
    (64, 128, 4, 3),
    (32, 128, 8, 4),
    (64, 64, 4, 3),
    (32, 64, 4, 4),
    (128, 128, 8, 2),
    (64, 128, 8, 2),
    (32, 128, 4, 3),
    (64, 64, 8, 3),
    (128, 64, 8, 3),
]
_DQ_CONFIGS = [
    (128, 64, 8, 3),
    (128, 32, 4, 5),
    (64, 64, 4, 3),
    (128, 64, 4, 3),
    (64, 128, 8, 3),
    (128, 32, 8, 4),
    (128, 32, 8, 3, 128),
]  # capped at 128 registers: two programs per SM, no spill at d128
_KEY = ["S_KEY", "GROUP", "HEAD_DIM", "CAUSAL", "HAS_DOCS", "WINDOW", "TENSOR_DESC"]
_INTERPRETER_BLOCKS = {
    "fwd": {"BLOCK_M": 32, "BLOCK_N": 16},
    "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32},
    "dq": {"BLOCK_M": 32, "BLOCK_N": 16},
}  # uneven: both split paths run


def seq_key(seq: int) -> int:
    """Autotuning key for a sequence length: the next power of two (at least 256), so that new lengths
    reuse the configs measured for their bucket instead of tuning again."""
    return max(256, 1 << (seq - 1).bit_length())


def _kernel(kind: str):
    """The kernel for ``kind``: autotuned on a GPU, fixed small blocks in the CPU interpreter."""
    raw, configs = {
        "fwd": (_attn_fwd, _configs(_FWD_CONFIGS)),
        "dkdv": (_attn_bwd_dkdv, _configs(_DKDV_CONFIGS)),
        "dq": (_attn_bwd_dq, _configs(_DQ_CONFIGS)),
    }[kind]
    if interpreting():
        return raw, _INTERPRETER_BLOCKS[kind]
    if kind not in _TUNED:
        _TUNED[kind] = triton.autotune(configs=configs, key=_KEY)(raw)
    return _TUNED[kind], {}


_TUNED: dict = {}


def dot_precision(q: torch.Tensor) -> dict:
    """The kernels' ``tl.dot`` input precision, passed explicitly (``tl.dot`` resolves an unset one to TF32 itself,
    before any launch option is read): fp32 inputs in full fp32 unless PyTorch's float32 matmul precision allows
    TF32 (as torch.matmul does); 16-bit inputs ignore it."""
    tf32 = q.dtype != torch.float32 or torch.get_float32_matmul_precision() != "highest"
    return {"DOT_PRECISION": "tf32" if tf32 and not interpreting() else "ieee"}


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor | None,
    window: int,
    key_bounds: torch.Tensor | None = None,
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dtypes=DTYPES, ndim=4, device=q.device)
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head dim must be contiguous (stride {t.stride(-1)})")
    if k.shape != v.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} must match each other "
            f"and q's dtype {q.dtype}"
        )
    bsz, hq, seq, dim = q.shape
    if k.shape[0] != bsz or k.shape[2] != seq or k.shape[3] != dim:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)}: batch, sequence and head dim must agree"
        )
    if hq % k.shape[1]:
        raise ValueError(f"query heads {hq} must be a multiple of key/value heads {k.shape[1]}")
    if dim not in HEAD_DIMS:
        raise ValueError(f"head dim {dim} not supported (allowed: {', '.join(map(str, HEAD_DIMS))})")
    if key_bounds is not None and bounds is None:
        raise ValueError("key_bounds needs bounds (the queries' side of the same document mask)")
    for name, t in (("bounds", bounds), ("key_bounds", key_bounds)):
        if t is not None:
            check_tensor(name, t, dtypes=(torch.int32,), ndim=3, device=q.device)
            if tuple(t.shape) != (2, bsz, seq) or not t.is_contiguous():
                raise ValueError(f"{name}: expected contiguous (2, {bsz}, {seq}), got {tuple(t.shape)}")
    if window < 0:
        raise ValueError(f"window {window} must be >= 0 (0 = no sliding window)")


def check_descriptor_layout(**tensors: torch.Tensor) -> None:
    """The tensor-descriptor variant's layout: every (batch, head) matrix starts 16-byte aligned and its rows are
    16-byte multiples apart (what a TMA descriptor requires); a ValueError naming the tensor otherwise."""
    for name, t in tensors.items():
        size = t.element_size()
        if t.data_ptr() % 16 or any(stride * size % 16 for stride in t.stride()[:3]):
            raise ValueError(
                f"{name}: tensor descriptors need a 16-byte aligned start and 16-byte multiple strides in every "
                f"dim but the last (got address % 16 = {t.data_ptr() % 16}, strides {t.stride()} of {size} bytes)"
            )


def _descriptor_setup(tensor_desc: bool, **tensors: torch.Tensor) -> dict:
    """The TENSOR_DESC launch argument; for the variant, the layout checked and Triton's allocator set (the
    descriptors made in the kernel live in a scratch buffer it allocates at each launch; it is per thread, and
    the backward runs in autograd's thread, so every launch sets it)."""
    if tensor_desc:
        check_descriptor_layout(**tensors)
        device = next(iter(tensors.values())).device
        triton.set_allocator(
            lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device)
        )
    return {"TENSOR_DESC": tensor_desc}


def _dummy_bounds(q: torch.Tensor, bounds: torch.Tensor | None) -> torch.Tensor:
    return bounds if bounds is not None else torch.empty(1, dtype=torch.int32, device=q.device)


def attention_forward(
    q, k, v, causal: bool, bounds, window: int, scale: float, key_bounds=None, tensor_desc: bool = False
):
    """q (B, Hq, S, D), k/v (B, Hkv, S, D) -> (out like q, lse (B, Hq, S) float32) by the Triton forward.
    ``key_bounds`` is only read by the backward (the forward walks query rows). ``tensor_desc``: the variant
    whose tiles go through tensor descriptors (not measured on a GPU yet, so nothing in training passes it)."""
    check_inputs(q, k, v, bounds, window, key_bounds)
    bsz, hq, seq, dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(bsz, hq, seq, dtype=torch.float32, device=q.device)
    triton_forward(q, k, v, out, lse, causal, bounds, window, scale, tensor_desc)
    return out, lse


def triton_forward(
    q, k, v, out, lse, causal: bool, bounds, window: int, scale: float, tensor_desc: bool = False
) -> None:
    """Fill out and lse with the Triton forward kernel (``tensor_desc``: its tensor-descriptor variant)."""
    bsz, hq, seq, dim = q.shape
    kernel, blocks = _kernel("fwd")
    grid = lambda meta: (triton.cdiv(seq, meta["BLOCK_M"]), bsz * hq)
    kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        _dummy_bounds(q, bounds),
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out.stride()[:3],
        seq,
        hq,
        hq // k.shape[1],
        bsz,
        seq_key(seq),
        scale * LOG2E,
        CAUSAL=causal,
        HAS_DOCS=bounds is not None,
        WINDOW=window,
        HEAD_DIM=dim,
        **_descriptor_setup(tensor_desc, q=q, k=k, v=v, out=out),
        **blocks,
        **dot_precision(q),
    )


def attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dlse,
    causal: bool,
    bounds,
    window: int,
    scale: float,
    key_bounds=None,
    tensor_desc: bool = False,
):
    """Gradients (dq, dk, dv) by the Triton kernels, dK/dV then dQ (two launches); ``dlse`` (B, Hq, S) or None
    is the gradient flowing into the log-sum-exp; ``tensor_desc``: both kernels' tensor-descriptor variants."""
    check_inputs(q, k, v, bounds, window, key_bounds)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    delta, lse2 = backward_preprocess(dout, out, lse, dlse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    triton_dkdv(dout, q, k, v, lse2, delta, dk, dv, causal, bounds, window, scale, key_bounds, tensor_desc)
    triton_dq(dout, q, k, v, lse2, delta, dq, causal, bounds, window, scale, tensor_desc)
    return dq, dk, dv


def backward_preprocess(dout, out, lse, dlse):
    """(delta = rowsum(O dO) - dLSE, the log-sum-exp in log2 units), both (B, Hq, S) float32."""
    bsz, hq, seq, dim = out.shape
    delta = torch.empty(bsz, hq, seq, dtype=torch.float32, device=out.device)
    lse2 = torch.empty_like(delta)
    dlse_c = dlse.float().contiguous() if dlse is not None else delta
    _bwd_preprocess[(triton.cdiv(seq, 64), bsz * hq)](
        out,
        dout,
        lse.contiguous(),
        dlse_c,
        delta,
        lse2,
        *out.stride()[:3],
        *dout.stride()[:3],
        seq,
        hq,
        HAS_DLSE=dlse is not None,
        HEAD_DIM=dim,
        BLOCK_M=64,
    )
    return delta, lse2


def _launch_args(dout, q, k, v, lse2, delta, causal, bounds, window, scale):
    bsz, hq, seq, dim = q.shape
    args = (q, k, v, dout, lse2, delta)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    tail = (seq, hq, hq // k.shape[1], bsz, seq_key(seq), scale * LOG2E, scale)
    common = dict(CAUSAL=causal, HAS_DOCS=bounds is not None, WINDOW=window, HEAD_DIM=dim)
    return args, strides, tail, {**common, **dot_precision(q)}


def triton_dkdv(
    dout, q, k, v, lse2, delta, dk, dv, causal, bounds, window, scale, key_bounds=None, tensor_desc=False
) -> None:
    """The Triton dK/dV kernel: fills dk, dv (``tensor_desc``: its tensor-descriptor variant)."""
    args, strides, tail, common = _launch_args(dout, q, k, v, lse2, delta, causal, bounds, window, scale)
    desc = _descriptor_setup(tensor_desc, q=q, k=k, v=v, dout=dout, dk=dk, dv=dv)
    b_ = _dummy_bounds(q, bounds)
    kb_ = key_bounds if key_bounds is not None else b_  # same-sequence documents: one table serves both sides
    kernel, blocks = _kernel("dkdv")
    kernel[lambda meta: (triton.cdiv(q.shape[2], meta["BLOCK_N"]), q.shape[0] * k.shape[1])](
        *args,
        dk,
        dv,
        b_,
        kb_,
        *strides,
        *dk.stride()[:3],
        *dv.stride()[:3],
        *tail,
        **blocks,
        **common,
        **desc,
    )


def triton_dq(dout, q, k, v, lse2, delta, dq, causal, bounds, window, scale, tensor_desc=False) -> None:
    """The Triton dQ kernel: fills dq (``tensor_desc``: its tensor-descriptor variant)."""
    args, strides, tail, common = _launch_args(dout, q, k, v, lse2, delta, causal, bounds, window, scale)
    desc = _descriptor_setup(tensor_desc, q=q, k=k, v=v, dout=dout, dq=dq)
    kernel, blocks = _kernel("dq")
    kernel[lambda meta: (triton.cdiv(q.shape[2], meta["BLOCK_M"]), q.shape[0] * q.shape[1])](
        *args, dq, _dummy_bounds(q, bounds), *strides, *dq.stride()[:3], *tail, **blocks, **common, **desc
    )

"""FlashAttention forward for Hopper (sm_90) in Gluon, Triton's lower-level language: asynchronous warpgroup
MMAs, so the softmax of one key block runs while the tensor cores multiply the previous block's P by V.

Why a second forward: Triton 3.6 waits for every score matmul before the softmax that reads it, so the MMA and
the exponentials of one warpgroup never overlap (bench/NOTES.md, v4-v10). Here the schedule is written out
(FlashAttention-3's intra-warpgroup overlap): in iteration j the kernel issues S_j = Q K_j^T and O += P_{j-1}
V_{j-1} together, waits only for S_j, computes P_j while the second MMA runs, then waits for it and rescales
O. K and V arrive by TMA (zero-filled past the sequence end) into two slots each, loaded one to two
iterations ahead.

Scope: causal or full attention without document masks or a window, bf16/fp16, head dim 64 or 128. Other
cases (and other GPUs) run the Triton kernels in ``triton.py``; ``supports`` says which. The result (out,
log-sum-exp) is the Triton forward's, so its backward serves both.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@gluon.jit
def _load_block(desc, row, bars, slots, i, pred):
    """TMA-load block ``i`` (rows ``row``...) into slot i % 2, signalling that slot's barrier."""
    s = i % 2
    mbarrier.expect(bars.index(s), desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [row, 0], bars.index(s), slots.index(s), pred=pred)


@gluon.jit
def _scores(acc, n0, m0, offs_m, S, qk_scale, m_i, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Masked scores of key block n0 in log2 units -> (p fp32, new row max, alpha)."""
    s = acc * qk_scale
    masked = n0 + BLOCK_N > S
    if CAUSAL:
        masked = masked | (n0 + BLOCK_N - 1 > m0)
    if masked:
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))
        ok = offs_n[None, :] < S
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None])
        s = gl.where(ok, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, alpha


@gluon.jit
def _attn_fwd_hopper(Q, K, V, O, LSE, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos, S, H, GROUP,
                     S_KEY, qk_scale, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    m0 = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M  # longest (causal) query blocks first
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP

    # layouts: scores (M, N) and output (M, D) as warpgroup-MMA accumulators
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    q_desc = tma.make_tensor_descriptor(Q + b * sqb + h * sqh, [S, HEAD_DIM], [sqs, 1], [BLOCK_M, HEAD_DIM], smem)
    k_desc = tma.make_tensor_descriptor(K + b * skb + hk * skh, [S, HEAD_DIM], [sks, 1], [BLOCK_N, HEAD_DIM], smem)
    v_desc = tma.make_tensor_descriptor(V + b * svb + hk * svh, [S, HEAD_DIM], [svs, 1], [BLOCK_N, HEAD_DIM], smem)
    o_desc = tma.make_tensor_descriptor(O + b * sob + h * soh, [S, HEAD_DIM], [sos, 1], [BLOCK_M, HEAD_DIM], smem)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], smem)
    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], smem)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], smem)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], smem)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    if CAUSAL:
        n_blocks = gl.cdiv(gl.minimum(S, m0 + BLOCK_M), BLOCK_N)
    else:
        n_blocks = gl.cdiv(S, BLOCK_N)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [m0, 0], q_bar, q_smem)
    _load_block(k_desc, 0, k_bars, k_smem, 0, True)
    _load_block(k_desc, BLOCK_N, k_bars, k_smem, 1, n_blocks > 1)
    _load_block(v_desc, 0, v_bars, v_smem, 0, True)

    offs_m = m0 + gl.arange(0, BLOCK_M, layout=row_s)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    # block 0: scores, then K_0's slot takes K_2
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s_acc = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
    _load_block(k_desc, 2 * BLOCK_N, k_bars, k_smem, 2, n_blocks > 2)
    p, m_i, alpha = _scores(s_acc, 0, m0, offs_m, S, qk_scale, m_i, CAUSAL, BLOCK_N)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_smem.index(0).store(p.to(dtype))
    fence_async_shared()

    # iteration j: issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}, wait for S_j only, compute P_j while the second
    # MMA runs, store it to its slot, then wait for the MMA and rescale O. P_j's store comes before the wait in
    # program order and ptxas keeps shared-memory stores before it, which pins the wait after the exponentials
    # (with P in registers, or stored after the wait, ptxas hoisted the wait above them)
    for j in range(1, n_blocks):
        ks = j % 2
        vs = (j - 1) % 2
        mbarrier.wait(k_bars.index(ks), (j // 2) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        _load_block(v_desc, j * BLOCK_N, v_bars, v_smem, j, True)  # V_{j-2}'s MMA finished last iteration
        mbarrier.wait(v_bars.index(vs), ((j - 1) // 2) & 1)
        acc_tok = warpgroup_mma(p_smem.index(vs), v_smem.index(vs), acc, is_async=True)
        s_acc = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        _load_block(k_desc, (j + 2) * BLOCK_N, k_bars, k_smem, j + 2, j + 2 < n_blocks)  # K_j's slot is free
        p, m_i, alpha = _scores(s_acc, j * BLOCK_N, m0, offs_m, S, qk_scale, m_i, CAUSAL, BLOCK_N)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        p_smem.index(ks).store(p.to(dtype))
        fence_async_shared()
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]

    last = n_blocks - 1
    mbarrier.wait(v_bars.index(last % 2), (last // 2) & 1)
    acc = warpgroup_mma(p_smem.index(last % 2), v_smem.index(last % 2), acc)

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(2):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    l_o = gl.convert_layout(l_i, row_o)
    out = acc / l_o[:, None]
    q_smem.store(out.to(dtype))  # Q is no longer read: its buffer stages the output for the TMA store
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [m0, 0], q_smem)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(LSE + bh * S + offs_m, lse, mask=offs_m < S)
    tma.store_wait(pendings=0)


# (BLOCK_M, BLOCK_N, warps) per head dim, chosen by autotuning on the first call of each key
_CONFIGS = {64: [(128, 128, 8), (128, 64, 8), (64, 128, 4)], 128: [(128, 128, 8), (128, 64, 8), (64, 128, 4)]}
_TUNED: dict = {}


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bounds, window: int) -> bool:
    """Whether this forward handles the call: sm_90, 16-bit, head dim 64/128, no documents or window, and
    TMA-compatible (16-byte aligned) bases and strides."""
    if bounds is not None or window or q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in (64, 128):
        return False
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    return all(t.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in t.stride()[:3]) for t in (q, k, v))


def _allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _kernel(head_dim: int):
    if head_dim not in _TUNED:
        configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=1)
                   for m, n, w in _CONFIGS[head_dim]]
        _TUNED[head_dim] = triton.autotune(configs=configs, key=["S_KEY", "GROUP", "HEAD_DIM", "CAUSAL"])(
            _attn_fwd_hopper)
    return _TUNED[head_dim]


def attention_forward(q, k, v, causal: bool, scale: float, seq_key: int):
    """q (B, Hq, S, D), k/v (B, Hkv, S, D) -> (out like q, lse (B, Hq, S) float32, natural log). The caller
    has checked the inputs and ``supports``."""
    triton.set_allocator(_allocator)  # device-side TMA descriptors live in a per-launch scratch buffer
    bsz, hq, seq, dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(bsz, hq, seq, dtype=torch.float32, device=q.device)
    grid = lambda meta: (triton.cdiv(seq, meta["BLOCK_M"]), bsz * hq)  # noqa: E731
    _kernel(dim)[grid](q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], seq,
                       hq, hq // k.shape[1], seq_key, scale * LOG2E, CAUSAL=causal, HEAD_DIM=dim)
    return out, lse

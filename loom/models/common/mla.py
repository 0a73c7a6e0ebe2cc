"""Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one low-rank latent per token plus a
small RoPE key shared by every head, so a cache holds ``kv_lora_rank + qk_rope_head_dim`` numbers per token and
layer instead of ``2 x kv_heads x head_dim`` (docs/mla.md).

Per token x (E): the query through a low-rank compression (``q_lora_rank`` > 0: ``wq_a``, an RMSNorm, ``wq_b``) or
one projection (``wq``), each head's query split into a no-RoPE part (``qk_nope_head_dim``) and a RoPE part
(``qk_rope_head_dim``); ``wkv_a`` gives the latent c_kv (``kv_lora_rank``) and the shared RoPE key k_pe; c_kv,
normalized, is up-projected by ``wkv_b`` to every head's no-RoPE key and its value (``v_head_dim``). A head's key
is [k_nope, k_pe], its query [q_nope, q_pe]; scores are scaled by 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)
(times YaRN's mscale squared where the RoPE is YaRN-scaled, as DeepSeek defines it). The weights' layout is
DeepSeek's and transformers' (``DeepseekV3Attention``), so converting a checkpoint is renaming.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels.attention.reference import default_scale
from loom.kernels.rope.op import apply_rope as fused_apply_rope
from loom.kernels.rope.reference import apply_rope
from loom.models.common.layers import LOCAL_CONTEXT, LocalContext, RMSNorm

LATENT_NORM_EPS = (
    1e-6  # the latents' RMSNorms: DeepSeek's (and transformers') fixed epsilon, not rms_norm_eps
)


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek's YaRN RoPE scaling (transformers' ``rope_type: yarn``): frequencies interpolated by ``factor`` below
    the band [beta_slow, beta_fast] rotations over ``original_max_position``, kept above it, blended inside; cos and
    sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are given (else by mscale(factor));
    the softmax by mscale(factor, mscale_all_dim) squared (``softmax_scale``). 0 = not given."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inverse_frequencies(dim: int, theta: float, s: YarnScaling) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (dim/2,) float32, the factor cos and sin are scaled by)."""

    def correction(rotations: float) -> float:  # the dimension whose wavelength fits ``rotations`` times
        return dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction(s.beta_fast)), 0)
    high = min(math.ceil(correction(s.beta_slow)), dim - 1)
    extrapolated = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # (dim/2,)
    interpolated = extrapolated / s.factor
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    inv_freq = interpolated * ramp + extrapolated * (1 - ramp)
    if s.mscale and s.mscale_all_dim:
        attention = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention = yarn_mscale(s.factor)
    return inv_freq, attention


def yarn_rope_table(dim: int, max_len: int, theta: float, s: YarnScaling, device=None) -> torch.Tensor:
    """cos and sin (2, max_len, dim) float32 of YaRN-scaled RoPE (rotate-half layout, as ``rope_table``)."""
    inv_freq, attention = yarn_inverse_frequencies(dim, theta, s)
    freqs = torch.outer(
        torch.arange(max_len, dtype=torch.float32, device=device), inv_freq.to(device)
    )  # (S, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (S, D)
    return torch.stack([emb.cos() * attention, emb.sin() * attention])


def softmax_scale(qk_head_dim: int, scaling) -> float:
    """DeepSeek's softmax scale: 1 / sqrt(qk head dim), times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = qk_head_dim**-0.5
    if isinstance(scaling, YarnScaling) and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., D) with RoPE pairs interleaved (x0, x1), (x2, x3), ... (DeepSeek's weights) -> the rotate-half layout
    [x0, x2, ..., x1, x3, ...] loom's RoPE rotates. Queries and keys are permuted alike, so scores are unchanged."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class SharedKey(nn.Module):
    """Where the decoupled RoPE key (B, S, Dr), one for every head, enters the per-head attention. Identity on one
    device; tensor parallelism (``loom.parallel.tensor_parallel.mla_plan``) turns the replicated key into this rank's
    plain tensor whose gradient, from this rank's heads only, is summed over the tp group."""

    def forward(self, k_pe: torch.Tensor) -> torch.Tensor:
        return k_pe


class LatentAttention(nn.Module):
    """Causal multi-head latent attention; head counts are read from weight shapes so tensor parallelism can shard
    them (``wq``/``wq_b``, ``wkv_b`` and ``wo`` by heads; the compressions ``wq_a``, ``wkv_a`` and their norms
    replicated). ``rope_interleave``: the weights' RoPE dimensions come in interleaved pairs (DeepSeek's
    checkpoints); loom's own flavors use the rotate-half layout. ``scaling``: the RoPE table's scaling (a
    ``YarnScaling`` changes the softmax scale).

    ``context``, the module's one extension point, as ``Attention.context``: the sequences x's tokens belong to.
    Attention runs through it (``attend``: SDPA, loom's FlashAttention or FlexAttention); a context that offers
    ``attend_latent`` (generation's latent cache, loom.infer.mla_cache) takes the latents themselves instead. The
    query/key head dim (nope + rope) and the value head dim differ (DeepSeek: 192 and 128): SDPA takes them as they
    are; loom's kernel and FlexAttention need one head dim, so the values are zero-padded to the query/key dim there
    and the padding dropped from the output."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        fused_rope: bool = False,
        backend: str = "sdpa",
        fused_norm: bool = False,
        rope_interleave: bool = False,
        scaling=None,
    ):
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank = (
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            kv_lora_rank,
        )
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.backend = backend
        self.rope_interleave = rope_interleave
        self.scale = softmax_scale(self.qk_dim, scaling)
        self.apply_rope = fused_apply_rope if fused_rope else apply_rope
        self.wq = self.wq_a = self.q_a_norm = self.wq_b = None
        if q_lora_rank:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(q_lora_rank, LATENT_NORM_EPS, fused=fused_norm)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * self.qk_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS, fused=fused_norm)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.shared_key = SharedKey()
        self.context = LOCAL_CONTEXT

    # ---- the pieces, shared with the latent cache's decode (loom.infer.mla_cache) ----

    def query(
        self, x: torch.Tensor, rope: torch.Tensor, rope_at: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, S, E) -> (q_nope (B, S, H, Dn), q_pe (B, S, H, Dr) rotated) for this rank's heads."""
        bsz, seq, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q_nope, q_pe = q.view(bsz, seq, -1, self.qk_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        return q_nope, self.rotate(q_pe, rope, rope_at)

    def latent(
        self, x: torch.Tensor, rope: torch.Tensor, rope_at: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, S, E) -> (c_kv (B, S, R) normalized, k_pe (B, S, Dr) rotated): all a cache keeps of a token."""
        c_kv, k_pe = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)  # (B, S, R), (B, S, Dr)
        k_pe = self.rotate(self.shared_key(k_pe)[:, :, None], rope, rope_at)[:, :, 0]
        return self.kv_a_norm(c_kv), k_pe

    def rotate(self, t: torch.Tensor, rope: torch.Tensor, rope_at: torch.Tensor | None) -> torch.Tensor:
        """RoPE of t (B, S, H, Dr) at positions ``rope_at`` (B, S) (None: 0..S-1)."""
        return self.apply_rope(deinterleave(t) if self.rope_interleave else t, rope, rope_at)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """x (B, S, E): this rank's tokens; ``positions`` (B, S): their per-document positions (packed
        documents), or None."""
        bsz, seq, _ = x.shape
        rope_at = self.context.rope_positions(positions, bsz, seq, x.device)  # (B, S), or None: 0..S-1
        q_nope, q_pe = self.query(x, rope, rope_at)  # (B, S, H, Dn), (B, S, H, Dr)
        c_kv, k_pe = self.latent(x, rope, rope_at)  # (B, S, R), (B, S, Dr)
        attend_latent = getattr(self.context, "attend_latent", None)
        # a latent cache (loom.infer.mla_cache): keeps c_kv, k_pe; attends over it
        if attend_latent is not None:
            out = attend_latent(self, q_nope, q_pe, c_kv, k_pe, positions)  # (B, S, H, Dv)
        else:
            out = self.expanded(q_nope, q_pe, c_kv, k_pe, positions)  # (B, S, H, Dv)
        return self.wo(out.reshape(bsz, seq, -1))  # (B, S, E)

    def expanded(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention with the latents up-projected to every head's key and value (training, a prefill): q_nope
        (B, S, H, Dn), q_pe (B, S, H, Dr), c_kv (B, S, R), k_pe (B, S, Dr) -> (B, S, H, Dv)."""
        bsz, seq = c_kv.shape[:2]
        kv = self.wkv_b(c_kv).view(bsz, seq, -1, self.nope_dim + self.v_dim)  # (B, S, H, Dn + Dv)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        heads = k_nope.shape[2]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # (B, H, S, Dq)
        k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, heads, -1)], dim=-1).transpose(
            1, 2
        )  # (B, H, S, Dq)
        return self.attend(q, k, v.transpose(1, 2), positions).transpose(1, 2)  # (B, S, H, Dv)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """Causal attention of q, k (B, H, S, Dq) and v (B, H, S, Dv) at DeepSeek's softmax scale -> (B, H, S, Dv)."""
        width = self.qk_dim
        if self.v_dim != self.qk_dim and (
            self.backend != "sdpa" or not isinstance(self.context, LocalContext)
        ):
            width = max(
                self.qk_dim, self.v_dim
            )  # one head dim for loom's kernel / Flex / SDPA pinned to a backend: zero-pad the narrower
            q, k = (F.pad(t, (0, width - self.qk_dim)) for t in (q, k))
            v = F.pad(v, (0, width - self.v_dim))
        if not math.isclose(
            self.scale, default_scale(width)
        ):  # the kernels scale by 1 / sqrt(their head dim)
            q = q * (self.scale / default_scale(width))
        out = self.context.attend(q, k, v, positions, self.backend)
        return out[..., : self.v_dim]

"""The latent cache of a multi-head latent attention layer (``loom.models.common.mla.LatentAttention``): per token
only the normalized latent c_kv (``kv_lora_rank``) and the rotated RoPE key k_pe (``qk_rope_head_dim``), shared by
every head, so ``(kv_lora_rank + qk_rope_head_dim) x dtype bytes`` per token and layer (DeepSeek-V2: 512 + 64
against 2 x 8 x 128 for an 8-KV-head GQA layer, 3.6x fewer). docs/mla.md.

It follows ``loom.infer.cache``'s interface (installed as the layer's ``context``; slot = position; ``batch``,
``length``, ``bytes_per_token``, ``rope_positions``) and is registered for ``LatentAttention`` with ``register_cache``.
The attention's forward hands it the latents through ``attend_latent``:

- the prefill (``positions`` None): the latents stored at slots 0..S-1, attention as in training (keys and values
  up-projected per head, the model's kernels: the prefill is compute-bound);
- an extension (a decode step, a speculative verification): the latents stored at their slots, then attention over
  the cache with the projections absorbed (DeepSeek-V2, section 2.1.2). With W_UK (H, Dn, R) and W_UV (H, Dv, R) the
  key and value halves of ``wkv_b``, a head's score q_nope . (W_UK c) + q_pe . k_pe equals (W_UK^T q_nope) . c +
  q_pe . k_pe, and its output sum_j p_j W_UV c_j equals W_UV (sum_j p_j c_j): every head attends over the cached
  [c, k_pe] rows as they are (one KV head of width R + Dr, values its first R columns), and nothing per head is
  ever up-projected from the cache. Under tensor parallelism ``wkv_b`` holds this rank's heads and the cache the
  whole latent (each rank keeps all of it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.infer.cache import register_cache, store, visible
from loom.models.common.layers import attend
from loom.models.common.mla import LatentAttention
from loom.parallel.shards import local_tensor


def absorbed_attention(
    q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, rank: int, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Every head over the cached latents: q_lat (B, S, H, R) (W_UK absorbed), q_pe (B, S, H, Dr), cache (B, L, R + Dr)
    = [c_kv, k_pe] per slot, ``mask`` (B, 1, S, L) -> sum_j p_j c_j (B, S, H, R). The heads are folded into the
    query length, (B, 1, H*S, R + Dr), so SDPA sees one key/value head and reads each slot once."""
    bsz, seq, heads, _ = q_lat.shape
    length = cache.shape[1]
    # (B, 1, H*S, R + Dr)
    q = torch.cat([q_lat, q_pe], dim=-1).permute(0, 2, 1, 3).reshape(bsz, 1, heads * seq, -1)
    k = cache[:, None]  # (B, 1, L, R + Dr)
    v = cache[:, None, :, :rank]  # (B, 1, L, R)
    m = mask[:, :, None].expand(bsz, 1, heads, seq, length).reshape(bsz, 1, heads * seq, length)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)  # (B, 1, H*S, R)
    return out.view(bsz, heads, seq, rank).transpose(1, 2)  # (B, S, H, R)


class LatentCache(nn.Module):
    """One MLA layer's cache: ``kv`` (B, L, R + Dr), slot = position, each row [c_kv (R), k_pe (Dr)]."""

    def __init__(self, batch: int, length: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype, device):
        super().__init__()
        self.rank = kv_lora_rank
        self.register_buffer(
            "kv",
            torch.zeros(batch, length, kv_lora_rank + rope_dim, dtype=dtype, device=device),
            persistent=False,
        )

    @classmethod
    def for_attention(
        cls, attn: LatentAttention, batch: int, length: int, dtype: torch.dtype, device
    ) -> LatentCache:
        """Sized from the module: the latent and the RoPE key are the same on every tensor-parallel rank."""
        return cls(batch, length, attn.kv_rank, attn.rope_dim, dtype, device)

    @property
    def batch(self) -> int:
        return self.kv.shape[0]

    @property
    def length(self) -> int:
        return self.kv.shape[1]

    @property
    def bytes_per_token(self) -> int:
        """The latent and the RoPE key of one token in this layer: kv_lora_rank + qk_rope_head_dim elements."""
        return self.kv.shape[2] * self.kv.element_size()

    def rope_positions(
        self, positions: torch.Tensor | None, bsz: int, seq: int, device
    ) -> torch.Tensor | None:
        """The tokens' positions are their RoPE positions (None: 0..S-1, the prefill)."""
        return positions

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None,
        backend: str,
        window: int = 0,
    ) -> torch.Tensor:
        """The prefill's attention over its own up-projected keys and values (``LatentAttention.expanded``)."""
        assert positions is None, "extensions attend through attend_latent"
        return attend(q, k, v, backend, None, window)

    def attend_latent(
        self,
        attn: LatentAttention,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """Store the tokens' c_kv (B, S, R) and k_pe (B, S, Dr) at their slots, then attend: q_nope (B, S, H, Dn),
        q_pe (B, S, H, Dr) -> (B, S, H, Dv)."""
        c_kv = local_tensor(c_kv)
        bsz, seq, _ = c_kv.shape
        rows = torch.cat([c_kv, k_pe], dim=-1).to(self.kv.dtype)  # (B, S, R + Dr)
        if positions is None:  # the prefill: slots 0..S-1, attention as in training
            self.kv[:bsz, :seq].copy_(rows)
            return attn.expanded(q_nope, q_pe, c_kv, k_pe, None)
        store(self.kv, rows, positions)  # in place (under autocast: cast to the cache's dtype)
        cache = self.kv[:bsz]
        w = local_tensor(attn.wkv_b.weight)  # (H * (Dn + Dv), R): this rank's heads
        w = w.view(-1, attn.nope_dim + attn.v_dim, self.rank)  # (H, Dn + Dv, R)
        w_uk, w_uv = w[:, : attn.nope_dim], w[:, attn.nope_dim :]  # (H, Dn, R), (H, Dv, R)
        q_lat = torch.einsum("bshn,hnr->bshr", q_nope, w_uk)  # (B, S, H, R)
        mask = visible(positions, self.length)  # (B, 1, S, L)
        o_lat = absorbed_attention(q_lat, q_pe, cache, self.rank, mask, attn.scale)  # (B, S, H, R)
        return torch.einsum("bshr,hvr->bshv", o_lat, w_uv)  # (B, S, H, Dv)


register_cache(LatentAttention, LatentCache.for_attention)

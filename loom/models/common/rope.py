"""Rotary position embedding tables (rotate-half convention, as Hugging Face Llama) with Llama-3 scaling; the
rotation itself is ``loom.kernels.rope.reference.apply_rope`` (or its fused op)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling: long wavelengths slowed by ``factor``, a smooth band in between."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # (D/2,)
    if scaling is None:
        return inv_freq.float()
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled).float()


def rope_table(
    head_dim: int, max_len: int, theta: float, scaling: RopeScaling | None, device=None
) -> torch.Tensor:
    """cos and sin for every position, stacked: (2, max_len, head_dim), float32."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)  # (D/2,)
    t = torch.arange(max_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)  # (S, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (S, D)
    return torch.stack([emb.cos(), emb.sin()])

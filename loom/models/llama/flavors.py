"""Llama model shapes. ``vocab_size = 0`` means: from the tokenizer, rounded up to a multiple of 128."""

from __future__ import annotations

from dataclasses import dataclass, replace

from loom.models.common.rope import RopeScaling


@dataclass(frozen=True)
class LlamaArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int = 0
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048
    head_dim: int = 0  # 0 = dim // n_heads
    # Hugging Face families beyond Llama: q/k/v projection biases (Qwen2), RMSNorm of each q/k head before RoPE
    # (Qwen3), sliding-window attention: query i sees keys i - sliding_window < j <= i (Mistral; 0 = off)
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0
    attention: str = "sdpa"  # "sdpa" (PyTorch), "flash" (loom.kernels.attention, Triton on CUDA), "flex" (CUDA)
    # fused Triton kernels on CUDA (loom.kernels.rmsnorm / rope / swiglu); the same math, reference on CPU
    fused_norm: bool = False
    fused_rope: bool = False
    fused_swiglu: bool = False
    # loss inside forward through loom.kernels.linear_ce (no full logits); not with tensor/pipeline parallelism
    fused_loss: bool = False
    # init of the residual projections (attention wo, MLP w2): "flat" = std 0.02 as every other matrix
    # (transformers' Llama), "depth" = 0.02 / sqrt(2 layers) (GPT-2 / Megatron); flat trained better
    # (no early loss spikes: docs/benchmarks.md, "Initialization")
    residual_init: str = "flat"
    # mixture of experts (loom.models.common.moe) in place of every block's SwiGLU when moe_experts > 0
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_ffn_dim: int = 0  # each expert's hidden width; 0 = ffn_dim
    moe_aux_loss: float = 0.01  # weight of the sequence-wise load-balancing loss

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)

    @property
    def moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim

    def with_(self, **kw) -> "LlamaArgs":
        return replace(self, **kw)


_L31 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
_L32 = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)

FLAVORS: dict[str, LlamaArgs] = {
    # tiny: every test uses it; trains in seconds on a CPU
    "debug": LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, rope_theta=10000.0),
    # the same with 4 routed experts (top 2) per block
    "debug_moe": LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, rope_theta=10000.0, moe_experts=4),
    "125M": LlamaArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, tie_embeddings=True,
                      rope_theta=10000.0),
    # the published Llama 3.2 / 3.1 shapes
    "1B": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
                    tie_embeddings=True, rope_scaling=_L32),
    "3B": LlamaArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
                    tie_embeddings=True, rope_scaling=_L32),
    "8B": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                    rope_scaling=_L31),
    "70B": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256,
                     rope_scaling=_L31),
    "405B": LlamaArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, vocab_size=128256,
                      rope_scaling=_L31),
}


def round_vocab(n: int, multiple: int = 128) -> int:
    return (n + multiple - 1) // multiple * multiple

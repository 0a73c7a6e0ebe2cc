"""Llama model shapes. ``vocab_size = 0`` means: from the tokenizer, rounded up to a multiple of 128."""

from __future__ import annotations

from dataclasses import dataclass, replace

from loom.models.common.mla import YarnScaling
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
    rope_scaling: RopeScaling | YarnScaling | None = None  # Llama 3's, or YaRN (DeepSeek's MLA models)
    max_seq_len: int = 2048
    head_dim: int = 0  # 0 = dim // n_heads
    # Hugging Face families beyond Llama: q/k/v projection biases (Qwen2), RMSNorm of each q/k head before RoPE
    # (Qwen3), sliding-window attention: query i sees keys i - sliding_window < j <= i (Mistral; 0 = off)
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0
    # "sdpa" (PyTorch's choice), "sdpa_cudnn" / "sdpa_flash" (SDPA on that backend, CUDA), "fa4" (FlashAttention-4,
    # Hopper / Blackwell), "flash" (loom.kernels.attention, Triton on CUDA), "flex" (CUDA)
    attention: str = "sdpa"
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
    # routing (loom.models.common.moe.Router): softmax or sigmoid scores, the k weights renormalized or not and
    # scaled, group-limited choice (groups, groups kept), shared experts (their width in experts), the per-expert
    # selection bias (aux-loss-free balancing) and its speed per step (0: the bias stays as loaded)
    moe_score: str = "softmax"
    moe_norm_topk: bool = True
    moe_route_scale: float = 1.0
    moe_groups: int = 1
    moe_topk_groups: int = 1
    moe_shared_experts: int = 0
    moe_bias: bool = False
    moe_bias_speed: float = 0.0
    # which attention every block uses: "gqa" (grouped-query, loom.models.common.layers.Attention) or "mla"
    # (DeepSeek's multi-head latent attention, loom.models.common.mla; docs/mla.md). MLA: n_kv_heads = n_heads,
    # head_dim = qk_nope_head_dim + qk_rope_head_dim (queries and keys), values v_head_dim wide
    attention_kind: str = "gqa"
    q_lora_rank: int = 0  # MLA: the query's compression rank; 0 = one projection (no compression)
    kv_lora_rank: int = 0  # MLA: the latent every head's keys and values come from
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0  # MLA: the decoupled RoPE part, one key shared by every head
    v_head_dim: int = 0
    rope_interleave: bool = False  # MLA: RoPE dimensions in interleaved pairs (DeepSeek's checkpoints)

    def __post_init__(self):
        if self.mla:
            assert self.kv_lora_rank > 0 and self.qk_rope_head_dim > 0 and self.v_head_dim > 0, self
            assert self.n_kv_heads == self.n_heads, "MLA: every head has its own keys (n_kv_heads = n_heads)"
            object.__setattr__(self, "head_dim", self.qk_nope_head_dim + self.qk_rope_head_dim)
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)

    @property
    def mla(self) -> bool:
        return self.attention_kind == "mla"

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates per head: the whole head, or MLA's decoupled part."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def cache_elements_per_token(self) -> int:
        """Numbers a KV cache keeps per token and layer: K and V of every KV head, or MLA's latent and RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.mla else 2 * self.n_kv_heads * self.head_dim

    @property
    def moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim

    def moe_layer(self, i: int) -> bool:
        """Whether block ``i`` has experts (every block of a MoE model here; the MoE families choose their own)."""
        return self.moe

    def moe_routing(self) -> dict:
        """``MoE``'s routing and shared-expert keyword arguments."""
        return dict(
            score=self.moe_score,
            norm_topk=self.moe_norm_topk,
            scale=self.moe_route_scale,
            groups=self.moe_groups,
            topk_groups=self.moe_topk_groups,
            bias=self.moe_bias,
            shared=self.moe_shared_experts,
        )

    def with_(self, **kw) -> LlamaArgs:
        return replace(self, **kw)


_L31 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
_L32 = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
_V2_LITE_YARN = YarnScaling(
    factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707
)

FLAVORS: dict[str, LlamaArgs] = {
    # tiny: every test uses it; trains in seconds on a CPU
    "debug": LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, rope_theta=10000.0),
    # the same with 4 routed experts (top 2) per block
    "debug_moe": LlamaArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, rope_theta=10000.0, moe_experts=4
    ),
    # the same with multi-head latent attention: compressed queries, values narrower than queries and keys
    "debug_mla": LlamaArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        ffn_dim=192,
        rope_theta=10000.0,
        attention_kind="mla",
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
    ),
    "125M": LlamaArgs(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, tie_embeddings=True, rope_theta=10000.0
    ),
    # the published Llama 3.2 / 3.1 shapes
    "1B": LlamaArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=128256,
        tie_embeddings=True,
        rope_scaling=_L32,
    ),
    "3B": LlamaArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=128256,
        tie_embeddings=True,
        rope_scaling=_L32,
    ),
    "8B": LlamaArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, rope_scaling=_L31
    ),
    "70B": LlamaArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256, rope_scaling=_L31
    ),
    "405B": LlamaArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        vocab_size=128256,
        rope_scaling=_L31,
    ),
    # DeepSeek-V2-Lite's attention (MLA: latent 512, no query compression, 16 heads of 128 + 64 / 128) and shape, with
    # a dense SwiGLU of its dense layer's width in every block (its routed + shared experts are not loom's MoE)
    "deepseek_v2_lite": LlamaArgs(
        dim=2048,
        n_layers=27,
        n_heads=16,
        n_kv_heads=16,
        ffn_dim=10944,
        vocab_size=102400,
        norm_eps=1e-6,
        rope_theta=10000.0,
        max_seq_len=4096,
        attention_kind="mla",
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_interleave=True,
        rope_scaling=_V2_LITE_YARN,
    ),
}


def round_vocab(n: int, multiple: int = 128) -> int:
    return (n + multiple - 1) // multiple * multiple

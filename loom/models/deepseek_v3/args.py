"""DeepSeek-V3 family shapes."""

from __future__ import annotations

from dataclasses import dataclass

from loom.models.common.mla import YarnScaling
from loom.models.llama import LlamaArgs


@dataclass(frozen=True)
class DeepSeekV3Args(LlamaArgs):
    first_k_dense: int = 0  # the first blocks keep a dense SwiGLU (ffn_dim wide): first_k_dense_replace
    moe_layer_freq: int = 1  # after those, every moe_layer_freq-th block has experts (DeepSeek-V2's config)
    mtp_depth: int = 0  # multi-token prediction modules (each predicts one token further); 0: none
    mtp_weight: float = 0.3  # their losses' weight (lambda), the mean over the modules

    def moe_layer(self, i: int) -> bool:
        """Block ``i`` (``n_layers`` + k: the k-th MTP module's block) has experts."""
        return self.moe and i >= self.first_k_dense and i % self.moe_layer_freq == 0


@dataclass(frozen=True)
class DeepSeekV2Args(DeepSeekV3Args):
    """DeepSeek-V2 / V2-Lite: the same model with softmax routing (the weights scaled, not renormalized), no selection
    bias and no MTP; its own Hugging Face architecture (``DeepseekV2ForCausalLM``)."""


_MLA = dict(attention_kind="mla", rope_interleave=True)
_V3_YARN = YarnScaling(
    factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
)

FLAVORS = {
    # tiny: 3 blocks (the first dense), MLA with q compression, 8 routed experts in 4 groups (top 2 of 2 groups)
    # plus one shared, sigmoid scores with the selection bias, one MTP module; trains in seconds on a CPU
    "deepseek_v3_debug": DeepSeekV3Args(
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=4,
        ffn_dim=192,
        rope_theta=10000.0,
        norm_eps=1e-6,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        **_MLA,
        moe_experts=8,
        moe_top_k=2,
        moe_ffn_dim=32,
        moe_score="sigmoid",
        moe_route_scale=2.5,
        moe_groups=4,
        moe_topk_groups=2,
        moe_shared_experts=1,
        moe_bias=True,
        moe_bias_speed=0.001,
        moe_aux_loss=0.0001,
        first_k_dense=1,
        mtp_depth=1,
    ),
    # the published DeepSeek-V3 (671B) shape
    "deepseek_v3_671b": DeepSeekV3Args(
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        ffn_dim=18432,
        vocab_size=129280,
        rope_theta=10000.0,
        norm_eps=1e-6,
        max_seq_len=163840,
        rope_scaling=_V3_YARN,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        **_MLA,
        moe_experts=256,
        moe_top_k=8,
        moe_ffn_dim=2048,
        moe_score="sigmoid",
        moe_route_scale=2.5,
        moe_groups=8,
        moe_topk_groups=4,
        moe_shared_experts=1,
        moe_bias=True,
        moe_bias_speed=0.001,
        moe_aux_loss=0.0001,
        first_k_dense=3,
        mtp_depth=1,
    ),
}

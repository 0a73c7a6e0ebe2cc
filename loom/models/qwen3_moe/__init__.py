"""Qwen3-MoE: Qwen3's attention (grouped-query, an RMSNorm over each q/k head) with routed SwiGLU experts (softmax
top-k, ``norm_topk_prob``, no shared experts) in every ``decoder_sparse_step``-th block except ``mlp_only_layers``,
which keep a dense SwiGLU. The model is loom's Llama with these args; this folder holds its shapes and its Hugging
Face adapter (``Qwen3MoeForCausalLM``)."""

from __future__ import annotations

from dataclasses import dataclass

from loom.config.errors import ConfigError
from loom.models.llama import Llama, LlamaArgs
from loom.models.spec import HFAdapter, ModelSpec


@dataclass(frozen=True)
class Qwen3MoeArgs(LlamaArgs):
    decoder_sparse_step: int = 1  # block i has experts where (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here

    def moe_layer(self, i: int) -> bool:
        return self.moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0


FLAVORS = {
    # tiny: 3 blocks, the first dense (mlp_only_layers), 8 experts of width 32, top 2; trains in seconds on a CPU
    "qwen3_moe_debug": Qwen3MoeArgs(
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=192,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_norm=True,
        moe_experts=8,
        moe_top_k=2,
        moe_ffn_dim=32,
        mlp_only_layers=(0,),
    ),
    # the published Qwen3-30B-A3B shape
    "qwen3_moe_30b_a3b": Qwen3MoeArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        ffn_dim=6144,
        vocab_size=151936,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_norm=True,
        max_seq_len=40960,
        moe_experts=128,
        moe_top_k=8,
        moe_ffn_dim=768,
        moe_aux_loss=0.001,
    ),
}


class Qwen3MoeHF(HFAdapter):
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    layer_names = {"feed_forward.router.gate.weight": "mlp.gate.weight"}
    expert_names = {
        "feed_forward.experts.w1": "mlp.experts.{j}.gate_proj.weight",
        "feed_forward.experts.w3": "mlp.experts.{j}.up_proj.weight",
        "feed_forward.experts.w2": "mlp.experts.{j}.down_proj.weight",
    }

    def args(self, cfg: dict, base: LlamaArgs, field: str, where: str) -> Qwen3MoeArgs:
        if cfg.get("use_sliding_window"):
            raise ConfigError(
                field, where, "use_sliding_window = true is not supported for Qwen3-MoE (allowed: false)"
            )
        if cfg.get("attention_bias"):
            raise ConfigError(
                field, where, "attention_bias = true is not supported for Qwen3-MoE (allowed: false)"
            )
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        return Qwen3MoeArgs(
            **{
                **fields,
                "qk_norm": True,
                "sliding_window": 0,
                "n_kv_heads": int(cfg.get("num_key_value_heads") or base.n_heads),
                "moe_experts": int(cfg.get("num_experts") or cfg["num_local_experts"]),
                "moe_top_k": int(cfg.get("num_experts_per_tok", 8)),
                "moe_ffn_dim": int(cfg["moe_intermediate_size"]),
                "moe_norm_topk": bool(cfg.get("norm_topk_prob", False)),
                "decoder_sparse_step": int(cfg.get("decoder_sparse_step", 1)),
                "mlp_only_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            }
        )

    def config(self, args: Qwen3MoeArgs) -> dict:
        if args.moe_bias or args.moe_shared_experts or args.moe_score != "softmax" or args.moe_groups > 1:
            from loom.config.errors import UserError

            raise UserError(
                "Qwen3MoeForCausalLM holds softmax routing without a selection bias, groups or shared "
                "experts; this model has one of those (export a DeepSeek-V3 flavor instead)"
            )
        return {
            "intermediate_size": args.ffn_dim,
            "num_experts": args.moe_experts,
            "num_experts_per_tok": args.moe_top_k,
            "moe_intermediate_size": args.expert_ffn_dim,
            "norm_topk_prob": args.moe_norm_topk,
            "decoder_sparse_step": args.decoder_sparse_step,
            "mlp_only_layers": list(args.mlp_only_layers),
            "output_router_logits": False,
            "router_aux_loss_coef": args.moe_aux_loss,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": args.n_layers,
            "layer_types": ["full_attention"] * args.n_layers,
        }


SPEC = ModelSpec("qwen3_moe", Qwen3MoeArgs, Llama, FLAVORS, Qwen3MoeHF())

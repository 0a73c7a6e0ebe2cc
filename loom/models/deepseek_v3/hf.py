"""DeepSeek-V3's Hugging Face layout (``DeepseekV3ForCausalLM``): MLA as loom's (renaming), DeepSeekMoE's gate with
its ``e_score_correction_bias`` (loom's selection bias), per-expert and shared SwiGLUs, and the multi-token
prediction modules as the extra layers DeepSeek publishes (``model.layers.{n_layers + k}``: enorm, hnorm, eh_proj,
shared_head.norm, the block's own names, and copies of the embedding and head, which transformers skips)."""

from __future__ import annotations

import re

from loom.config.errors import ConfigError, UserError
from loom.models.deepseek_v3.args import DeepSeekV2Args, DeepSeekV3Args
from loom.models.llama import LlamaArgs
from loom.models.spec import HFAdapter

_MTP = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # an MTP layer's copies of the shared weights


def _get(cfg: dict, *keys, default=None):
    return next((cfg[k] for k in keys if cfg.get(k) is not None), default)


def _dense_if_no_experts(args: DeepSeekV3Args) -> DeepSeekV3Args:
    """A model none of whose blocks (MTP modules' included) has experts is a dense one (moe_experts 0), whatever
    expert count its config names (transformers writes its default 256)."""
    if any(args.moe_layer(i) for i in range(args.n_layers + args.mtp_depth)):
        return args
    fields = DeepSeekV3Args.__dataclass_fields__
    return args.with_(**{f: fields[f].default for f in fields if f.startswith("moe_")})


class DeepSeekV3HF(HFAdapter):
    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    layer_names = {
        "feed_forward.router.gate.weight": "mlp.gate.weight",
        "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
        "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
        "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
        "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    }
    expert_names = {
        "feed_forward.experts.w1": "mlp.experts.{j}.gate_proj.weight",
        "feed_forward.experts.w3": "mlp.experts.{j}.up_proj.weight",
        "feed_forward.experts.w2": "mlp.experts.{j}.down_proj.weight",
    }

    def args(self, cfg: dict, base: LlamaArgs, field: str, where: str) -> DeepSeekV3Args:
        heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != heads:
            raise ConfigError(
                field,
                where,
                f"num_key_value_heads = {kv_heads} is not supported for multi-head "
                f"latent attention (allowed: num_attention_heads = {heads})",
            )
        if cfg.get("attention_bias"):
            raise ConfigError(
                field, where, "attention_bias = true is not supported for deepseek_v3 (allowed: false)"
            )
        scoring = cfg.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(
                field,
                where,
                f"scoring_func {scoring!r} is not supported for DeepseekV3ForCausalLM (allowed: sigmoid)",
            )
        experts = int(_get(cfg, "n_routed_experts", "num_local_experts", default=0))
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        return _dense_if_no_experts(
            DeepSeekV3Args(
                **{
                    **fields,
                    "n_kv_heads": base.n_heads,
                    "attention_kind": "mla",
                    "q_lora_rank": int(cfg.get("q_lora_rank") or 0),
                    "kv_lora_rank": int(cfg["kv_lora_rank"]),
                    "qk_nope_head_dim": int(cfg["qk_nope_head_dim"]),
                    "qk_rope_head_dim": int(cfg["qk_rope_head_dim"]),
                    "v_head_dim": int(cfg["v_head_dim"]),
                    "rope_interleave": bool(cfg.get("rope_interleave", True)),
                    "moe_experts": experts,
                    "moe_top_k": int(_get(cfg, "num_experts_per_tok", default=8)),
                    "moe_ffn_dim": int(_get(cfg, "moe_intermediate_size", default=base.ffn_dim)),
                    "moe_score": "sigmoid",
                    "moe_norm_topk": bool(_get(cfg, "norm_topk_prob", default=True)),
                    "moe_route_scale": float(_get(cfg, "routed_scaling_factor", default=1.0)),
                    "moe_groups": int(_get(cfg, "n_group", default=1)),
                    "moe_topk_groups": int(_get(cfg, "topk_group", default=1)),
                    "moe_shared_experts": int(_get(cfg, "n_shared_experts", default=0)),
                    "moe_bias": experts > 0,
                    "moe_bias_speed": 0.001 if experts else 0.0,  # DeepSeek-V3's gamma; a folder does not say
                    "first_k_dense": int(_get(cfg, "first_k_dense_replace", default=3)),
                    "moe_layer_freq": int(_get(cfg, "moe_layer_freq", default=1)),
                    "mtp_depth": int(_get(cfg, "num_nextn_predict_layers", default=0)),
                }
            )
        )

    def config(self, args: DeepSeekV3Args) -> dict:
        if args.moe and (args.moe_score != "sigmoid" or not args.moe_bias or args.moe_layer_freq != 1):
            raise UserError(
                "DeepseekV3ForCausalLM routes by sigmoid scores with a selection bias in every block "
                "after the dense ones; this model has softmax scores, no bias or moe_layer_freq > 1"
            )
        moe = (
            {
                "n_routed_experts": args.moe_experts,
                "num_experts_per_tok": args.moe_top_k,
                "moe_intermediate_size": args.expert_ffn_dim,
                "n_shared_experts": args.moe_shared_experts,
                "routed_scaling_factor": args.moe_route_scale,
                "n_group": args.moe_groups,
                "topk_group": args.moe_topk_groups,
                "norm_topk_prob": args.moe_norm_topk,
                "scoring_func": "sigmoid",
                "topk_method": "noaux_tc",
                "output_router_logits": False,
            }
            if args.moe
            else {}
        )
        return {
            "q_lora_rank": args.q_lora_rank or None,
            "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim,
            "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim,
            "rope_interleave": args.rope_interleave,
            "num_key_value_heads": args.n_heads,
            "head_dim": args.qk_rope_head_dim,
            "intermediate_size": args.ffn_dim,
            **moe,
            "first_k_dense_replace": args.first_k_dense if args.moe else args.n_layers,
            "num_nextn_predict_layers": args.mtp_depth,
        }

    def fit(self, args: DeepSeekV3Args, holds) -> DeepSeekV3Args:
        """The MTP modules whose layer the folder holds (a transformers save keeps the count, not the layer)."""
        depth = next(
            (k for k in range(args.mtp_depth) if not holds(f"mtp.{args.n_layers + k}.eh_proj.weight")),
            args.mtp_depth,
        )
        return _dense_if_no_experts(args.with_(mtp_depth=depth))

    def hf_name(self, name: str) -> str | None:
        m = re.fullmatch(r"mtp\.(\d+)\.(.+)", name)
        if m and m.group(2) in _MTP:
            return f"model.layers.{m.group(1)}.{_MTP[m.group(2)]}"
        return None

    def derived(self, tensors: dict, args: DeepSeekV3Args) -> dict:
        head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
        out = {}
        for k in range(args.mtp_depth):
            layer = f"model.layers.{args.n_layers + k}"
            out[f"{layer}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
            out[f"{layer}.shared_head.head.weight"] = head.clone()
        return out

    def ignored(self, name: str, args: DeepSeekV3Args) -> bool:
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        return bool(m) and int(m.group(1)) >= args.n_layers and m.group(2) in _COPIES


class DeepSeekV2HF(DeepSeekV3HF):
    """``DeepseekV2ForCausalLM`` (V2, V2-Lite): softmax scores, top-k greedy or group-limited (a group scored by its
    best score), the k weights times ``routed_scaling_factor`` without renormalizing (as transformers computes it),
    no selection bias, no MTP layer."""

    architecture = "DeepseekV2ForCausalLM"
    model_type = "deepseek_v2"
    layer_names = {k: v for k, v in DeepSeekV3HF.layer_names.items() if not k.endswith("expert_bias")}

    def args(self, cfg: dict, base: LlamaArgs, field: str, where: str) -> DeepSeekV2Args:
        method = cfg.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(
                field,
                where,
                f"topk_method {method!r} is not supported for DeepseekV2ForCausalLM "
                "(allowed: greedy | group_limited_greedy)",
            )
        grouped = method == "group_limited_greedy"
        v3 = super().args(
            {**cfg, "scoring_func": "sigmoid", "num_nextn_predict_layers": 0, "rope_interleave": True},
            base,
            field,
            where,
        )
        fields = {f: getattr(v3, f) for f in v3.__dataclass_fields__}
        return _dense_if_no_experts(
            DeepSeekV2Args(
                **{
                    **fields,
                    "moe_score": "softmax",
                    "moe_norm_topk": False,
                    "moe_bias": False,
                    "moe_bias_speed": 0.0,
                    "moe_groups": int(cfg.get("n_group") or 1) if grouped else 1,
                    "moe_topk_groups": int(cfg.get("topk_group") or 1) if grouped else 1,
                }
            )
        )

    def config(self, args: DeepSeekV2Args) -> dict:
        if args.moe and (args.moe_score != "softmax" or args.moe_bias or args.moe_norm_topk):
            raise UserError(
                "DeepseekV2ForCausalLM routes by softmax scores, not renormalized, without a selection "
                "bias; this model differs"
            )
        out = {
            k: v
            for k, v in super().config(args.with_(moe_score="sigmoid", moe_bias=True)).items()
            if k not in ("scoring_func", "rope_interleave", "num_nextn_predict_layers")
        }
        if args.moe:
            out.update(
                norm_topk_prob=False,
                topk_method="group_limited_greedy" if args.moe_groups > 1 else "greedy",
                n_group=args.moe_groups if args.moe_groups > 1 else None,
                topk_group=args.moe_topk_groups if args.moe_groups > 1 else None,
            )
        return out

    def fit(self, args: DeepSeekV2Args, holds) -> DeepSeekV2Args:
        return args

    def derived(self, tensors: dict, args) -> dict:
        return {}

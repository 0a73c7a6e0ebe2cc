"""The Llama families' Hugging Face adapter (``LlamaHF``): Llama, Mistral, Qwen2, Qwen3, Mixtral and dense
DeepSeek-V3 folders are loom's Llama with a switch each, so their names and config.json keys map here; other
Llama-like families (loom.models.spec.HFAdapter) extend these names and the common config keys.

The dense families differ by one switch: Mistral attends through a sliding window (``LlamaArgs.sliding_window``),
Qwen2 has biases on its q/k/v projections (``attention_bias``), Qwen3 normalizes each q/k head before RoPE
(``qk_norm``). An export names the family from those switches, so a Mistral folder without a window comes back as a
Llama one: the same model to transformers. loom's Llama uses Hugging Face's RoPE convention (rotate-half), so
converting weights is only renaming: no permutation of the q/k rows.

A loom mixture-of-experts model is a Mixtral (``MixtralForCausalLM``): the same router (softmax over the experts,
top-k, the k weights renormalized) and SwiGLU experts, no shared experts. Its stacked expert weights, w1 / w3
(n, E, H) and w2 (n, H, E), are stored the way the published Mixtral checkpoints are, one (H, E) / (E, H) tensor
per expert (``block_sparse_moe.experts.{j}.w1.weight``, transposed), which transformers 4 and 5 both load.

A loom model with multi-head latent attention (``LlamaArgs.attention_kind = "mla"``) is a DeepSeek-V3
(``DeepseekV3ForCausalLM``) whose layers are all dense (``first_k_dense_replace`` = the layer count): loom's
``LatentAttention`` keeps DeepSeek's weight layout (interleaved RoPE rows included: ``rope_interleave``), so this is
renaming too.
"""

from __future__ import annotations

from loom.config.errors import ConfigError, UserError
from loom.models.common.mla import YarnScaling
from loom.models.common.rope import RopeScaling
from loom.models.llama.flavors import LlamaArgs

CONFIG = "config.json"
ARCHITECTURE = "LlamaForCausalLM"
MOE_ARCHITECTURE = "MixtralForCausalLM"
MLA_ARCHITECTURE = "DeepseekV3ForCausalLM"
# Hugging Face architecture -> its model_type, the family's name here
ARCHITECTURES = {
    ARCHITECTURE: "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    MOE_ARCHITECTURE: "mixtral",
    MLA_ARCHITECTURE: "deepseek_v3",
}

# ---- names -------------------------------------------------------------------------------------

TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_IN_LAYER_MOE = {"feed_forward.router.gate.weight": "block_sparse_moe.gate.weight"}
_IN_LAYER_BIAS = {  # Qwen2
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
}
_IN_LAYER_QK_NORM = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
# multi-head latent attention (DeepSeek-V3), in place of wq (kept without a query compression) / wk / wv
_IN_LAYER_MLA_Q = {
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
}
_IN_LAYER_MLA_KV = {
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
}
# every one-to-one name inside a block, dense or MoE
LAYER_NAMES = (
    _IN_LAYER | _IN_LAYER_MOE | _IN_LAYER_BIAS | _IN_LAYER_QK_NORM | _IN_LAYER_MLA_Q | _IN_LAYER_MLA_KV
)
# stacked loom expert weights -> the per-expert name (``{j}`` = expert) of each slice, stored transposed
EXPERTS = {
    "feed_forward.experts.w1": "block_sparse_moe.experts.{j}.w1.weight",
    "feed_forward.experts.w3": "block_sparse_moe.experts.{j}.w3.weight",
    "feed_forward.experts.w2": "block_sparse_moe.experts.{j}.w2.weight",
}


def _layer_leaves(args: LlamaArgs) -> list[str]:
    """The names of one block's weights under these args, relative to the block: the attention's extra weights
    follow its output projection."""
    if args.mla:
        query = list(_IN_LAYER_MLA_Q) if args.q_lora_rank else ["attention.wq.weight"]
        return (
            query
            + list(_IN_LAYER_MLA_KV)
            + [
                leaf
                for leaf in _IN_LAYER
                if not leaf.startswith("attention.w") or leaf == "attention.wo.weight"
            ]
        )
    extra = (list(_IN_LAYER_BIAS) if args.attention_bias else []) + (
        list(_IN_LAYER_QK_NORM) if args.qk_norm else []
    )
    leaves = []
    for leaf in _IN_LAYER:
        if not (args.moe and leaf.startswith("feed_forward.")):
            leaves.append(leaf)
        if leaf == "attention.wo.weight":
            leaves += extra
    return leaves + (list(_IN_LAYER_MOE) + list(EXPERTS) if args.moe else [])


# ---- config.json -> LlamaArgs ------------------------------------------------------------------


def rope_settings(
    cfg: dict, field: str, where: str, yarn: bool = False
) -> tuple[float, RopeScaling | YarnScaling | None]:
    """(theta, scaling) from transformers 5 ``rope_parameters`` or transformers 4 ``rope_theta``/``rope_scaling``;
    ``yarn``: DeepSeek's YaRN is allowed too (the family whose attention applies its softmax scale)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "yarn" and yarn:
        return theta, _yarn_settings(params, field, where)
    if kind != "llama3":
        raise ConfigError(
            field,
            where,
            f"RoPE type {kind!r} is not supported (allowed: default | llama3{' | yarn' if yarn else ''})",
        )
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    except KeyError as err:
        raise ConfigError(field, where, f"llama3 RoPE scaling lacks {err.args[0]!r}") from None
    return theta, scaling


def _yarn_settings(params: dict, field: str, where: str) -> YarnScaling:
    """DeepSeek's YaRN parameters; what loom's YaRN table does not compute is refused by name."""
    for key, default in (("attention_factor", None), ("truncate", True), ("partial_rotary_factor", 1.0)):
        if params.get(key, default) not in (default, None):
            raise ConfigError(
                field, where, f"YaRN with {key} = {params[key]} is not supported (allowed: unset)"
            )
    try:
        return YarnScaling(
            factor=float(params["factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0),
        )
    except (KeyError, TypeError) as err:
        raise ConfigError(field, where, f"yarn RoPE scaling lacks {err.args[0]!r}") from None


def hf_family(cfg: dict) -> str | None:
    """The family of a parsed config.json ("llama", "mistral", "qwen2", "qwen3", "mixtral"), from its
    architectures (its model_type where it names none); None for any other model."""
    archs = [causal_architecture(a) for a in cfg.get("architectures") or []]
    if archs:
        return next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    return cfg.get("model_type") if cfg.get("model_type") in ARCHITECTURES.values() else None


SCORE_SUFFIX = (
    "ForSequenceClassification"  # a reward model's architecture: LlamaForSequenceClassification, ...
)


def causal_architecture(name: str) -> str:
    """A ``*ForSequenceClassification`` architecture's ``*ForCausalLM`` (the same body; a reward model's score head
    in place of the LM head: loom.methods.reward); any other name as it is."""
    return name.removesuffix(SCORE_SUFFIX) + "ForCausalLM" if name.endswith(SCORE_SUFFIX) else name


def _hf_window(cfg: dict, family: str, field: str, where: str) -> int:
    """The sliding window of a config.json (0: none). Mistral's ``sliding_window``; a Qwen's only with
    ``use_sliding_window`` and then in every layer (loom has one window for all of them)."""
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window"):
            return 0
        n = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= int(cfg.get("max_window_layers", 0)) else "full_attention"
            for i in range(n)
        ]
        if window is not None and set(types) != {"sliding_attention"}:
            raise ConfigError(
                field,
                where,
                f"a sliding window in some layers only ({types.count('full_attention')} "
                f"of {n} attend fully) is not supported: loom's layers share one window",
            )
    return int(window or 0)


def _check_supported(cfg: dict, field: str, where: str) -> None:
    """Reject what loom's Llama cannot represent, by name, instead of loading wrong weights."""
    family = hf_family(cfg)
    if family is None:
        found = ", ".join(cfg.get("architectures") or []) or cfg.get("model_type", "unknown")
        raise ConfigError(
            field, where, f"architecture {found} is not supported (allowed: {', '.join(ARCHITECTURES)})"
        )
    if family == "mixtral" and cfg.get("sliding_window") is not None:
        raise ConfigError(
            field,
            where,
            f"sliding_window = {cfg['sliding_window']} is not supported for Mixtral (allowed: null)",
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(field, where, f"hidden_act {cfg['hidden_act']!r} is not supported (allowed: silu)")
    if cfg.get("mlp_bias"):
        raise ConfigError(
            field, where, "mlp_bias = true is not supported (loom's feed-forward has no biases)"
        )
    if cfg.get("attention_bias") and family != "qwen2":  # Llama's and Qwen3's bias the output projection too
        raise ConfigError(
            field,
            where,
            f"attention_bias = true is not supported for {family} (it biases the output "
            "projection too; loom biases q/k/v only, as Qwen2)",
        )


def common_args(cfg: dict, field: str, where: str) -> LlamaArgs:
    """What every Llama-like family's config.json gives (a family with its own adapter adds the rest)."""
    for key, allowed in (("hidden_act", "silu"), ("mlp_bias", False)):
        if cfg.get(key, allowed) != allowed:
            raise ConfigError(field, where, f"{key} = {cfg[key]!r} is not supported (allowed: {allowed})")
    try:
        dim, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        theta, scaling = rope_settings(cfg, field, where, yarn=True)
        return LlamaArgs(
            dim=dim,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=n_heads,
            ffn_dim=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
            head_dim=int(cfg.get("head_dim") or dim // n_heads),
        )
    except KeyError as err:
        raise ConfigError(field, where, f"{CONFIG} lacks {err.args[0]!r}") from None


class LlamaHF:
    """The Llama families' mapping; the base every Llama-like family's adapter (loom.models.spec.HFAdapter)
    extends. ``layer_names`` / ``expert_names``: a family's block names beyond (or replacing) ``LAYER_NAMES`` /
    ``EXPERTS``; ``fallback``: claims every config.json no other family claims (and names it unsupported)."""

    architecture = ARCHITECTURE
    model_type = "llama"
    layer_names: dict[str, str] = {}
    expert_names: dict[str, str] = {}
    fallback = True
    optional_modules = False  # a folder's weights may lack modules its config names (``fit``)

    def block_names(self) -> dict[str, str]:
        return {**LAYER_NAMES, **self.layer_names}

    def expert_templates(self) -> dict[str, str]:
        return {**EXPERTS, **self.expert_names}

    def claims(self, cfg: dict, archs: list[str]) -> bool:
        return self.fallback

    def from_config(self, cfg: dict, field: str, where: str) -> LlamaArgs:
        """LlamaArgs from a parsed config.json of one of the Llama families."""
        _check_supported(cfg, field, where)
        family = hf_family(cfg)
        try:
            dim, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            theta, scaling = rope_settings(cfg, field, where, yarn=family == "deepseek_v3")
            moe = (
                dict(
                    moe_experts=int(cfg["num_local_experts"]),
                    moe_top_k=int(cfg.get("num_experts_per_tok", 2)),
                    moe_ffn_dim=int(cfg["intermediate_size"]),
                )
                if family == "mixtral"
                else {}
            )
            if family == "deepseek_v3":
                moe = dict(
                    attention_kind="mla",
                    q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                    kv_lora_rank=int(cfg["kv_lora_rank"]),
                    qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                    qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                    v_head_dim=int(cfg["v_head_dim"]),
                    rope_interleave=bool(cfg.get("rope_interleave", True)),
                )
            return LlamaArgs(
                dim=dim,
                n_layers=int(cfg["num_hidden_layers"]),
                n_heads=n_heads,
                n_kv_heads=n_heads
                if family == "deepseek_v3"
                else int(cfg.get("num_key_value_heads") or n_heads),
                ffn_dim=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
                head_dim=int(cfg.get("head_dim") or dim // n_heads),
                attention_bias=family == "qwen2",
                qk_norm=family == "qwen3",
                sliding_window=_hf_window(cfg, family, field, where),
                **moe,
            )
        except KeyError as err:
            raise ConfigError(field, where, f"{CONFIG} lacks {err.args[0]!r}") from None

    def fit(self, args: LlamaArgs, holds) -> LlamaArgs:
        """``args`` as a folder holds them (``holds(loom_name)``: whether it stores that tensor)."""
        return args

    # ---- LlamaArgs -> config.json ----

    def architecture_of(self, args: LlamaArgs) -> str:
        """Mixtral for experts, Qwen3 for q/k norms, Qwen2 for q/k/v biases, Mistral for a sliding window, DeepSeek-V3
        for latent attention, else Llama; a UserError for a combination none of them holds."""
        if args.mla:
            if args.moe or args.qk_norm or args.attention_bias or args.sliding_window:
                raise UserError(
                    "no Hugging Face architecture holds multi-head latent attention with experts, q/k "
                    "norms, q/k/v biases or a sliding window (DeepseekV3ForCausalLM: dense layers, none "
                    "of those)"
                )
            return MLA_ARCHITECTURE
        if args.moe and (args.qk_norm or args.attention_bias):
            raise UserError(
                "no Hugging Face architecture holds a mixture of experts with q/k norms or q/k/v biases"
            )
        if args.qk_norm and args.attention_bias:
            raise UserError(
                "no Hugging Face architecture holds q/k norms with q/k/v biases only (Qwen3's "
                "attention_bias biases the output projection too)"
            )
        if args.moe:
            return MOE_ARCHITECTURE
        if args.qk_norm:
            return "Qwen3ForCausalLM"
        if args.attention_bias:
            return "Qwen2ForCausalLM"
        return "MistralForCausalLM" if args.sliding_window else ARCHITECTURE

    def model_type_of(self, args: LlamaArgs) -> str:
        return ARCHITECTURES[self.architecture_of(args)]

    def shape_config(self, args: LlamaArgs) -> dict:
        """config.json's expert or latent-attention keys (after intermediate_size)."""
        # a Mixtral's router: its own balance loss is not loom's (sequence-wise): off in transformers
        if args.moe:
            return {
                "num_local_experts": args.moe_experts,
                "num_experts_per_tok": args.moe_top_k,
                "output_router_logits": False,
                "router_jitter_noise": 0.0,
            }
        if args.mla:  # all dense; transformers' DeepSeek-V3 keeps head_dim = the RoPE part's width
            return {
                "q_lora_rank": args.q_lora_rank or None,
                "kv_lora_rank": args.kv_lora_rank,
                "qk_nope_head_dim": args.qk_nope_head_dim,
                "qk_rope_head_dim": args.qk_rope_head_dim,
                "v_head_dim": args.v_head_dim,
                "rope_interleave": args.rope_interleave,
                "first_k_dense_replace": args.n_layers,
                "num_nextn_predict_layers": 0,
            }
        return {}

    def window_config(self, args: LlamaArgs) -> dict:
        """config.json's sliding-window keys for the family (a Qwen: the same window in every layer)."""
        family = self.model_type_of(args)
        window = args.sliding_window or None
        if family in ("qwen2", "qwen3"):
            return {
                "use_sliding_window": window is not None,
                "sliding_window": window,
                "max_window_layers": 0 if window else args.n_layers,
                "layer_types": ["sliding_attention" if window else "full_attention"] * args.n_layers,
            }
        return {"sliding_window": window} if family in ("mistral", "mixtral") else {}

    def config(self, args: LlamaArgs) -> dict:
        """config.json keys beyond (or replacing) the common ones, written last."""
        return {}

    def imported_config(self, cfg: dict, args: LlamaArgs) -> dict | None:
        """The config.json an import keeps of its source (None: the source's file as it is)."""
        return None

    # ---- names ----

    def state_names(self, args: LlamaArgs) -> list[str] | None:
        """Every weight of a model with these args, in Hugging Face's order; the head only when untied (None: the
        model's own state names in its order, loom.checkpoint.hf.names)."""
        names = ["tok_embeddings.weight"]
        for i in range(args.n_layers):
            names += [f"layers.{i}.{leaf}" for leaf in _layer_leaves(args)]
        names.append("norm.weight")
        if not args.tie_embeddings:
            names.append("output.weight")
        return names

    def hf_name(self, name: str) -> str | None:
        """The Hugging Face name of a loom tensor that is not a block's (None: none)."""
        return None

    def derived(self, tensors: dict, args: LlamaArgs) -> dict:
        """Tensors an export writes besides the model's own (copies the published layout repeats)."""
        return {}

    def ignored(self, name: str, args: LlamaArgs) -> bool:
        """Stored tensors an import skips (derived copies)."""
        return False

"""Hugging Face Llama, Mistral, Qwen2, Qwen3, Mixtral and (dense) DeepSeek-V3 folders <-> loom: config mapping, sharded
loading, export (with the run's tokenizer and generation config, a folder transformers loads as it is), import to a
DCP checkpoint (which ``model.init_from`` accepts too).

The dense families are loom's Llama with a switch each: Mistral attends through a sliding window
(``LlamaArgs.sliding_window``), Qwen2 has biases on its q/k/v projections (``attention_bias``), Qwen3 normalizes
each q/k head before RoPE (``qk_norm``). An export names the family from those switches, so a Mistral folder
without a window comes back as a Llama one: the same model to transformers.

loom's Llama uses Hugging Face's RoPE convention (rotate-half), so converting weights is only
renaming: no permutation of the q/k rows. A Hugging Face folder is ``config.json`` plus either
``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` files with ``model.safetensors.index.json``.

A loom mixture-of-experts model is a Mixtral (``MixtralForCausalLM``): the same router (softmax over the experts,
top-k, the k weights renormalized) and SwiGLU experts, no shared experts. Its stacked expert weights, w1 / w3
(n, E, H) and w2 (n, H, E), are stored the way the published Mixtral checkpoints are, one (H, E) / (E, H) tensor
per expert (``block_sparse_moe.experts.{j}.w1.weight``, transposed), which transformers 4 and 5 both load.

A loom model with multi-head latent attention (``LlamaArgs.attention_kind = "mla"``) is a DeepSeek-V3
(``DeepseekV3ForCausalLM``) whose layers are all dense (``first_k_dense_replace`` = the layer count): loom's
``LatentAttention`` keeps DeepSeek's weight layout (interleaved RoPE rows included: ``rope_interleave``), so this is
renaming too. A family registered with its own adapter (loom.models.registry: Qwen3-MoE, DeepSeek-V3 with its MoE
layers and multi-token prediction) brings its own config mapping and names; this module applies them.

Loading reads the safetensors files directly with ``safe_open(...).get_slice(name)[rows]``: every
rank reads only the region of each tensor its (FSDP/HSDP-sharded) parameter holds. The alternative,
DCP's ``HuggingFaceStorageReader`` + ``dcp.load`` with renamed keys, also reads with ``get_slice`` and
was no faster (334M-parameter fp32 model, 4 shards, one process on a shared 2-core CPU: 0.1-0.5 s
for either, bound by the page cache). We kept the direct reader because it needs no collectives
(DCP plans a load across all ranks, so every rank must call it together), can fill an untied
head from tied embeddings (DCP cannot map one stored tensor to two destinations), and names a
missing, unexpected or misshapen tensor in one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass, field

import torch

from loom.checkpoint.manager import MARKER, STATE, _disk_full, load_model_weights, verify, write_marker
from loom.config.errors import ConfigError, UserError, require
from loom.data.tokenizers import COMPANIONS, TOKENIZER_JSON, build_tokenizer, is_byte, tokenizer_files
from loom.models.common.init import canonical_name
from loom.models.common.mla import YarnScaling
from loom.models.common.rope import RopeScaling
from loom.models.llama.flavors import LlamaArgs
from loom.models.registry import build_model, hf_adapter, spec_for_hf


CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
HF_CONFIG_COPY = "hf_config.json"  # the source config.json, kept inside an imported loom checkpoint
HF_GENERATION_COPY = "hf_generation_config.json"  # and its generation_config.json
TOKENIZER_COPY = "tokenizer"  # an imported checkpoint's copy of the source's tokenizer files
GENERATION_CONFIG = "generation_config.json"
ARCHITECTURE = "LlamaForCausalLM"
MOE_ARCHITECTURE = "MixtralForCausalLM"
MLA_ARCHITECTURE = "DeepseekV3ForCausalLM"
# Hugging Face architecture -> its model_type, the family's name here
FAMILIES = {ARCHITECTURE: "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3", MOE_ARCHITECTURE: "mixtral", MLA_ARCHITECTURE: "deepseek_v3"}
SCORE_SUFFIX = "ForSequenceClassification"  # a reward model's architecture: LlamaForSequenceClassification, ...
SCORE_WEIGHT = "score.weight"  # its head (num_labels 1, no bias): loom's ``output.weight`` of shape (1, dim)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size ("5GB")

# ---- names -------------------------------------------------------------------------------------

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
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
_IN_LAYER_QK_NORM = {"attention.q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
                     "attention.k_norm.weight": "self_attn.k_norm.weight"}
# multi-head latent attention (DeepSeek-V3), in place of wq (kept without a query compression) / wk / wv
_IN_LAYER_MLA_Q = {"attention.wq_a.weight": "self_attn.q_a_proj.weight",
                   "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
                   "attention.wq_b.weight": "self_attn.q_b_proj.weight"}
_IN_LAYER_MLA_KV = {"attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
                    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
                    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight"}
# every one-to-one name inside a block, dense or MoE
_LAYER_NAMES = _IN_LAYER | _IN_LAYER_MOE | _IN_LAYER_BIAS | _IN_LAYER_QK_NORM | _IN_LAYER_MLA_Q | _IN_LAYER_MLA_KV
# stacked loom expert weights -> the per-expert name (``{j}`` = expert) of each slice, stored transposed
_EXPERTS = {"feed_forward.experts.w1": "block_sparse_moe.experts.{j}.w1.weight",
            "feed_forward.experts.w3": "block_sparse_moe.experts.{j}.w3.weight",
            "feed_forward.experts.w2": "block_sparse_moe.experts.{j}.w2.weight"}


def _names(args: LlamaArgs | None) -> tuple[dict[str, str], dict[str, str], object]:
    """(block leaf names, stacked expert templates, the family's adapter or None) for a model with ``args`` (None:
    the Llama families')."""
    adapter = None if args is None else hf_adapter(args)
    if adapter is None:
        return _LAYER_NAMES, _EXPERTS, None
    return {**_LAYER_NAMES, **adapter.layer_names}, {**_EXPERTS, **adapter.expert_names}, adapter


def _block_leaf(name: str) -> tuple[str, str] | None:
    """(block index, leaf) of a block's tensor: ``layers.{i}.{leaf}``, or a multi-token prediction module's block
    ``mtp.{i}.block.{leaf}`` (stored as layer i, DeepSeek's layout)."""
    head, _, rest = name.partition(".")
    index, _, leaf = rest.partition(".")
    if head == "layers":
        return index, leaf
    if head == "mtp" and leaf.startswith("block."):
        return index, leaf.removeprefix("block.")
    return None


def hf_name(name: str, args: LlamaArgs | None = None) -> str:
    """loom parameter name (wrapper segments allowed) -> Hugging Face tensor name (not for stacked experts:
    ``hf_expert_names``); ``args``: the model's, for a family with its own names (None: the Llama families')."""
    name = canonical_name(name)
    if name in _TOP:
        return _TOP[name]
    layer_names, _, adapter = _names(args)
    part = _block_leaf(name)
    if part is not None and part[1] in layer_names:
        return f"model.layers.{part[0]}.{layer_names[part[1]]}"
    found = adapter.hf_name(name) if adapter is not None else None
    if found is None:
        raise KeyError(f"no Hugging Face name for loom parameter {name!r}")
    return found


def stacked_experts(name: str, args: LlamaArgs | None = None) -> bool:
    """Whether loom parameter ``name`` is a stacked expert weight (one Hugging Face tensor per expert)."""
    part = _block_leaf(canonical_name(name))
    return part is not None and part[1] in _names(args)[1]


def hf_expert_names(name: str, n_experts: int, args: LlamaArgs | None = None) -> list[str]:
    """Stacked loom expert weight -> the Hugging Face tensor of each expert, in expert order."""
    index, leaf = _block_leaf(canonical_name(name))
    template = _names(args)[1][leaf]
    return [f"model.layers.{index}.{template.format(j=j)}" for j in range(n_experts)]


def _ignorable(name: str) -> bool:
    """Tensors some Llama folders carry that are derived, not learned (old transformers saved inv_freq)."""
    return name.endswith("rotary_emb.inv_freq")


# ---- config.json <-> LlamaArgs -----------------------------------------------------------------

def is_loom_checkpoint(folder: str) -> bool:
    """A complete loom checkpoint folder (``step_N`` of a run, or ``loom convert --from-hf``'s output), not a Hugging
    Face one (a transformers Trainer's checkpoint also holds a trainer_state.json: the marker tells them apart)."""
    return os.path.isfile(os.path.join(folder, MARKER))


def read_hf_config(folder: str, field: str = "model.init_from") -> dict:
    """config.json of a Hugging Face folder (``hf_config.json`` of an imported loom checkpoint), or a ConfigError
    naming what is wrong with the folder."""
    if not os.path.isdir(folder):
        raise ConfigError(field, folder, "folder not found (expected a Hugging Face Llama-family folder)")
    path = os.path.join(folder, CONFIG)
    if is_loom_checkpoint(folder):
        path = os.path.join(folder, HF_CONFIG_COPY)
        if not os.path.isfile(path):
            raise ConfigError(field, folder, "a loom checkpoint of a training run, which starts nothing by its "
                              "model shape alone: allowed a Hugging Face folder or a checkpoint of `loom convert "
                              "--from-hf`; export this one with `loom convert --to-hf` and start from that, or "
                              "continue it with --checkpoint.resume")
    elif not os.path.isfile(path):
        raise ConfigError(field, folder, f"no {CONFIG} in this folder (expected a Hugging Face Llama-family folder "
                          "or a checkpoint of `loom convert --from-hf`)")
    try:
        with open(path) as fh:
            cfg = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(field, folder, f"unreadable {CONFIG} ({err})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(field, folder, f"{CONFIG} is not a JSON object")
    return cfg


def _rope_settings(cfg: dict, field: str, where: str, yarn: bool = False
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
        raise ConfigError(field, where, f"RoPE type {kind!r} is not supported (allowed: default | llama3"
                          f"{' | yarn' if yarn else ''})")
    try:
        scaling = RopeScaling(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                              high_freq_factor=float(params["high_freq_factor"]),
                              original_max_position=int(params["original_max_position_embeddings"]))
    except KeyError as err:
        raise ConfigError(field, where, f"llama3 RoPE scaling lacks {err.args[0]!r}") from None
    return theta, scaling


def _yarn_settings(params: dict, field: str, where: str) -> YarnScaling:
    """DeepSeek's YaRN parameters; what loom's YaRN table does not compute is refused by name."""
    for key, default in (("attention_factor", None), ("truncate", True), ("partial_rotary_factor", 1.0)):
        if params.get(key, default) not in (default, None):
            raise ConfigError(field, where, f"YaRN with {key} = {params[key]} is not supported (allowed: unset)")
    try:
        return YarnScaling(factor=float(params["factor"]),
                           original_max_position=int(params["original_max_position_embeddings"]),
                           beta_fast=float(params.get("beta_fast") or 32),
                           beta_slow=float(params.get("beta_slow") or 1), mscale=float(params.get("mscale") or 0),
                           mscale_all_dim=float(params.get("mscale_all_dim") or 0))
    except (KeyError, TypeError) as err:
        raise ConfigError(field, where, f"yarn RoPE scaling lacks {err.args[0]!r}") from None


def causal_architecture(name: str) -> str:
    """A ``*ForSequenceClassification`` architecture's ``*ForCausalLM`` (the same body; a reward model's score head
    in place of the LM head: loom.train.reward); any other name as it is."""
    return name.removesuffix(SCORE_SUFFIX) + "ForCausalLM" if name.endswith(SCORE_SUFFIX) else name


def is_score_config(cfg: dict) -> bool:
    """Whether a parsed config.json is a reward model's: a ``*ForSequenceClassification`` with one label."""
    labels = cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)
    return any(a.endswith(SCORE_SUFFIX) for a in cfg.get("architectures") or []) and int(labels) == 1


def has_score_head(model: torch.nn.Module) -> bool:
    """Whether a loom Llama carries a reward model's score head (``output`` of width 1: loom.train.reward) in place
    of its LM head."""
    output = getattr(model, "output", None)
    return output is not None and output.weight.shape[0] == 1 and model.args.vocab_size != 1


def hf_family(cfg: dict) -> str | None:
    """The family of a parsed config.json ("llama", "mistral", "qwen2", "qwen3", "mixtral"), from its
    architectures (its model_type where it names none); None for any other model."""
    archs = [causal_architecture(a) for a in cfg.get("architectures") or []]
    if archs:
        return next((FAMILIES[a] for a in archs if a in FAMILIES), None)
    return cfg.get("model_type") if cfg.get("model_type") in FAMILIES.values() else None


def _hf_window(cfg: dict, family: str, field: str, where: str) -> int:
    """The sliding window of a config.json (0: none). Mistral's ``sliding_window``; a Qwen's only with
    ``use_sliding_window`` and then in every layer (loom has one window for all of them)."""
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window"):
            return 0
        n = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= int(cfg.get("max_window_layers", 0)) else "full_attention" for i in range(n)]
        if window is not None and set(types) != {"sliding_attention"}:
            raise ConfigError(field, where, f"a sliding window in some layers only ({types.count('full_attention')} "
                                            f"of {n} attend fully) is not supported: loom's layers share one window")
    return int(window or 0)


def _check_supported(cfg: dict, field: str, where: str) -> None:
    """Reject what loom's Llama cannot represent, by name, instead of loading wrong weights."""
    family = hf_family(cfg)
    if family is None:
        found = ", ".join(cfg.get("architectures") or []) or cfg.get("model_type", "unknown")
        raise ConfigError(field, where, f"architecture {found} is not supported (allowed: {', '.join(FAMILIES)})")
    if family == "mixtral" and cfg.get("sliding_window") is not None:
        raise ConfigError(field, where, f"sliding_window = {cfg['sliding_window']} is not supported for Mixtral "
                                        "(allowed: null)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(field, where, f"hidden_act {cfg['hidden_act']!r} is not supported (allowed: silu)")
    if cfg.get("mlp_bias"):
        raise ConfigError(field, where, "mlp_bias = true is not supported (loom's feed-forward has no biases)")
    if cfg.get("attention_bias") and family != "qwen2":  # Llama's and Qwen3's bias the output projection too
        raise ConfigError(field, where, f"attention_bias = true is not supported for {family} (it biases the output "
                                        "projection too; loom biases q/k/v only, as Qwen2)")


# config.json fields that are numbers (null allowed where transformers allows it)
_NUMBERS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "intermediate_size",
            "vocab_size", "rms_norm_eps", "max_position_embeddings", "head_dim", "num_local_experts",
            "num_experts_per_tok", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "rope_theta", "sliding_window", "num_labels")
_POSITIVE = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")


def _check_numbers(cfg: dict, field: str, where: str) -> None:
    """A string (or a list, or a bool) where config.json has a number is one line naming the key, not a traceback."""
    for key in _NUMBERS:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(field, where, f"{CONFIG}: {key} = {value!r} is not a number")
    for key in _POSITIVE:
        if key in cfg and cfg[key] is not None and cfg[key] <= 0:
            raise ConfigError(field, where, f"{CONFIG}: {key} = {cfg[key]!r} must be positive")


def _common_args(cfg: dict, field: str, where: str) -> LlamaArgs:
    """What every family's config.json gives (a family with its own adapter adds the rest)."""
    for key, allowed in (("hidden_act", "silu"), ("mlp_bias", False)):
        if cfg.get(key, allowed) != allowed:
            raise ConfigError(field, where, f"{key} = {cfg[key]!r} is not supported (allowed: {allowed})")
    try:
        dim, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        theta, scaling = _rope_settings(cfg, field, where, yarn=True)
        return LlamaArgs(dim=dim, n_layers=int(cfg["num_hidden_layers"]), n_heads=n_heads, n_kv_heads=n_heads,
                         ffn_dim=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
                         tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                         norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                         max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
                         head_dim=int(cfg.get("head_dim") or dim // n_heads))
    except KeyError as err:
        raise ConfigError(field, where, f"{CONFIG} lacks {err.args[0]!r}") from None


def llama_args_from_hf_config(cfg: dict, field: str = "model.init_from", where: str = "") -> LlamaArgs:
    """LlamaArgs (a family's subclass where it registers an adapter: loom.models.registry) from a parsed
    config.json; ``max_seq_len`` = max_position_embeddings."""
    _check_numbers(cfg, field, where)
    spec = spec_for_hf(cfg)
    if spec is not None:
        try:
            args = spec.hf.args(cfg, _common_args(cfg, field, where), field, where)
        except KeyError as err:
            raise ConfigError(field, where, f"{CONFIG} lacks {err.args[0]!r}") from None
        if args.n_kv_heads != args.n_heads and args.n_heads % args.n_kv_heads:
            raise ConfigError(field, where, f"num_key_value_heads = {args.n_kv_heads} does not divide "
                              f"num_attention_heads = {args.n_heads}")
        return args
    _check_supported(cfg, field, where)
    family = hf_family(cfg)
    try:
        dim, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        theta, scaling = _rope_settings(cfg, field, where, yarn=family == "deepseek_v3")
        moe = dict(moe_experts=int(cfg["num_local_experts"]), moe_top_k=int(cfg.get("num_experts_per_tok", 2)),
                   moe_ffn_dim=int(cfg["intermediate_size"])) if family == "mixtral" else {}
        if family == "deepseek_v3":
            moe = dict(attention_kind="mla", q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                       kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                       qk_rope_head_dim=int(cfg["qk_rope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]),
                       rope_interleave=bool(cfg.get("rope_interleave", True)))
        return LlamaArgs(
            dim=dim, n_layers=int(cfg["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=n_heads if family == "deepseek_v3" else int(cfg.get("num_key_value_heads") or n_heads),
            ffn_dim=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
            head_dim=int(cfg.get("head_dim") or dim // n_heads), attention_bias=family == "qwen2",
            qk_norm=family == "qwen3", sliding_window=_hf_window(cfg, family, field, where), **moe)
    except KeyError as err:
        raise ConfigError(field, where, f"{CONFIG} lacks {err.args[0]!r}") from None


def llama_args_from_hf(folder: str, field: str = "model.init_from") -> LlamaArgs:
    """The loom shape of a Hugging Face folder of a registered family (from its config.json; a family's optional
    modules as far as the weights hold them: ``HFAdapter.fit``)."""
    args = llama_args_from_hf_config(read_hf_config(folder, field), field, folder)
    adapter = hf_adapter(args)
    if adapter is None or is_loom_checkpoint(folder):  # an import's config copy says what it holds
        return args
    try:
        names = set(weight_files(folder))
    except UserError:  # no weights to look at (a config alone): the config's word; loading says what is missing
        return args
    return adapter.fit(args, lambda name: hf_name(name, args) in names)


def hf_architecture(args: LlamaArgs) -> str:
    """The Hugging Face architecture that holds a loom model with these args: Mixtral for experts, Qwen3 for q/k
    norms, Qwen2 for q/k/v biases, Mistral for a sliding window, else Llama; a UserError for a combination none
    of them holds; a family with its own adapter: its architecture."""
    adapter = hf_adapter(args)
    if adapter is not None:
        return adapter.architecture
    if args.mla:
        if args.moe or args.qk_norm or args.attention_bias or args.sliding_window:
            raise UserError("no Hugging Face architecture holds multi-head latent attention with experts, q/k norms, "
                            "q/k/v biases or a sliding window (DeepseekV3ForCausalLM: dense layers, none of those)")
        return MLA_ARCHITECTURE
    if args.moe and (args.qk_norm or args.attention_bias):
        raise UserError("no Hugging Face architecture holds a mixture of experts with q/k norms or q/k/v biases")
    if args.qk_norm and args.attention_bias:
        raise UserError("no Hugging Face architecture holds q/k norms with q/k/v biases only (Qwen3's attention_bias "
                        "biases the output projection too)")
    if args.moe:
        return MOE_ARCHITECTURE
    if args.qk_norm:
        return "Qwen3ForCausalLM"
    if args.attention_bias:
        return "Qwen2ForCausalLM"
    return "MistralForCausalLM" if args.sliding_window else ARCHITECTURE


def _window_config(args: LlamaArgs, family: str) -> dict:
    """config.json's sliding-window keys for the family (a Qwen: the same window in every layer)."""
    window = args.sliding_window or None
    if family in ("qwen2", "qwen3"):
        return {"use_sliding_window": window is not None, "sliding_window": window,
                "max_window_layers": 0 if window else args.n_layers,
                "layer_types": ["sliding_attention" if window else "full_attention"] * args.n_layers}
    return {"sliding_window": window} if family in ("mistral", "mixtral") else {}


def hf_config_from_args(args: LlamaArgs, dtype: torch.dtype, score: bool = False) -> dict:
    """config.json for the family that holds the model (``hf_architecture``). RoPE is written both ways
    (transformers 4: rope_theta + rope_scaling; transformers 5: rope_parameters) so either reader, and tools that
    parse the file themselves, find it. ``score``: a reward model, the family's ``*ForSequenceClassification`` with
    one label (its score head has no tie to the embeddings)."""
    if score:
        head = {"architectures": [hf_architecture(args).removesuffix("ForCausalLM") + SCORE_SUFFIX],
                "num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
                "tie_word_embeddings": False}
        return {**hf_config_from_args(args, dtype), **head}
    scaling = None
    s = args.rope_scaling
    if isinstance(s, YarnScaling):
        scaling = {"rope_type": "yarn", "factor": s.factor, "original_max_position_embeddings": s.original_max_position,
                   "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, **({"mscale": s.mscale} if s.mscale else {}),
                   **({"mscale_all_dim": s.mscale_all_dim} if s.mscale_all_dim else {})}
    elif s is not None:
        scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                   "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position}
    dtype_name = str(dtype).removeprefix("torch.")
    architecture = hf_architecture(args)
    adapter = hf_adapter(args)
    family = adapter.model_type if adapter is not None else FAMILIES[architecture]
    # a Mixtral's router: its own balance loss is not loom's (sequence-wise): off when loading in transformers
    moe = {"num_local_experts": args.moe_experts, "num_experts_per_tok": args.moe_top_k,
           "output_router_logits": False, "router_jitter_noise": 0.0} if args.moe and adapter is None else {}
    if args.mla and adapter is None:  # all dense; transformers' DeepSeek-V3 keeps head_dim = the RoPE part's width
        moe = {"q_lora_rank": args.q_lora_rank or None, "kv_lora_rank": args.kv_lora_rank,
               "qk_nope_head_dim": args.qk_nope_head_dim, "qk_rope_head_dim": args.qk_rope_head_dim,
               "v_head_dim": args.v_head_dim, "rope_interleave": args.rope_interleave,
               "first_k_dense_replace": args.n_layers, "num_nextn_predict_layers": 0}
    return {
        "architectures": [architecture],
        "model_type": family,
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.rope_dim if args.mla else args.head_dim,
        "intermediate_size": args.expert_ffn_dim if args.moe else args.ffn_dim, **moe,
        **_window_config(args, family),
        "vocab_size": args.vocab_size, "tie_word_embeddings": args.tie_embeddings, "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len, "hidden_act": "silu", "attention_bias": args.attention_bias,
        "mlp_bias": False, "rope_theta": args.rope_theta, "rope_scaling": scaling,
        "rope_parameters": {"rope_theta": args.rope_theta, **(scaling or {"rope_type": "default"})},
        "torch_dtype": dtype_name, "dtype": dtype_name, **(adapter.config(args) if adapter is not None else {}),
    }


# ---- reading safetensors into a (possibly sharded) model ---------------------------------------

def open_weights(path: str):
    """``safe_open`` of one safetensors file; a damaged one (a cut-off download or copy) as a one-line UserError.
    Opening parses the header and checks that the file covers every tensor it lists, so this finds a truncated
    file without reading its data."""
    safe_open = require("safetensors", "hf", purpose="reading Hugging Face weights").safe_open
    try:
        return safe_open(path, framework="pt")
    except Exception as err:  # safetensors' SafetensorError derives from Exception only
        raise UserError(f"{path}: not a readable safetensors file ({err}); it is probably truncated (an interrupted "
                        "download or copy): download or copy it again") from None


def check_weights(folder: str) -> None:
    """Every safetensors file of a Hugging Face folder opens (headers only), or an imported loom checkpoint is
    complete with the hashes it records: found before a model is built."""
    if is_loom_checkpoint(folder):
        verify(folder)
        return
    for path in sorted(set(weight_files(folder).values())):
        with open_weights(path):
            pass


def weight_files(folder: str) -> dict[str, str]:
    """Hugging Face tensor name -> the safetensors file holding it (from the index, or the files' headers)."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
            out = {name: os.path.join(folder, f) for name, f in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise UserError(f"{index}: not a safetensors index with a weight_map ({err}); download it again") from None
        for path in set(out.values()):
            if not os.path.isfile(path):
                raise UserError(f"{index} names {os.path.basename(path)}, which is not in {folder}")
        return out
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise UserError(f"{folder}: no safetensors weights (need {SINGLE} or sharded files with {INDEX}; "
                        "re-save .bin checkpoints with save_pretrained(safe_serialization=True))")
    out = {}
    for f in files:
        with open_weights(os.path.join(folder, f)) as handle:
            out.update({name: os.path.join(folder, f) for name in handle.keys()})
    return out


def owned_region(param: torch.Tensor) -> tuple[slice, ...]:
    """The index ranges of the full tensor that this rank stores: everything for a plain tensor, the
    local shard for a DTensor (FSDP's Shard(0), HSDP's (Replicate, Shard(0)), any Shard(d), and FSDP2 over
    expert-parallel experts: a _StridedShard(0) that splits this rank's ep shard further)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    odd = [p for p in param.placements if type(p) not in (Shard, Replicate, _StridedShard)]
    if odd:
        raise NotImplementedError(f"loading into placements {odd} (only Shard/Replicate)")
    # plain shards first (mesh order), then the strided ones from the innermost out: a _StridedShard is a
    # split applied to what the later mesh dims' shards already left (FSDP2 after TP / EP)
    mesh, coord = param.device_mesh, param.device_mesh.get_coordinate()
    order = [i for i, p in enumerate(param.placements) if type(p) is Shard] + \
        [i for i, p in reversed(list(enumerate(param.placements))) if type(p) is _StridedShard]
    region = [(0, n) for n in param.shape]
    for i in order:
        dim, size = param.placements[i].dim, mesh.size(i)
        start, length = region[dim]
        chunk = -(-length // size)  # torch.chunk: ceil-sized pieces, the last ones shorter or empty
        lo = min(start + coord[i] * chunk, start + length)
        region[dim] = (lo, min(chunk, start + length - lo))
    shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, param.placements)
    if tuple(n for _, n in region) != tuple(shape) or any(n and o != lo for (lo, n), o in zip(region, offset)):
        raise NotImplementedError(f"loading into placements {param.placements}: the local shard is not one block")
    return tuple(slice(lo, lo + n) for lo, n in region)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def _source_names(name: str, param: torch.Tensor, files: dict[str, str], hf_tied: bool,
                  args: LlamaArgs | None = None) -> list[str]:
    """The stored tensors that fill loom parameter ``name``: one, or one per expert for stacked expert weights;
    an untied loom head may start from tied embeddings."""
    if stacked_experts(name, args):
        return hf_expert_names(name, param.shape[0], args)
    src = hf_name(name, args)
    if src == "lm_head.weight" and src not in files and hf_tied:
        return ["model.embed_tokens.weight"]
    return [src]


def _check_tying(model: torch.nn.Module, files: dict[str, str], hf_tied: bool, folder: str) -> None:
    """A tied loom model cannot hold a checkpoint whose head differs from its embeddings."""
    if model.args.tie_embeddings and not hf_tied and "lm_head.weight" in files:
        raise ConfigError("model.tie_embeddings", "true", f"{folder} has its own lm_head weights "
                          "(tie_word_embeddings is false); use model.tie_embeddings = false or flavor")


def _read_into(handle, src: str, param: torch.Tensor, folder: str) -> None:
    """Copy this rank's region of stored tensor ``src`` into ``param``, reading only that region."""
    sl = handle.get_slice(src)
    stored = tuple(sl.get_shape())
    if stored != tuple(param.shape):
        raise UserError(f"{folder}: tensor {src} has shape {list(stored)}, the loom model expects "
                        f"{list(param.shape)} (check model.vocab_size / the model shape)")
    region = owned_region(param)
    local = _local(param)
    if local.numel() == 0:
        return  # an uneven split can leave a rank without rows of a small tensor
    local.copy_(sl[region])  # (rows this rank owns, ...); cast to the parameter's dtype


def _read_experts_into(handle_of, srcs: list[str], param: torch.Tensor, folder: str) -> None:
    """A stacked expert weight (n, a, b) from ``srcs``, one stored (b, a) tensor per expert: this rank's experts
    (FSDP2 / expert parallelism shard the expert dim), each read only over this rank's block, transposed."""
    region = owned_region(param)  # (experts, a, b)
    local = _local(param)
    for k, j in enumerate(range(region[0].start, region[0].stop)):
        sl = handle_of(srcs[j]).get_slice(srcs[j])
        stored, want = tuple(sl.get_shape()), (param.shape[2], param.shape[1])
        if stored != want:
            raise UserError(f"{folder}: tensor {srcs[j]} has shape {list(stored)}, the loom model expects "
                            f"{list(want)} (check the expert width / model shape)")
        local[k].copy_(sl[region[2], region[1]].T)  # (b, a) block -> (a, b)


def check_checkpoint_shapes(folder: str, model: torch.nn.Module, field: str, whole_model: bool = True,
                            hint: str = "") -> None:
    """``model``'s tensors against loom checkpoint ``folder``'s before loading, each mismatch one line naming the
    tensor (DCP's own error is a traceback) and then ``hint``; ``whole_model``: the checkpoint holds no model
    tensor it lacks."""
    from torch.distributed.checkpoint import FileSystemReader

    stored = {k.removeprefix("model."): tuple(m.size) for k, m in
              FileSystemReader(folder).read_metadata().state_dict_metadata.items() if k.startswith("model.")}
    names = set()
    for name, t in model.state_dict().items():
        name = canonical_name(name)
        names.add(name)
        if name not in stored:
            raise ConfigError(field, folder, f"has no model tensor {name} (not a loom Llama checkpoint, or "
                              "another model.tie_embeddings)")
        if stored[name] != tuple(t.shape):
            raise ConfigError(field, folder, f"{name} has shape {list(stored[name])} but the config gives "
                              f"{list(t.shape)}{hint}")
    extra = sorted(set(stored) - names)
    if whole_model and extra:
        raise ConfigError(field, folder, f"holds tensors with no place in this model: {', '.join(extra[:4])} "
                          "(another model.tie_embeddings?)")


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, folder: str, whole_model: bool = True) -> None:
    """Fill a loom Llama (plain, sharded with FSDP2/HSDP/TP, or one pipeline stage: ``whole_model`` false)
    from a Hugging Face folder; each rank reads only the rows it owns. No collectives: every rank reads
    its own part independently. From an imported loom checkpoint (``loom convert --from-hf``) DCP loads it: every
    rank calls this for each of its parts in the same order."""
    if is_loom_checkpoint(folder):
        hf_tied = bool(read_hf_config(folder).get("tie_word_embeddings", False))
        if model.args.tie_embeddings and not hf_tied:
            raise ConfigError("model.tie_embeddings", "true", f"{folder} has its own output weights "
                              "(tie_word_embeddings is false); use model.tie_embeddings = false or flavor")
        check_checkpoint_shapes(folder, model, "model.init_from", whole_model)
        load_model_weights(folder, model)
        return
    hf_cfg = read_hf_config(folder)
    hf_tied = bool(hf_cfg.get("tie_word_embeddings", False))
    files = weight_files(folder)
    score = has_score_head(model)
    if not score:
        _check_tying(model, files, hf_tied, folder)
    params = dict(model.named_parameters())  # tied weights appear once
    state = model.state_dict(keep_vars=True)  # persistent buffers (a router's selection bias) are weights too
    params.update({n: b for n, b in model.named_buffers() if n in state})
    args = model.args
    sources = {name: _source_names(name, param, files, hf_tied, args) for name, param in params.items()}
    if score:  # a reward model's head: the folder's score head, or (a base model's folder) its own seeded init
        sources.update({n: [SCORE_WEIGHT] if SCORE_WEIGHT in files else [] for n in params
                        if canonical_name(n) == "output.weight"})
    used = {src for srcs in sources.values() for src in srcs}
    missing = sorted(used - set(files))
    if missing:
        raise UserError(f"{folder}: missing tensors {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    adapter = hf_adapter(args)
    unused = sorted(n for n in set(files) - used if not _ignorable(n)
                    and not (n == "lm_head.weight" and (hf_tied or score))
                    and not (adapter is not None and adapter.ignored(n, args)))
    if unused and whole_model:
        raise UserError(f"{folder}: tensors with no place in the loom model: {', '.join(unused[:4])}"
                        f"{' ...' if len(unused) > 4 else ''}")
    with contextlib.ExitStack() as stack:
        handles: dict[str, object] = {}

        def handle_of(src: str):
            if files[src] not in handles:
                handles[files[src]] = stack.enter_context(open_weights(files[src]))
            return handles[files[src]]

        for name, param in params.items():
            if not sources[name]:
                continue
            if stacked_experts(name, args):
                _read_experts_into(handle_of, sources[name], param, folder)
            else:
                _read_into(handle_of(sources[name][0]), sources[name][0], param, folder)


# ---- writing a Hugging Face folder -------------------------------------------------------------

def _layer_leaves(args: LlamaArgs) -> list[str]:
    """The names of one block's weights under these args, relative to the block: the attention's extra weights
    follow its output projection."""
    if args.mla:
        query = list(_IN_LAYER_MLA_Q) if args.q_lora_rank else ["attention.wq.weight"]
        return query + list(_IN_LAYER_MLA_KV) + [leaf for leaf in _IN_LAYER if not leaf.startswith("attention.w")
                                                 or leaf == "attention.wo.weight"]
    extra = (list(_IN_LAYER_BIAS) if args.attention_bias else []) + (list(_IN_LAYER_QK_NORM) if args.qk_norm else [])
    leaves = []
    for leaf in _IN_LAYER:
        if not (args.moe and leaf.startswith("feed_forward.")):
            leaves.append(leaf)
        if leaf == "attention.wo.weight":
            leaves += extra
    return leaves + (list(_IN_LAYER_MOE) + list(_EXPERTS) if args.moe else [])


def expected_loom_names(args: LlamaArgs) -> list[str]:
    """Every weight of a loom Llama with these args, in Hugging Face's order; the head only when untied. A family
    with its own adapter: its model's state names (persistent buffers included) in the model's order."""
    if hf_adapter(args) is not None:
        with torch.device("meta"):
            names = list(build_model(args.with_(max_seq_len=1)).state_dict())
        return [n for n in names if not (n == "output.weight" and args.tie_embeddings)]
    names = ["tok_embeddings.weight"]
    for i in range(args.n_layers):
        names += [f"layers.{i}.{leaf}" for leaf in _layer_leaves(args)]
    names.append("norm.weight")
    if not args.tie_embeddings:
        names.append("output.weight")
    return names


def hf_state_dict(model_state: dict[str, torch.Tensor], args: LlamaArgs, score: bool = False
                  ) -> dict[str, torch.Tensor]:
    """Rename a full (unsharded) loom state dict to Hugging Face names; the tied head is not stored. ``score``: a
    reward model's, whose ``output.weight`` (1, dim) is the score head ``score.weight``."""
    state = {canonical_name(k): v for k, v in model_state.items()}
    expected = expected_loom_names(args.with_(tie_embeddings=False) if score else args)
    missing = [n for n in expected if n not in state]
    extra = sorted(set(state) - set(expected) - {"output.weight"})
    if missing or extra:
        raise UserError(f"the model state does not match the model shape: missing {missing[:4]}, "
                        f"unexpected {extra[:4]}")
    out = {}
    for name in expected:
        t = state[name]
        if hasattr(t, "full_tensor"):
            raise TypeError(f"{name} is a DTensor; export needs full tensors (gather them first)")
        t = t.detach().to("cpu")
        if stacked_experts(name, args):  # (n, a, b) -> one (b, a) tensor per expert
            out.update({src: t[j].T.contiguous() for j, src in enumerate(hf_expert_names(name, t.shape[0], args))})
        elif score and name == "output.weight":
            out[SCORE_WEIGHT] = t.contiguous()
        else:
            out[hf_name(name, args)] = t.contiguous()
    adapter = hf_adapter(args)
    return out if adapter is None or score else {**out, **adapter.derived(out, args)}


def plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Greedy split, in order, into groups of at most ``max_bytes`` (a larger tensor gets a group alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def check_empty_target(out_folder: str, also: tuple[str, ...] = ()) -> None:
    """Refuse to mix new files with a model already in the folder (stale shards would be loaded too), or to
    overwrite the files named in ``also`` (the tokenizer's)."""
    if os.path.isdir(out_folder):
        clash = [f for f in sorted(os.listdir(out_folder)) if f.endswith(".safetensors") or f in (CONFIG, INDEX)]
        clash += [f for f in also if os.path.exists(os.path.join(out_folder, f))]
        if clash:
            raise UserError(f"{out_folder} already holds a model ({clash[0]}); choose an empty folder")


# ---- the tokenizer of an exported folder -------------------------------------------------------

@dataclass(frozen=True)
class ExportTokenizer:
    """What an exported folder takes from the run's tokenizer: files written beside the weights (name -> bytes)
    and the special token ids for config.json and generation_config.json (None: unknown; ``eos_ids``: every id
    that ends a generation, loom's end-of-document id first)."""
    files: dict[str, bytes] = field(default_factory=dict)
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    pad_id: int | None = None

    def config_ids(self) -> dict:
        """The ids config.json gets (a single EOS: the one loom ends documents with)."""
        ids = {"bos_token_id": self.bos_id, "eos_token_id": self.eos_ids[0] if self.eos_ids else None,
               "pad_token_id": self.pad_id}
        return {k: v for k, v in ids.items() if v is not None}

    def generation_config(self) -> dict:
        eos = list(self.eos_ids) if len(self.eos_ids) > 1 else (self.eos_ids[0] if self.eos_ids else None)
        ids = {"bos_token_id": self.bos_id, "eos_token_id": eos, "pad_token_id": self.pad_id}
        return {k: v for k, v in ids.items() if v is not None}


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with ``content``."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def tokenizer_export(spec: str, max_len: int, chat_template: str | None = None) -> ExportTokenizer:
    """The Hugging Face tokenizer files of loom tokenizer ``spec`` with its special ids: for the byte tokenizer
    a tokenizer.json with the same ids (``ByteTokenizer.hf_json``) and the chat template a run on it renders with
    (``chat_template`` or the built-in one), so that a fine-tuning run from the export and transformers'
    ``apply_chat_template`` find it; for a tokenizer.json its file and companions (chat template included; a run's
    own ``chat_template`` text replaces the folder's), tokenizer_config.json naming BOS / EOS as loom finds them.
    ``max_len``: the tokenizer's model_max_length where its config has none."""
    from loom.data.chat import BUILTIN_TEMPLATE

    tok = build_tokenizer(spec)
    if is_byte(spec):
        special = {"bos_token": tok.token(tok.bos_id), "eos_token": tok.token(tok.eos_id),
                   "pad_token": tok.token(tok.pad_id)}
        conf = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": max_len,
                "clean_up_tokenization_spaces": False, "chat_template": chat_template or BUILTIN_TEMPLATE}
        files = {TOKENIZER_JSON: tok.hf_json().encode(), "tokenizer_config.json": _json_bytes(conf),
                 "special_tokens_map.json": _json_bytes(special)}
        return ExportTokenizer(files, tok.bos_id, (tok.eos_id,), tok.pad_id)
    files = {}
    for name, path in tokenizer_files(spec).items():
        with open(path, "rb") as fh:
            files[name] = fh.read()
    conf = tok.config()
    stated_eos = _token_name(conf.get("eos_token"))
    pad = next((i for i in (tok.token_id(n) for n in (_token_name(conf.get("pad_token")), "<pad>", "<|pad|>") if n)
                if i is not None), None)
    special = {k: tok.token(i) for k, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id),
                                            ("pad_token", pad)) if i is not None}
    conf = {**conf, "tokenizer_class": "PreTrainedTokenizerFast", **special}
    conf.pop("auto_map", None)  # remote code of the source's own tokenizer class: not what this folder holds
    if chat_template is not None:  # the run's own template (data.chat_template) in place of the folder's
        if "chat_template.jinja" in files:
            files["chat_template.jinja"] = chat_template.encode()
        else:
            conf["chat_template"] = chat_template
    conf.setdefault("model_max_length", max_len)
    files["tokenizer_config.json"] = _json_bytes(conf)
    stated_map = _read_json_bytes(files.get("special_tokens_map.json"))
    files["special_tokens_map.json"] = _json_bytes({**stated_map, **special})
    eos = [tok.eos_id]
    stated = tok.token_id(stated_eos) if stated_eos else None
    if stated is not None and stated != tok.eos_id:  # e.g. a chat model's end-of-turn token
        eos.append(stated)
    return ExportTokenizer(files, tok.bos_id, tuple(eos), pad)


def _read_json_bytes(data: bytes | None) -> dict:
    try:
        out = json.loads(data) if data else {}
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def imported_tokenizer_export(ckpt: str) -> ExportTokenizer:
    """An imported checkpoint's tokenizer and special ids as its source folder had them (its copies, verbatim)."""
    files = {}
    folder = os.path.join(ckpt, TOKENIZER_COPY)
    for name in (TOKENIZER_JSON, *COMPANIONS):
        if os.path.isfile(os.path.join(folder, name)):
            with open(os.path.join(folder, name), "rb") as fh:
                files[name] = fh.read()
    if os.path.isfile(os.path.join(ckpt, HF_GENERATION_COPY)):
        with open(os.path.join(ckpt, HF_GENERATION_COPY), "rb") as fh:
            files[GENERATION_CONFIG] = fh.read()
    with open(os.path.join(ckpt, HF_CONFIG_COPY)) as fh:
        cfg = json.load(fh)
    eos = cfg.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)
    return ExportTokenizer(files, cfg.get("bos_token_id"), eos, cfg.get("pad_token_id"))


def export_file_names(tokenizer: ExportTokenizer | None) -> tuple[str, ...]:
    """The files besides the weights and config.json that an export with ``tokenizer`` writes."""
    if tokenizer is None:
        return ()
    return tuple(dict.fromkeys([*tokenizer.files, GENERATION_CONFIG]))


def export_hf(model_state: dict[str, torch.Tensor], args: LlamaArgs, out_folder: str,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer: ExportTokenizer | None = None,
              score: bool = False) -> list[str]:
    """Write ``out_folder`` as a Hugging Face folder of the family that holds the model (``hf_architecture``:
    LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM,
    DeepseekV3ForCausalLM); returns the
    safetensors file names. With ``tokenizer``: its files, its special ids in config.json and a
    generation_config.json, so that transformers, vLLM and PEFT load the folder as it is.

    ``model_state`` holds full tensors with loom names (``model.state_dict()`` of an unsharded model). ``score``: a
    reward model (loom.train.reward), written as the family's ``*ForSequenceClassification`` with ``score.weight``."""
    save_file = require("safetensors.torch", "hf", purpose="writing a Hugging Face folder").save_file

    hf_architecture(args)  # a model no family holds fails before anything is written
    tensors = hf_state_dict(model_state, args, score)
    check_empty_target(out_folder, export_file_names(tokenizer))
    groups = plan_shards(tensors, max_shard_bytes)
    names = [SINGLE] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    need = sum(t.numel() * t.element_size() for t in tensors.values())
    with whole_or_nothing(out_folder, "the Hugging Face folder", need) as written:
        mode = 0o666 & ~current_umask()  # what open() gives; safetensors writes its files 0600
        for fname, group in zip(names, groups):
            written.append(os.path.join(out_folder, fname))
            save_file({n: tensors[n] for n in group}, written[-1], metadata={"format": "pt"})
            os.chmod(written[-1], mode)
        if len(groups) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map = {n: fname for fname, group in zip(names, groups) for n in group}
            written.append(os.path.join(out_folder, INDEX))
            _write_json(written[-1], {"metadata": {"total_size": total}, "weight_map": weight_map})
        dtype = tensors["model.embed_tokens.weight"].dtype
        written.append(os.path.join(out_folder, CONFIG))
        _write_json(written[-1], {**hf_config_from_args(args, dtype, score),
                                  **(tokenizer.config_ids() if tokenizer else {})})
        if tokenizer is not None:
            files = {GENERATION_CONFIG: _json_bytes(tokenizer.generation_config()), **tokenizer.files}
            for name, data in files.items():
                written.append(os.path.join(out_folder, name))
                with open(written[-1], "wb") as fh:
                    fh.write(data)
    return names


@contextlib.contextmanager
def whole_or_nothing(out_folder: str, what: str, need: int | None = None):
    """Yields a list for the paths the block writes into ``out_folder``; when the block fails they are removed (and
    the folder, if it made it), so no half-written export is left for a reader to load. ``need``: the bytes the
    block writes, named when the disk is full."""
    created = not os.path.isdir(out_folder)
    written: list[str] = []
    try:
        os.makedirs(out_folder, exist_ok=True)
        yield written
    except BaseException as err:
        for path in written:
            with contextlib.suppress(OSError):
                os.remove(path)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out_folder)
        if isinstance(err, OSError) or _disk_full(err):
            space = f"; it needs about {need:,} bytes, {_free(out_folder):,} are free" if need and _disk_full(err) \
                else ""
            reason = getattr(err, "strerror", None) or "no space left on the device" if _disk_full(err) else \
                (getattr(err, "strerror", None) or err)
            raise UserError(f"{out_folder}: writing {what} failed ({reason}){space}; nothing partial was kept, the "
                            "target is as it was") from None
        raise


def _free(folder: str) -> int:
    """Free bytes on the filesystem of ``folder`` (or of the nearest folder above it that exists)."""
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder.rstrip(os.sep)) or "."
    try:
        return shutil.disk_usage(folder or ".").free
    except OSError:
        return 0


def current_umask() -> int:
    """The process's umask, read without changing it where Linux reports it (no window for other threads)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_json(path: str, obj) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")


# ---- importing into a loom checkpoint ----------------------------------------------------------

def weights_only_model(args: LlamaArgs) -> torch.nn.Module:
    """An uninitialized CPU Llama to load weights into. The RoPE table is not a weight (never saved),
    so it is built one row long instead of max_position_embeddings rows."""
    with torch.device("meta"):
        model = build_model(args.with_(max_seq_len=1))
    return model.to_empty(device="cpu")


def _imported_config_toml(out_folder: str, args: LlamaArgs, tokenizer: bool) -> str:
    """The config of an imported checkpoint: only what it knows, so that it also serves as ``--config`` (the
    model starts from the checkpoint itself; with the source's tokenizer where it had one). Every other field
    keeps its default."""
    here = os.path.abspath(out_folder)
    lines = ["[model]", f"init_from = {json.dumps(here)}", f"vocab_size = {args.vocab_size}",
             f"tie_embeddings = {json.dumps('true' if args.tie_embeddings else 'false')}", ""]
    if tokenizer:
        lines += ["[data]", f"tokenizer = {json.dumps(os.path.join(here, TOKENIZER_COPY))}", ""]
    return "\n".join(lines)


def _copy_hf_companions(hf_folder: str, tmp: str) -> bool:
    """Into an import: the source's tokenizer files (``tokenizer/``) and generation_config.json, which an export
    writes back; whether there was a tokenizer."""
    if os.path.isfile(os.path.join(hf_folder, GENERATION_CONFIG)):
        shutil.copyfile(os.path.join(hf_folder, GENERATION_CONFIG), os.path.join(tmp, HF_GENERATION_COPY))
    if not os.path.isfile(os.path.join(hf_folder, TOKENIZER_JSON)):
        return False
    os.makedirs(os.path.join(tmp, TOKENIZER_COPY))
    for name, path in tokenizer_files(hf_folder, "--from-hf").items():
        shutil.copyfile(path, os.path.join(tmp, TOKENIZER_COPY, name))
    return True


def import_hf_to_dcp(hf_folder: str, out_folder: str, field: str = "--from-hf") -> LlamaArgs:
    """Write a complete loom checkpoint folder (model weights only, step 0) from a Hugging Face folder.

    Written beside the target as ``.<name>.tmp`` and renamed when complete, like the trainer's saves.
    Holds the model once in CPU memory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    args = llama_args_from_hf(hf_folder, field)
    if os.path.exists(out_folder):
        raise ConfigError("--to", out_folder, "already exists; choose a new checkpoint folder")
    model = weights_only_model(args)
    load_hf_weights(model, hf_folder)
    parent, name = os.path.split(os.path.abspath(out_folder))
    tmp = os.path.join(parent, f".{name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with warnings.catch_warnings():  # "no process group: saving in a single process" is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=tmp, no_dist=True)
        # model_only: there is no optimizer state or data position to resume, the run starts at step 0
        _write_json(os.path.join(tmp, STATE), {"step": 0, "model_only": True,
                                               "imported_from": os.path.abspath(hf_folder)})
        adapter = hf_adapter(args)
        if adapter is None:
            shutil.copyfile(os.path.join(hf_folder, CONFIG), os.path.join(tmp, HF_CONFIG_COPY))
        else:  # the family's keys as the import holds them (optional modules its weights lack dropped: ``fit``)
            _write_json(os.path.join(tmp, HF_CONFIG_COPY), {**read_hf_config(hf_folder, field), **adapter.config(args)})
        has_tokenizer = _copy_hf_companions(hf_folder, tmp)
        with open(os.path.join(tmp, "config.toml"), "w") as fh:
            fh.write(_imported_config_toml(out_folder, args, has_tokenizer))
        write_marker(tmp, 0)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(err):  # DCP wraps it in a CheckpointException
            need = sum(t.numel() * t.element_size() for t in model.state_dict().values())
            raise UserError(f"{out_folder}: writing the loom checkpoint failed (no space left on the device); it needs "
                            f"about {need:,} bytes, {_free(parent):,} are free; nothing partial was kept") from None
        raise
    os.replace(tmp, out_folder)
    return args

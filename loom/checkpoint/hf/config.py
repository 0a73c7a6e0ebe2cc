"""config.json of a Hugging Face folder <-> the model's args, through its family's adapter (loom.models.registry):
the file names of a folder and of an imported loom checkpoint, reading the config with one-line errors, writing
one that transformers (4 and 5) and other readers parse."""

from __future__ import annotations

import json
import os

import torch

from loom.checkpoint.manager import MARKER
from loom.config.errors import ConfigError
from loom.models.common.mla import YarnScaling
from loom.models.llama.flavors import LlamaArgs
from loom.models.llama.hf import CONFIG
from loom.models.registry import hf_adapter, spec_for_hf

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
HF_CONFIG_COPY = "hf_config.json"  # the source config.json, kept inside an imported loom checkpoint
HF_GENERATION_COPY = "hf_generation_config.json"  # and its generation_config.json
TOKENIZER_COPY = "tokenizer"  # an imported checkpoint's copy of the source's tokenizer files
GENERATION_CONFIG = "generation_config.json"


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
            raise ConfigError(
                field,
                folder,
                "a loom checkpoint of a training run, which starts nothing by its "
                "model shape alone: allowed a Hugging Face folder or a checkpoint of `loom convert "
                "--from-hf`; export this one with `loom convert --to-hf` and start from that, or "
                "continue it with --checkpoint.resume",
            )
    elif not os.path.isfile(path):
        raise ConfigError(
            field,
            folder,
            f"no {CONFIG} in this folder (expected a Hugging Face Llama-family folder "
            "or a checkpoint of `loom convert --from-hf`)",
        )
    try:
        with open(path) as fh:
            cfg = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(field, folder, f"unreadable {CONFIG} ({err})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(field, folder, f"{CONFIG} is not a JSON object")
    return cfg


# config.json fields that are numbers (null allowed where transformers allows it)
_NUMBERS = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "head_dim",
    "num_local_experts",
    "num_experts_per_tok",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_theta",
    "sliding_window",
    "num_labels",
)
_POSITIVE = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",  # 0 was read as "absent" (as many as the heads)
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "head_dim",
)
# config.json fields of other types: (key, the types allowed besides null, what to say)
_TYPED = (
    ("tie_word_embeddings", (bool,), "true or false"),  # the string "no" was read as true
    ("rope_scaling", (dict,), "an object or null"),
    ("model_type", (str,), "a string"),
)


def _check_numbers(cfg: dict, field: str, where: str) -> None:
    """A string (or a list, or a bool) where config.json has a number is one line naming the key, not a traceback."""
    for key in _NUMBERS:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(field, where, f"{CONFIG}: {key} = {value!r} is not a number")
    for key in _POSITIVE:
        if key in cfg and cfg[key] is not None and cfg[key] <= 0:
            raise ConfigError(field, where, f"{CONFIG}: {key} = {cfg[key]!r} must be positive")
    for key, types, allowed in _TYPED:
        if cfg.get(key) is not None and not isinstance(cfg[key], types):
            raise ConfigError(field, where, f"{CONFIG}: {key} = {cfg[key]!r} is not {allowed}")
    archs = cfg.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ConfigError(field, where, f"{CONFIG}: architectures = {archs!r} is not a list of class names")
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ConfigError(
            field,
            where,
            f"{CONFIG}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
        )


def llama_args_from_hf_config(cfg: dict, field: str = "model.init_from", where: str = "") -> LlamaArgs:
    """The args (of the family whose adapter claims the config: loom.models.registry) from a parsed config.json;
    ``max_seq_len`` = max_position_embeddings."""
    _check_numbers(cfg, field, where)
    return spec_for_hf(cfg).hf.from_config(cfg, field, where)


def hf_architecture(args: LlamaArgs) -> str:
    """The Hugging Face architecture that holds a loom model with these args (its family's adapter chooses); a
    UserError for a combination none holds."""
    return hf_adapter(args).architecture_of(args)


def hf_config_from_args(args: LlamaArgs, dtype: torch.dtype) -> dict:
    """config.json for the family that holds the model (``hf_architecture``). RoPE is written both ways
    (transformers 4: rope_theta + rope_scaling; transformers 5: rope_parameters) so either reader, and tools that
    parse the file themselves, find it."""
    scaling = None
    s = args.rope_scaling
    if isinstance(s, YarnScaling):
        scaling = {
            "rope_type": "yarn",
            "factor": s.factor,
            "original_max_position_embeddings": s.original_max_position,
            "beta_fast": s.beta_fast,
            "beta_slow": s.beta_slow,
            **({"mscale": s.mscale} if s.mscale else {}),
            **({"mscale_all_dim": s.mscale_all_dim} if s.mscale_all_dim else {}),
        }
    elif s is not None:
        scaling = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position,
        }
    dtype_name = str(dtype).removeprefix("torch.")
    adapter = hf_adapter(args)
    return {
        "architectures": [adapter.architecture_of(args)],
        "model_type": adapter.model_type_of(args),
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.rope_dim if args.mla else args.head_dim,
        "intermediate_size": args.expert_ffn_dim if args.moe else args.ffn_dim,
        **adapter.shape_config(args),
        **adapter.window_config(args),
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": args.attention_bias,
        "mlp_bias": False,
        "rope_theta": args.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_theta": args.rope_theta, **(scaling or {"rope_type": "default"})},
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        **adapter.config(args),
    }

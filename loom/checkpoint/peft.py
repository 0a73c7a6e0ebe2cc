"""LoRA adapters <-> PEFT's format: a folder with ``adapter_config.json`` (peft_type LORA, r, lora_alpha,
target_modules as Hugging Face module names, use_rslora, base_model_name_or_path) and ``adapter_model.safetensors``
(``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``, ...), which ``peft.PeftModel.from_pretrained``
loads onto the base model's Hugging Face folder, and which ``lora.init_from`` loads into loom.

Names come from loom.checkpoint.hf.names' map (``hf_name`` of the adapted linear's weight), so an adapter's keys are
those of its base model's family.
"""

from __future__ import annotations

import json
import os

import torch

from loom.checkpoint.hf.export import current_umask, whole_or_nothing
from loom.checkpoint.hf.names import hf_name
from loom.checkpoint.hf.reader import open_weights, owned_region
from loom.config.errors import ConfigError, UserError, require
from loom.config.sections import LoraConfig
from loom.models.common.init import canonical_name
from loom.models.common.lora import SHARED_TARGETS, TARGETS, is_adapter, parse_targets
from loom.parallel.shards import local_tensor

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel wraps the CausalLM, whose decoder is ``model``


def hf_module(target: str, args=None) -> str:
    """lora.targets name -> the Hugging Face module name PEFT targets (q -> q_proj, gate -> gate_proj,
    shared_gate -> shared_experts.gate_proj, ...); ``args``: the model's, for a family with its own names (None: the
    Llama families')."""
    module = hf_name(f"layers.0.{TARGETS[target]}.weight", args).removesuffix(".weight").split(".")
    return ".".join(module[4:])  # after model.layers.0.{self_attn | mlp}


def peft_key(name: str, args=None) -> str:
    """loom adapter parameter name -> PEFT's key: ``layers.3.attention.wq.lora_A.weight`` ->
    ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``."""
    name = canonical_name(name)
    module, factor, _ = name.rsplit(".", 2)  # (layers.3.attention.wq, lora_A, weight)
    return f"{PREFIX}{hf_name(module + '.weight', args).removesuffix('.weight')}.{factor}.weight"


def adapter_config(lora: LoraConfig, base_model: str = "", args=None) -> dict:
    """PEFT's adapter_config.json for an adapter trained with ``lora`` on a model with ``args``."""
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": lora.rank,
        "lora_alpha": alpha,
        "lora_dropout": lora.dropout,
        "use_rslora": lora.rslora,
        "target_modules": [hf_module(t, args) for t in parse_targets(lora.targets)],
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
    }


def export_peft(
    model_state: dict[str, torch.Tensor], lora: LoraConfig, out_folder: str, base_model: str = "", args=None
) -> list[str]:
    """Write ``out_folder`` as a PEFT LoRA adapter from a full (unsharded) loom state dict's adapters (of a model with
    ``args``: its family's names); returns the files written. Nothing partial is left behind on failure."""
    shared = [t for t in parse_targets(lora.targets) if t in SHARED_TARGETS]
    if shared:
        raise ConfigError(
            "lora.targets",
            lora.targets,
            f"{', '.join(shared)}: PEFT (0.21, on transformers 5) maps every gate_proj / up_proj / down_proj target "
            "of a mixture-of-experts model onto its routed experts' fused weights, so an adapter on the shared "
            "experts would load onto the wrong weights: export the model merged with --to-hf",
        )
    save_file = require("safetensors.torch", "hf", purpose="writing a PEFT adapter").save_file
    tensors = {
        peft_key(k, args): v.detach().to("cpu").contiguous() for k, v in model_state.items() if is_adapter(k)
    }
    if not tensors:
        raise UserError("the model holds no LoRA adapters (lora.rank 0): nothing to write as a PEFT adapter")
    if os.path.isdir(out_folder) and os.listdir(out_folder):
        raise ConfigError("--to-peft", out_folder, "is not empty; choose a new folder")
    need = sum(t.numel() * t.element_size() for t in tensors.values())
    with whole_or_nothing(out_folder, "the PEFT adapter", need) as written:
        written.append(os.path.join(out_folder, ADAPTER_WEIGHTS))
        save_file(tensors, written[-1], metadata={"format": "pt"})
        os.chmod(written[-1], 0o666 & ~current_umask())  # safetensors writes 0600
        written.append(os.path.join(out_folder, ADAPTER_CONFIG))
        with open(written[-1], "w") as fh:
            json.dump(adapter_config(lora, base_model, args), fh, indent=2)
            fh.write("\n")
    return written


def read_adapter_config(folder: str, field: str = "lora.init_from") -> dict:
    """A PEFT adapter folder's adapter_config.json, or a ConfigError naming what is wrong with the folder."""
    path = os.path.join(folder, ADAPTER_CONFIG)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(folder, ADAPTER_WEIGHTS)):
        raise ConfigError(
            field,
            folder,
            f"expected a PEFT LoRA adapter folder ({ADAPTER_CONFIG} and "
            f"{ADAPTER_WEIGHTS}; PeftModel.save_pretrained writes them)",
        )
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as err:  # a JSONDecodeError, or bytes that are not UTF-8
        raise ConfigError(field, folder, f"{ADAPTER_CONFIG} cannot be read ({err})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(
            field,
            folder,
            f"{ADAPTER_CONFIG} is a JSON {type(cfg).__name__}, not an object (PEFT's LoraConfig fields)",
        )
    for key, kinds, what in (
        ("r", (int,), "a whole number"),
        ("lora_alpha", (int, float), "a number"),
        ("use_rslora", (bool,), "true or false"),
    ):
        value = cfg.get(key)
        if key in cfg and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            raise ConfigError(field, folder, f"{ADAPTER_CONFIG}: {key} = {value!r} is not {what}")
    targets = cfg.get("target_modules")
    if (
        targets is not None
        and not isinstance(targets, str)
        and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets))
    ):
        raise ConfigError(
            field,
            folder,
            f"{ADAPTER_CONFIG}: target_modules = {targets!r} is not a module name or a list of names",
        )
    return cfg


def check_adapter(folder: str, lora: LoraConfig, field: str = "lora.init_from", args=None) -> None:
    """The adapter must be a plain LoRA adapter that this run's [lora] section describes: r, lora_alpha, use_rslora
    and target_modules equal (each difference one line naming both values)."""
    cfg = read_adapter_config(folder, field)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigError(field, folder, f"holds a {cfg.get('peft_type')} adapter (allowed: LORA)")
    for key, plain in (
        ("use_dora", False),
        ("fan_in_fan_out", False),
        ("bias", "none"),
        ("modules_to_save", None),
        ("layers_to_transform", None),
        ("rank_pattern", {}),
        ("alpha_pattern", {}),
    ):
        if cfg.get(key) not in (plain, None):
            raise ConfigError(
                field, folder, f"{key} = {cfg.get(key)!r} is not supported (allowed: {plain!r})"
            )
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else sorted(targets)
    ours = sorted(hf_module(t, args) for t in parse_targets(lora.targets))
    for key, peft_name, theirs, same in (
        ("lora.rank", "r", cfg.get("r"), cfg.get("r") == lora.rank),
        ("lora.alpha", "lora_alpha", cfg.get("lora_alpha"), float(cfg.get("lora_alpha", -1)) == lora.alpha),
        (
            "lora.rslora",
            "use_rslora",
            cfg.get("use_rslora", False),
            bool(cfg.get("use_rslora")) == lora.rslora,
        ),
        ("lora.targets", "target_modules", targets, targets == ours),
    ):
        if not same:
            raise ConfigError(
                key,
                getattr(lora, key.split(".")[1]),
                f"the adapter lora.init_from = {folder} has {peft_name} = {theirs}: set {key} to match it",
            )


@torch.no_grad()
def load_peft_adapter(model: torch.nn.Module, lora: LoraConfig, whole_model: bool = True, args=None) -> int:
    """Fill ``model``'s adapters (plain or sharded, or one pipeline stage: ``whole_model`` false) from the PEFT
    adapter at ``lora.init_from``; each rank reads only the region of each factor it holds. Returns how many
    tensors were read."""
    folder = lora.init_from
    check_adapter(folder, lora, args=args)
    params = {canonical_name(n): p for n, p in model.named_parameters() if is_adapter(n)}
    with open_weights(os.path.join(folder, ADAPTER_WEIGHTS)) as handle:
        stored = {
            k.replace(".default.weight", ".weight"): k for k in handle.keys()
        }  # old saves kept the name
        keys = {name: peft_key(name, args) for name in params}
        missing = sorted(k for k in keys.values() if k not in stored)
        if missing:
            raise UserError(
                f"{folder}: missing adapter tensors {', '.join(missing[:3])}"
                f"{' ...' if len(missing) > 3 else ''} (another model, or other layers)"
            )
        extra = sorted(set(stored) - set(keys.values()))
        if extra and whole_model:
            raise UserError(
                f"{folder}: adapter tensors with no place in this model: {', '.join(extra[:3])}"
                f"{' ...' if len(extra) > 3 else ''}"
            )
        for name, p in params.items():
            sl = handle.get_slice(stored[keys[name]])
            if tuple(sl.get_shape()) != tuple(p.shape):
                raise UserError(
                    f"{folder}: {keys[name]} has shape {list(sl.get_shape())}, this model expects "
                    f"{list(p.shape)}"
                )
            local = local_tensor(p)
            if local.numel():
                local.copy_(sl[owned_region(p)])
    return len(params)

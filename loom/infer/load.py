"""What a ``Generator`` loads: a loom checkpoint (a run's ``step_N``, or its run dir: the newest complete
checkpoint), an import of ``loom convert --from-hf``, or a Hugging Face Llama-family folder; the model with
generation's kernels on its device (split over a tensor-parallel mesh when given), its tokenizer and chat template,
and the ids that end a generation. A run's checkpoint is read as ``loom convert`` and ``loom eval`` read it: the
config.toml saved in it, its tokenizer found where the run's copy is now."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from loom.config.errors import ConfigError
from loom.infer.text import Codec

DTYPES = ("auto", "float32", "bfloat16", "float16")
FIELD = "model"


@dataclass
class Loaded:
    model: torch.nn.Module
    codec: Codec | None  # None: no tokenizer (token ids only)
    eos_ids: tuple[int, ...]
    name: str
    kind: str  # "run" | "import" | "hf"


def pick_device(device: str) -> torch.device:
    """``auto``: this rank's GPU where there is one (LOCAL_RANK), else the CPU."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device", device, "no CUDA device here; allowed: auto | cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ConfigError("device", device, "allowed: auto | cpu | cuda | cuda:N") from None


def pick_dtype(dtype, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a GPU, float32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError("dtype", dtype, f"allowed: {' | '.join(DTYPES)}")
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def find_source(path: str) -> tuple[str, str]:
    """(kind, folder): "run" for a run's checkpoint (a run dir gives its newest complete one), "import" for an
    imported checkpoint, "hf" for a Hugging Face folder."""
    from loom.checkpoint.hf.config import CONFIG, HF_CONFIG_COPY, is_loom_checkpoint

    if not os.path.isdir(path):
        raise ConfigError(
            FIELD, path, "folder not found (expected a loom checkpoint or run dir, or a Hugging Face folder)"
        )
    if is_loom_checkpoint(path):
        return ("import" if os.path.isfile(os.path.join(path, HF_CONFIG_COPY)) else "run"), path
    if os.path.isfile(os.path.join(path, CONFIG)):
        return "hf", path
    if os.path.isfile(os.path.join(path, "config.toml")):
        from loom.checkpoint.manager import list_complete
        from loom.config.load import read_toml

        recorded = read_toml(os.path.join(path, "config.toml")).get("checkpoint.dir") or ""
        ckpt_dir = recorded if recorded and os.path.isdir(recorded) else os.path.join(path, "checkpoints")
        complete = list_complete(ckpt_dir)
        if not complete:
            raise ConfigError(FIELD, path, f"a run dir without a complete checkpoint (none in {ckpt_dir})")
        return "run", complete[-1][1]
    raise ConfigError(
        FIELD,
        path,
        "neither a loom checkpoint (COMPLETE.json), a run dir (config.toml) nor a Hugging "
        "Face folder (config.json)",
    )


def _run_config(folder: str):
    from loom.config import build_config
    from loom.config.load import read_toml
    from loom.train.run_dir import missing_tokenizer, recorded_values

    toml = os.path.join(folder, "config.toml")
    if not os.path.isfile(toml):
        raise ConfigError(
            FIELD, folder, "a loom checkpoint without its config.toml: the model's shape is unknown"
        )
    raw = read_toml(toml)
    missing = missing_tokenizer(folder, raw, "the run's tokenizer is needed to generate from its checkpoint")
    if missing is not None:
        raise missing
    return build_config(None, {**recorded_values(folder, raw), "checkpoint.resume": "none"})


def _read_json(path: str) -> dict:
    try:
        with open(path) as fh:
            out = json.load(fh)
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def hf_eos_ids(config: dict, generation_config: dict, tokenizer) -> tuple[int, ...]:
    """The ids that end a generation from a Hugging Face folder: generation_config.json's ``eos_token_id`` (what
    transformers' ``generate`` stops at), else config.json's, else the tokenizer's end-of-text token."""
    ids = _ids(generation_config.get("eos_token_id")) or _ids(config.get("eos_token_id"))
    if not ids and tokenizer is not None:
        ids = (tokenizer.eos_id,)
    return ids


def _template(spec: str, tokenizer, required: bool):
    from loom.data.chat import load_template

    try:
        return load_template(spec, tokenizer)
    except ConfigError as err:
        if required:  # the option the user gave (a generate/score flag), not the training field's name
            raise ConfigError("--chat-template", spec, err.allowed) from None
        return None


def generation_kernels(args, device: torch.device, compile: bool, tp: bool):
    """The model's kernels for generation, chosen as training chooses them (``loom.kernels.dispatch``): PyTorch's
    SDPA for the prefill's attention; on CUDA without compilation loom's fused norm, RoPE and SwiGLU (Inductor fuses
    them itself otherwise); never the fused loss (generation takes logits)."""
    from loom.kernels.dispatch import resolve_kernels

    auto = SimpleNamespace(
        attention="sdpa", fused_norm="auto", fused_rope="auto", fused_swiglu="auto", fused_loss="false"
    )
    kernels = resolve_kernels(auto, device.type, compile=compile, documents=False, tp=tp)
    return args.with_(**kernels.as_args())


def refuse_reward_model(path: str, field: str = FIELD) -> None:
    """A reward model (a ``training.objective reward`` run, or a ``*ForSequenceClassification`` folder) has a score
    head, no LM head: nothing can generate from it or evaluate it as a language model (one line naming the field)."""
    from loom.checkpoint.hf.config import CONFIG
    from loom.checkpoint.hf.head import is_score_config

    kind, folder = find_source(path)
    if kind == "run":
        reward = _run_config(folder).training.objective == "reward"
    else:
        config = _read_json(os.path.join(folder, CONFIG)) if kind == "hf" else {}
        reward = isinstance(config, dict) and is_score_config(config)
    if reward:
        raise ConfigError(
            field,
            path,
            "this is a reward model (a score head, no language-model head): use `loom "
            "score` to score texts with it (or grpo.reward_model to reward rollouts)",
        )


def load(
    path: str,
    *,
    device: str = "auto",
    dtype="auto",
    compile: bool | None = None,
    tp_mesh=None,
    chat_template: str | None = None,
) -> Loaded:
    """The model of ``path`` ready to generate (eval mode, weights in ``dtype``, RoPE table in fp32) with its
    codec and EOS ids. ``chat_template``: a .jinja file instead of the model's own. ``tp_mesh``: split the model
    over it (``loom.infer.tp``; every rank of the mesh calls this)."""
    from loom.checkpoint.hf.config import (
        CONFIG,
        GENERATION_CONFIG,
        HF_CONFIG_COPY,
        HF_GENERATION_COPY,
        TOKENIZER_COPY,
        llama_args_from_hf_config,
    )
    from loom.checkpoint.hf.reader import llama_args_from_hf, load_hf_weights
    from loom.data import build_tokenizer
    from loom.data.tokenizers import TOKENIZER_JSON

    kind, folder = find_source(path)
    refuse_reward_model(path)
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    compile = dev.type == "cuda" if compile is None else compile
    lora = None
    if kind == "run":
        from loom.resolve import resolve_model_args

        cfg = _run_config(folder)
        tokenizer = build_tokenizer(cfg.data.tokenizer)
        args, lora = resolve_model_args(cfg, tokenizer), cfg.lora
        template = _template(chat_template or cfg.data.chat_template, tokenizer, required=bool(chat_template))
        eos = {tokenizer.eos_id}
        if template is not None:  # a chat model's end-of-turn token ends a generation too
            turn_end = dict(template.variables).get("eos_token")
            turn_id = tokenizer.token_id(turn_end) if turn_end and hasattr(tokenizer, "token_id") else None
            eos |= {turn_id} if turn_id is not None else set()
        codec = Codec(tokenizer, template, prefix=(tokenizer.eos_id,))
        eos_ids = tuple(sorted(eos))
    else:
        if kind == "import":
            config = _read_json(os.path.join(folder, HF_CONFIG_COPY))
            args = llama_args_from_hf_config(config, FIELD, folder)
            generation = _read_json(os.path.join(folder, HF_GENERATION_COPY))
            tok_folder = os.path.join(folder, TOKENIZER_COPY)
        else:
            config = _read_json(os.path.join(folder, CONFIG))
            args = llama_args_from_hf(folder, FIELD)
            generation = _read_json(os.path.join(folder, GENERATION_CONFIG))
            tok_folder = folder
        tokenizer = (
            build_tokenizer(tok_folder) if os.path.isfile(os.path.join(tok_folder, TOKENIZER_JSON)) else None
        )
        template = (
            _template(chat_template or "", tokenizer, required=bool(chat_template)) if tokenizer else None
        )
        codec = Codec(tokenizer, template, add_special_tokens=True) if tokenizer else None
        eos_ids = hf_eos_ids(config, generation, tokenizer)
    args = generation_kernels(args, dev, compile, tp_mesh is not None)
    model = _build(args, folder, kind, lora, dev, torch_dtype, tp_mesh, load_hf_weights)
    return Loaded(model, codec, eos_ids, os.path.abspath(path), kind)


def _build(args, folder, kind, lora, dev, dtype, tp_mesh, load_hf_weights):
    from loom.models.registry import build_model

    with torch.device("meta"):
        model = build_model(args)
    with warnings.catch_warnings():  # "no process group: loading in a single process" is the intent
        warnings.simplefilter("ignore", UserWarning)
        if kind == "run" and lora is not None and lora.rank:
            if tp_mesh is not None:
                raise ConfigError(
                    FIELD,
                    folder,
                    "a LoRA run's checkpoint under tensor parallelism: export it merged "
                    "first (loom convert --from CKPT --to-hf OUT) and generate from OUT",
                )
            from loom.checkpoint.manager import load_model_only
            from loom.models.common.lora import apply_lora, merge_lora

            model = model.to_empty(device="cpu")
            apply_lora(model, lora)
            load_model_only(folder, model)
            merge_lora(model)
            model = model.to(device=dev, dtype=dtype)
        else:
            if tp_mesh is not None:
                from loom.infer.tp import apply_inference_tp

                apply_inference_tp(model, tp_mesh)
            if kind == "run":
                from loom.checkpoint.manager import load_model_weights, verify

                verify(folder)
                model = model.to_empty(
                    device=dev
                )  # DCP reads the fp32 checkpoint into fp32 tensors, then cast
                load_model_weights(folder, model)
                model = model.to(dtype)
            else:
                model = model.to(dtype).to_empty(device=dev)
                load_hf_weights(model, folder)
    model.init_buffers(dev)  # the RoPE table in fp32 (a cast would round the angles)
    return model.eval()

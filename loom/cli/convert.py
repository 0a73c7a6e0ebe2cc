"""``loom convert``: import a Hugging Face folder (Llama, Mistral, Qwen2/3, Mixtral) as a loom checkpoint, or export
one back.

Both directions run in one process without a process group and hold the model once in CPU memory.
"""

from __future__ import annotations

import os
import re
import warnings

from loom.config.errors import ConfigError
from loom.config.paths import check_folder_writable

USAGE = """usage:
  loom convert --from-hf HF_FOLDER --to CKPT_FOLDER
  loom convert --from CKPT_FOLDER --to-hf OUT_FOLDER [--config RUN.toml] [--flavor NAME]
               [--max-shard-size 5GB] [--section.field VALUE ...]
  loom convert --from CKPT_FOLDER --to-peft OUT_FOLDER [--config RUN.toml] [--section.field VALUE ...]

--from-hf   a Hugging Face folder (config.json + safetensors, sharded or not) of one of the families
            {families};
            written as a complete loom checkpoint (weights only, step 0) at --to, with the folder's
            tokenizer files in CKPT_FOLDER/tokenizer. Train from it with
            loom train --model.init_from CKPT_FOLDER [--data.tokenizer CKPT_FOLDER/tokenizer].
--from      a loom checkpoint folder (step_N with COMPLETE.json). Its model shape and tokenizer come
            from the config.toml saved in it (the tokenizer copy in its run dir, wherever that moved) or
            --config, with --flavor / --section.field overrides, e.g. --data.tokenizer when the run's
            tokenizer is gone. Written to --to-hf as safetensors of the family that holds the model (the
            list above; sharded with an index above --max-shard-size), with config.json,
            generation_config.json and the tokenizer files (the chat template the run trained with, the
            byte tokenizer's built-in one included): a folder transformers loads as it is.
            A LoRA run's checkpoint (lora.rank > 0) is written merged: each adapted weight W + scaling B A.
            A reward model's (training.objective reward) as LlamaForSequenceClassification (num_labels 1,
            score.weight).
--to-peft   a LoRA run's adapters alone, in PEFT's format (adapter_config.json, adapter_model.safetensors):
            peft.PeftModel.from_pretrained(base, OUT_FOLDER) loads them onto the base model's folder."""


def usage() -> str:
    """USAGE with the architectures the registered families read and write (loom.models.registry.hf_architectures:
    one source for the help and the code)."""
    import textwrap

    from loom.models.registry import hf_architectures

    listed = textwrap.fill(", ".join(hf_architectures()), 100, subsequent_indent=" " * 12)
    return USAGE.format(families=listed)


_OPTIONS = ("--from-hf", "--to", "--from", "--to-hf", "--to-peft", "--config", "--flavor", "--max-shard-size")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def split_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Pull out convert's own options (``--opt value`` or ``--opt=value``); the rest are config overrides."""
    opts: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name not in _OPTIONS:
            rest.append(argv[i])
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(name, None, "missing value after the option", show_value=False)
            value, i = argv[i + 1], i + 1
        if name in opts:
            raise ConfigError(name, value, "given twice")
        opts[name] = value
        i += 1
    return opts, rest


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a byte count -> bytes (decimal units, as Hugging Face's max_shard_size)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise ConfigError(
            "--max-shard-size", text, "expected a size such as 5GB, 500MB, 2GiB or a byte count"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def run_import(opts: dict[str, str], rest: list[str]) -> int:
    from loom.checkpoint.hf.dcp_import import import_hf_to_dcp

    _reject(opts, rest, allowed=("--from-hf", "--to"), direction="--from-hf")
    if "--to" not in opts:
        raise ConfigError("--to", None, "missing: the loom checkpoint folder to write", show_value=False)
    if not os.path.exists(opts["--to"]):  # an existing one is refused by the import, naming it
        check_folder_writable("--to", opts["--to"])
    args = import_hf_to_dcp(opts["--from-hf"], opts["--to"])
    print(
        f"loom convert: imported {opts['--from-hf']} ({args.n_layers} layers, dim {args.dim}, "
        f"vocab {args.vocab_size}) as loom checkpoint {opts['--to']}",
        flush=True,
    )
    return 0


def _reject(opts: dict[str, str], rest: list[str], allowed: tuple[str, ...], direction: str) -> None:
    """Options of the other direction are mistakes, not silently ignored."""
    for name in opts:
        if name not in allowed:
            raise ConfigError(name, opts[name], f"not used with {direction} (see `loom convert --help`)")
    if rest:
        raise ConfigError(
            rest[0], None, f"unknown option with {direction} (see `loom convert --help`)", show_value=False
        )


def run_config(ckpt: str, config_file: str | None, overrides: dict[str, str]):
    """The config of the run that wrote ``ckpt``, with the user's overrides; resume is irrelevant here. The
    checkpoint's own config.toml has its recorded paths found where the files are now (the run's tokenizer copy in
    its run dir, wherever that moved: loom.train.run_dir); a --config file is read as written."""
    from loom.config import build_config
    from loom.config.load import read_toml
    from loom.train.run_dir import missing_tokenizer, recorded_values

    fixed = {"checkpoint.resume": "none", **overrides}
    if config_file:
        return build_config(config_file, fixed)
    path = os.path.join(ckpt, "config.toml")
    if not os.path.isfile(path):
        if not overrides:
            raise ConfigError("--from", ckpt, "has no config.toml; pass --config RUN.toml or --flavor NAME")
        return build_config(None, fixed)
    raw = read_toml(path)
    if "data.tokenizer" not in overrides:
        missing = missing_tokenizer(
            ckpt, raw, "pass --data.tokenizer PATH (the run's tokenizer.json or its folder)"
        )
        if missing is not None:
            raise missing
    return build_config(None, {**recorded_values(ckpt, raw), **fixed})


def checkpoint_model_args(ckpt: str, config_file: str | None, overrides: dict[str, str]):
    """(LlamaArgs, ExportTokenizer) of a checkpoint: the Hugging Face config and tokenizer an import kept, else
    the run's config resolved as the trainer does (flavor or init_from, vocabulary from the tokenizer, tying) and
    the run's tokenizer. ``max_seq_len`` becomes the exported max_position_embeddings: the flavor's / source
    model's, or the run's seq_len."""
    import json

    from loom.checkpoint.hf.config import HF_CONFIG_COPY, llama_args_from_hf_config
    from loom.checkpoint.hf.reader import llama_args_from_hf
    from loom.checkpoint.hf.tokenizer import imported_tokenizer_export, tokenizer_export
    from loom.data import build_tokenizer
    from loom.models.registry import all_flavors
    from loom.resolve import resolve_model_args

    kept = os.path.join(ckpt, HF_CONFIG_COPY)
    if os.path.isfile(kept) and not config_file and not overrides:
        with open(kept) as fh:
            return llama_args_from_hf_config(json.load(fh), "--from", kept), imported_tokenizer_export(ckpt)
    cfg = run_config(ckpt, config_file, overrides)
    args = resolve_model_args(cfg, build_tokenizer(cfg.data.tokenizer))
    base = llama_args_from_hf(cfg.model.init_from) if cfg.model.init_from else all_flavors()[cfg.model.flavor]
    args = args.with_(max_seq_len=max(base.max_seq_len, cfg.training.seq_len))
    return args, tokenizer_export(cfg.data.tokenizer, args.max_seq_len, run_chat_template(cfg))


def run_chat_template(cfg) -> str | None:
    """The text of the run's own chat template file (data.chat_template), None where it uses the tokenizer's (the
    built-in one for the byte tokenizer); a recorded file that is gone is said in one line and left out."""
    path = cfg.data.chat_template
    if not path:
        return None
    if not os.path.isfile(path):
        print(
            f"loom convert: warning: the run's data.chat_template {path} is gone: the export carries the "
            "tokenizer's own chat template",
            flush=True,
        )
        return None
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def checkpoint_lora(ckpt: str, config_file: str | None, overrides: dict[str, str]):
    """The [lora] section of the run that wrote ``ckpt`` (none for an imported checkpoint)."""
    from loom.checkpoint.hf.config import HF_CONFIG_COPY
    from loom.config.sections import LoraConfig

    if os.path.isfile(os.path.join(ckpt, HF_CONFIG_COPY)) and not config_file and not overrides:
        return LoraConfig()
    return run_config(ckpt, config_file, overrides).lora


def checkpoint_is_reward(ckpt: str, config_file: str | None, overrides: dict[str, str]) -> bool:
    """Whether the run that wrote ``ckpt`` trained a reward model (training.objective reward: a score head)."""
    from loom.checkpoint.hf.config import HF_CONFIG_COPY

    if os.path.isfile(os.path.join(ckpt, HF_CONFIG_COPY)) and not config_file and not overrides:
        return False
    return run_config(ckpt, config_file, overrides).training.objective == "reward"


def run_export(opts: dict[str, str], rest: list[str]) -> int:
    from loom.checkpoint.hf.dcp_import import weights_only_model
    from loom.checkpoint.hf.export import DEFAULT_MAX_SHARD_BYTES, check_empty_target, export_hf
    from loom.checkpoint.hf.reader import check_checkpoint_shapes
    from loom.checkpoint.hf.tokenizer import export_file_names
    from loom.checkpoint.manager import load_model_only, verify
    from loom.config import parse_overrides
    from loom.models.common.lora import apply_lora, merge_lora
    from loom.models.registry import hf_adapter

    _reject(
        opts,
        [],
        allowed=("--from", "--to-hf", "--config", "--flavor", "--max-shard-size"),
        direction="--to-hf",
    )
    if "--from" not in opts:
        raise ConfigError("--from", None, "missing: the loom checkpoint folder to export", show_value=False)
    ckpt = opts["--from"]
    if not os.path.isdir(ckpt):
        raise ConfigError("--from", ckpt, "folder not found (expected a loom checkpoint folder step_N)")
    max_bytes = (
        parse_size(opts["--max-shard-size"]) if "--max-shard-size" in opts else DEFAULT_MAX_SHARD_BYTES
    )
    out = os.path.realpath(opts["--to-hf"])
    inside = out == os.path.realpath(ckpt) or out.startswith(os.path.realpath(ckpt) + os.sep)
    if inside and os.path.isfile(os.path.join(ckpt, "COMPLETE.json")):
        raise ConfigError(
            "--to-hf",
            opts["--to-hf"],
            f"is inside the checkpoint it reads ({ckpt}): files added "
            "there would break its recorded hashes; choose a folder outside it",
        )
    check_folder_writable("--to-hf", opts["--to-hf"])  # before the model is loaded
    check_empty_target(opts["--to-hf"])  # a model there (a previous export): named as such
    entries = sorted(os.listdir(opts["--to-hf"])) if os.path.isdir(opts["--to-hf"]) else []
    if entries:  # files of the user's own (`--to-hf .`) would sit among the model's, or be overwritten
        raise ConfigError(
            "--to-hf",
            opts["--to-hf"],
            f"is not empty ({len(entries)} entr{'ies' if len(entries) > 1 else 'y'}, e.g. {entries[0]!r}); "
            "choose a new or empty folder (as --to-peft)",
        )
    overrides = parse_overrides(rest)
    if "--flavor" in opts:  # a flavor names the shape; a recorded init_from would take precedence over it
        overrides.update({"model.flavor": opts["--flavor"], "model.init_from": ""})
    verify(ckpt, check_hash=False)  # cheap: a complete folder; load_model_only checks the hashes
    args, tokenizer = checkpoint_model_args(ckpt, opts.get("--config"), overrides)
    check_empty_target(opts["--to-hf"], export_file_names(tokenizer))
    model = weights_only_model(args)
    merged = apply_lora(model, checkpoint_lora(ckpt, opts.get("--config"), overrides))
    reward = checkpoint_is_reward(ckpt, opts.get("--config"), overrides)
    if reward:  # the score head in place of the LM head (loom.infer.reward)
        from loom.infer.reward import attach_score_head

        attach_score_head(model)
    check_checkpoint_shapes(
        ckpt, model, "--from", hint="; pass the run's --config / --flavor / --data.tokenizer"
    )
    with warnings.catch_warnings():  # "no process group: loading in a single process" is the intent
        warnings.simplefilter("ignore", UserWarning)
        load_model_only(ckpt, model)
    merge_lora(model)
    files = export_hf(model.state_dict(), args, opts["--to-hf"], max_bytes, tokenizer)
    # the architecture the folder's config names (Llama, Mixtral, DeepseekV3, Qwen3Moe, ...)
    kind = hf_adapter(args).architecture_of(args).removesuffix("ForCausalLM") + (
        " reward model (SequenceClassification)" if reward else ""
    )
    with_tokenizer = ", the tokenizer" if "tokenizer.json" in tokenizer.files else ""
    adapters = f", {merged} LoRA adapters merged" if merged else ""
    print(
        f"loom convert: exported {ckpt} as a Hugging Face {kind} folder {opts['--to-hf']} "
        f"({len(files)} safetensors file{'s' if len(files) > 1 else ''}{with_tokenizer}, generation_config.json"
        f"{adapters})",
        flush=True,
    )
    return 0


def run_export_peft(opts: dict[str, str], rest: list[str]) -> int:
    """A LoRA run's checkpoint -> its adapters as a PEFT adapter folder."""
    from loom.checkpoint.hf.dcp_import import weights_only_model
    from loom.checkpoint.hf.reader import check_checkpoint_shapes
    from loom.checkpoint.manager import load_model_only, verify
    from loom.checkpoint.peft import export_peft
    from loom.config import parse_overrides
    from loom.models.common.lora import apply_lora

    _reject(opts, [], allowed=("--from", "--to-peft", "--config"), direction="--to-peft")
    ckpt, out = opts.get("--from"), opts["--to-peft"]
    if not ckpt:
        raise ConfigError(
            "--from", None, "missing: the loom checkpoint folder of a LoRA run", show_value=False
        )
    if not os.path.isdir(ckpt):
        raise ConfigError("--from", ckpt, "folder not found (expected a loom checkpoint folder step_N)")
    check_folder_writable("--to-peft", out)
    overrides = parse_overrides(rest)
    verify(ckpt, check_hash=False)
    lora = checkpoint_lora(ckpt, opts.get("--config"), overrides)
    if not lora.rank:
        raise ConfigError(
            "--from",
            ckpt,
            "was not written by a LoRA run (lora.rank 0): nothing to write as a PEFT "
            "adapter; export the model with --to-hf",
        )
    if checkpoint_is_reward(ckpt, opts.get("--config"), overrides):
        raise ConfigError(
            "--from",
            ckpt,
            "is a reward model's (training.objective reward): its score head is not an "
            "adapter; export it merged with --to-hf",
        )
    args, _ = checkpoint_model_args(ckpt, opts.get("--config"), overrides)
    model = weights_only_model(args)
    apply_lora(model, lora)
    check_checkpoint_shapes(ckpt, model, "--from", hint="; pass the run's --config / --data.tokenizer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        load_model_only(ckpt, model)
    base = run_config(ckpt, opts.get("--config"), overrides).model.init_from
    export_peft(model.state_dict(), lora, out, base_model=base, args=args)
    print(
        f"loom convert: exported the LoRA adapters of {ckpt} (r {lora.rank}, {lora.targets}) as a PEFT adapter "
        f"{out}",
        flush=True,
    )
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    opts, rest = split_args(argv)
    if "--from-hf" in opts:
        return run_import(opts, rest)
    if "--to-hf" in opts:
        return run_export(opts, rest)
    if "--to-peft" in opts:
        return run_export_peft(opts, rest)
    raise ConfigError(
        "loom convert",
        " ".join(argv),
        "expected --from-hf HF --to CKPT, --from CKPT --to-hf HF or "
        "--from CKPT --to-peft ADAPTER (see `loom convert --help`)",
    )

"""Importing a Hugging Face folder as a complete loom checkpoint (DCP, model weights only, step 0), with the
source's config.json, generation config and tokenizer kept inside for a later export."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import torch

from loom.checkpoint.hf.config import (
    CONFIG,
    GENERATION_CONFIG,
    HF_CONFIG_COPY,
    HF_GENERATION_COPY,
    TOKENIZER_COPY,
    is_loom_checkpoint,
    read_hf_config,
)
from loom.checkpoint.hf.export import _free, write_json
from loom.checkpoint.hf.reader import llama_args_from_hf, load_hf_weights
from loom.checkpoint.manager import STATE, _disk_full, write_marker
from loom.config.errors import ConfigError, UserError
from loom.data.tokenizers import TOKENIZER_JSON, tokenizer_files
from loom.models.llama.flavors import LlamaArgs
from loom.models.registry import build_model, hf_adapter


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
    lines = [
        "[model]",
        f"init_from = {json.dumps(here)}",
        f"vocab_size = {args.vocab_size}",
        f"tie_embeddings = {json.dumps('true' if args.tie_embeddings else 'false')}",
        "",
    ]
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

    if is_loom_checkpoint(
        hf_folder
    ):  # an import's copy of config.json would be read, then config.json missed
        raise ConfigError(
            field,
            hf_folder,
            "is a loom checkpoint already, not a Hugging Face folder: train from it as it is "
            "(--model.init_from), or write a Hugging Face folder of it with `loom convert --from ... --to-hf`",
        )
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
        write_json(
            os.path.join(tmp, STATE),
            {"step": 0, "model_only": True, "imported_from": os.path.abspath(hf_folder)},
        )
        kept = hf_adapter(args).imported_config(read_hf_config(hf_folder, field), args)
        if kept is None:
            shutil.copyfile(os.path.join(hf_folder, CONFIG), os.path.join(tmp, HF_CONFIG_COPY))
        else:
            write_json(os.path.join(tmp, HF_CONFIG_COPY), kept)
        has_tokenizer = _copy_hf_companions(hf_folder, tmp)
        with open(os.path.join(tmp, "config.toml"), "w") as fh:
            fh.write(_imported_config_toml(out_folder, args, has_tokenizer))
        write_marker(tmp, 0)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(err):  # DCP wraps it in a CheckpointException
            need = sum(t.numel() * t.element_size() for t in model.state_dict().values())
            raise UserError(
                f"{out_folder}: writing the loom checkpoint failed (no space left on the device); it needs "
                f"about {need:,} bytes, {_free(parent):,} are free; nothing partial was kept"
            ) from None
        raise
    os.replace(tmp, out_folder)
    return args

"""The model an evaluation scores: a loom checkpoint or a Hugging Face folder loaded as a plain Llama in one process,
or the live model of a training run (``EvalModel.__init__``)."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from loom.config.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class EvalModel:
    """A model ready for scoring, with what scoring needs to know about it.

    ``max_length``: the longest input it is fed (tokens); longer inputs are cut from the left (rolling windows for
    perplexity). ``prefix_id``: the token that stands before a text with no context (a document's first token, an
    empty harness context). ``autocast``: a context manager factory the forwards run under (a training run's
    mixed precision); a loaded model runs in its own dtype without one. ``width_multiple``: batches are padded to a
    sequence length that divides by it (a tensor-parallel model with sequence parallelism splits the sequence over
    its ranks)."""

    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    max_length: int
    prefix_id: int
    name: str = ""
    autocast: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    width_multiple: int = 1

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id


def pick_device(device: str) -> torch.device:
    """``auto``: CUDA where there is a GPU, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device", device, "no CUDA device here; allowed: auto | cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a GPU, float32 on the CPU."""
    if dtype not in DTYPES:
        raise ConfigError("--dtype", dtype, f"allowed: {' | '.join(DTYPES)}")
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def _plain_kernels(args):
    """The model with PyTorch's attention and unfused layers: the same math as any kernel choice, and no
    dependence on the device the checkpoint was trained on."""
    return args.with_(attention="sdpa", fused_norm=False, fused_rope=False, fused_swiglu=False, fused_loss=False)


def _materialize(args):
    """An uninitialized Llama of ``args`` on the CPU, ready to be filled (its RoPE table is built on its device)."""
    from loom.models.llama import Llama

    with torch.device("meta"):
        model = Llama(args)
    return model.to_empty(device="cpu")


def _run_checkpoint(path: str):
    """(LlamaArgs, tokenizer, LoRA section) of a training run's checkpoint, from the config.toml saved in it (its
    tokenizer found where the run's copy is now); the model's inputs are as long as the run trained on."""
    from loom.config import build_config
    from loom.config.load import read_toml
    from loom.data import build_tokenizer
    from loom.resolve import resolve_model_args
    from loom.train.run_dir import missing_tokenizer, recorded_values

    toml = os.path.join(path, "config.toml")
    if not os.path.isfile(toml):
        raise ConfigError("checkpoint", path, "a loom checkpoint without its config.toml: the model's shape is unknown")
    raw = read_toml(toml)
    missing = missing_tokenizer(path, raw, "the run's tokenizer is needed to evaluate its checkpoint")
    if missing is not None:
        raise missing
    cfg = build_config(None, {**recorded_values(path, raw), "checkpoint.resume": "none"})
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    return resolve_model_args(cfg, tokenizer), tokenizer, cfg.lora


def _hf_tokenizer(folder: str, what: str):
    from loom.data import build_tokenizer
    from loom.data.tokenizers import TOKENIZER_JSON

    if not os.path.isfile(os.path.join(folder, TOKENIZER_JSON)):
        raise ConfigError("checkpoint", what, f"no {TOKENIZER_JSON} beside the weights: evaluation needs the "
                          "model's tokenizer")
    return build_tokenizer(folder)


def load(path: str, *, device: str = "auto", dtype: str = "auto", max_length: int = 0) -> EvalModel:
    """A loom checkpoint (a run's ``step_N`` or an import of ``loom convert --from-hf``) or a Hugging Face
    Llama-family folder, loaded for evaluation in this process.

    ``max_length`` 0: a run's training.seq_len (the longest input it has seen), else the folder's
    max_position_embeddings. The prefix token is EOS for a run's checkpoint (loom trains on documents separated by
    EOS, so EOS is what stands before a document), else BOS where the tokenizer has one, else EOS (as lm-eval's
    Hugging Face backend)."""
    from loom.checkpoint.hf import HF_CONFIG_COPY, TOKENIZER_COPY, is_loom_checkpoint, llama_args_from_hf, \
        llama_args_from_hf_config, load_hf_weights
    from loom.checkpoint.manager import load_model_only
    from loom.models.common.lora import apply_lora, merge_lora

    if not os.path.isdir(path):
        raise ConfigError("checkpoint", path, "folder not found (expected a loom checkpoint or a Hugging Face folder)")
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    run = is_loom_checkpoint(path) and not os.path.isfile(os.path.join(path, HF_CONFIG_COPY))
    lora = None
    if run:
        args, tokenizer, lora = _run_checkpoint(path)
    elif is_loom_checkpoint(path):  # an import: the source's shape and tokenizer, kept inside it
        with open(os.path.join(path, HF_CONFIG_COPY)) as fh:
            args = llama_args_from_hf_config(json.load(fh), "checkpoint", path)
        tokenizer = _hf_tokenizer(os.path.join(path, TOKENIZER_COPY), path)
    else:
        args = llama_args_from_hf(path, "checkpoint")
        tokenizer = _hf_tokenizer(path, path)
    length = max_length or args.max_seq_len
    model = _materialize(_plain_kernels(args).with_(max_seq_len=length))
    with warnings.catch_warnings():  # "no process group: loading in a single process" is the intent
        warnings.simplefilter("ignore", UserWarning)
        if run:
            apply_lora(model, lora)
            load_model_only(path, model)
            merge_lora(model)
        else:
            load_hf_weights(model, path)
    model = model.to(device=dev, dtype=torch_dtype).eval()
    model.init_buffers(dev)  # the RoPE table stays float32 (a cast would round the angles)
    bos = getattr(tokenizer, "bos_id", None)
    prefix = tokenizer.eos_id if run or bos is None else bos
    return EvalModel(model, tokenizer, dev, length, prefix, name=os.path.abspath(path))

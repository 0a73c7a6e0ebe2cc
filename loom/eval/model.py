"""The model an evaluation scores: a loom checkpoint or a Hugging Face folder loaded in one process (``load``), or
the live model of a training run (an ``EvalModel`` built around it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loom.config.errors import ConfigError


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
    eos_ids: tuple[int, ...] = ()  # the ids that end a generation; () = the tokenizer's EOS

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.eos_ids or (self.tokenizer.eos_id,)


def load(path: str, *, device: str = "auto", dtype: str = "auto", max_length: int = 0) -> EvalModel:
    """A loom checkpoint (a run's ``step_N`` or its run dir, an import of ``loom convert --from-hf``) or a Hugging Face
    Llama-family folder, loaded as loom's generation engine loads it (``loom.infer.load``: the model in ``dtype`` on
    ``device``, its tokenizer, the ids that end a generation), for evaluation in this process.

    ``max_length`` 0: a run's training.seq_len (the longest input it has seen), else the folder's
    max_position_embeddings. The prefix token is EOS for a run's checkpoint (loom trains on documents separated by
    EOS, so EOS is what stands before a document), else BOS where the tokenizer has one, else EOS (as lm-eval's
    Hugging Face backend)."""
    from loom.infer.load import load as load_model

    loaded = load_model(path, device=device, dtype=dtype, compile=False)
    if loaded.codec is None:
        raise ConfigError(
            "model", path, "no tokenizer.json beside the weights: evaluation needs the model's tokenizer"
        )
    model, tokenizer = loaded.model, loaded.codec.tokenizer
    dev = next(model.parameters()).device
    length = max_length or model.args.max_seq_len
    if (
        length > model.args.max_seq_len
    ):  # a RoPE table for a billion positions would be built first (a "hang")
        raise ConfigError(
            "--max-length",
            length,
            f"at most {model.args.max_seq_len:,}: the model's context (max_position_embeddings or training.seq_len)",
        )
    if length != model.args.max_seq_len:  # the RoPE table as long as the longest input
        model.args = model.args.with_(max_seq_len=length)
        model.init_buffers(dev)
    bos = getattr(tokenizer, "bos_id", None)
    prefix = tokenizer.eos_id if loaded.kind == "run" or bos is None else bos
    return EvalModel(model, tokenizer, dev, length, prefix, name=loaded.name, eos_ids=loaded.eos_ids)

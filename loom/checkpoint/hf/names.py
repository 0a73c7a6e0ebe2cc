"""loom tensor names <-> Hugging Face ones, through the model family's adapter (loom.models.registry)."""

from __future__ import annotations

import torch

from loom.models.common.init import canonical_name
from loom.models.llama.flavors import LlamaArgs
from loom.models.llama.hf import TOP, LlamaHF
from loom.models.registry import build_model, hf_adapter


def _adapter(args: LlamaArgs | None) -> LlamaHF:
    """The adapter of a model with ``args`` (None: the Llama families')."""
    return LlamaHF() if args is None else hf_adapter(args)


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
    if name in TOP:
        return TOP[name]
    adapter = _adapter(args)
    layer_names = adapter.block_names()
    part = _block_leaf(name)
    if part is not None and part[1] in layer_names:
        return f"model.layers.{part[0]}.{layer_names[part[1]]}"
    found = adapter.hf_name(name)
    if found is None:
        raise KeyError(f"no Hugging Face name for loom parameter {name!r}")
    return found


def stacked_experts(name: str, args: LlamaArgs | None = None) -> bool:
    """Whether loom parameter ``name`` is a stacked expert weight (one Hugging Face tensor per expert)."""
    part = _block_leaf(canonical_name(name))
    return part is not None and part[1] in _adapter(args).expert_templates()


def hf_expert_names(name: str, n_experts: int, args: LlamaArgs | None = None) -> list[str]:
    """Stacked loom expert weight -> the Hugging Face tensor of each expert, in expert order."""
    index, leaf = _block_leaf(canonical_name(name))
    template = _adapter(args).expert_templates()[leaf]
    return [f"model.layers.{index}.{template.format(j=j)}" for j in range(n_experts)]


def ignorable(name: str) -> bool:
    """Tensors some Llama folders carry that are derived, not learned (old transformers saved inv_freq)."""
    return name.endswith("rotary_emb.inv_freq")


def expected_loom_names(args: LlamaArgs) -> list[str]:
    """Every weight of a model with these args, in its family's export order (the adapter's, else the model's state
    names, persistent buffers included); the head only when untied."""
    names = hf_adapter(args).state_names(args)
    if names is not None:
        return names
    with torch.device("meta"):
        names = list(build_model(args.with_(max_seq_len=1)).state_dict())
    return [n for n in names if not (n == "output.weight" and args.tie_embeddings)]

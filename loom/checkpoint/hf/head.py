"""A reward model's score head (loom.methods.reward): ``output`` of width 1 in place of the LM head, stored as the
family's ``*ForSequenceClassification`` with ``score.weight``. Whether a model has it is read from its tensors."""

from __future__ import annotations

import torch

from loom.models.llama.flavors import LlamaArgs
from loom.models.llama.hf import SCORE_SUFFIX

SCORE_WEIGHT = "score.weight"  # its head (num_labels 1, no bias): loom's ``output.weight`` of shape (1, dim)


def is_score_config(cfg: dict) -> bool:
    """Whether a parsed config.json is a reward model's: a ``*ForSequenceClassification`` with one label."""
    labels = cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)
    return any(a.endswith(SCORE_SUFFIX) for a in cfg.get("architectures") or []) and int(labels) == 1


def _is_score(output_rows: int, args: LlamaArgs) -> bool:
    return output_rows == 1 and args.vocab_size != 1


def has_score_head(model: torch.nn.Module) -> bool:
    """Whether a loom model carries a reward model's score head in place of its LM head."""
    output = getattr(model, "output", None)
    return output is not None and _is_score(output.weight.shape[0], model.args)


def state_has_score_head(state: dict[str, torch.Tensor], args: LlamaArgs) -> bool:
    """``has_score_head`` of a (canonically named) state dict."""
    return "output.weight" in state and _is_score(state["output.weight"].shape[0], args)


def score_config(config: dict) -> dict:
    """A causal LM's config.json as its ``*ForSequenceClassification`` with one label (the score head has no tie
    to the embeddings)."""
    head = {
        "architectures": [config["architectures"][0].removesuffix("ForCausalLM") + SCORE_SUFFIX],
        "num_labels": 1,
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
        "tie_word_embeddings": False,
    }
    return {**config, **head}

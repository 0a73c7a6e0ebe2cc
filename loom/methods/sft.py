"""Supervised fine-tuning (``training.objective sft``): language modeling on conversations rendered with the chat
template, whose tokens outside the assistant's turns are labelled IGNORE (loom.data.chat); the count of labelled
tokens is the count of assistant targets, so a step's loss is their mean over the global batch whatever the
layout. Its run is the loop."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.methods.base import Method, chat_template_exists
from loom.train.objective import LanguageModeling


def objective(cfg) -> LanguageModeling:
    return LanguageModeling(data="sft")


def rules(cfg) -> None:
    """SFT packs conversations into windows, so it keeps attention within each (data.document_positions defaults to
    true under sft; false is refused)."""
    if cfg.data.embedded_rejected != "auto":
        raise ConfigError(
            "data.embedded_rejected",
            cfg.data.embedded_rejected,
            "applies to the embedded preference "
            "pairs only (training.objective dpo or reward without data.source): leave it 'auto'",
        )
    chat_template_exists(cfg)
    if not cfg.data.document_positions:
        raise ConfigError(
            "data.document_positions",
            False,
            "training.objective sft packs conversations and keeps attention within each: allowed true",
        )


METHOD = Method("sft", LanguageModeling, objective, rules=rules)

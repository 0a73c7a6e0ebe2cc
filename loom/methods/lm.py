"""Language modeling (``training.objective lm``): next-token cross-entropy over packed text; its run is the loop."""

from __future__ import annotations

from loom.methods.base import Method, plain_text_rules
from loom.train.objective import LanguageModeling


def objective(cfg) -> LanguageModeling:
    """Next-token loss over every labelled token of the packed windows (fused into the model's forward where the
    model computes it: ``configure``)."""
    return LanguageModeling(data="lm")


METHOD = Method("lm", LanguageModeling, objective, rules=plain_text_rules)

"""The method registry: each ``training.objective`` name, the module of its method and the config sections it
reads. A method's module may declare sections of its own (``SECTIONS = {name: dataclass}``); the config reads them
from the module this table names (``loom.config.sections.all_sections``), so a new method is its module plus one
line here (docs/extending.md)."""

from __future__ import annotations

# name -> (its module, the config sections it reads); a method's sections stay at their defaults under the others
METHODS = {
    "lm": ("loom.methods.lm", ()),
    "sft": ("loom.methods.sft", ()),
    "dpo": ("loom.methods.dpo", ("dpo",)),
    "reward": ("loom.methods.reward", ("reward",)),
    "grpo": ("loom.methods.grpo", ("grpo",)),
    "ppo": ("loom.methods.ppo", ("grpo", "ppo")),
    "kto": ("loom.methods.kto", ("kto",)),
    "orpo": ("loom.methods.orpo", ("orpo",)),
    "simpo": ("loom.methods.simpo", ("simpo",)),
    "distill": ("loom.methods.distill", ("distill",)),
    "rloo": ("loom.methods.rloo", ("grpo", "rloo")),
    "online_dpo": ("loom.methods.online_dpo", ("grpo", "online_dpo")),
}

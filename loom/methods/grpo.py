"""GRPO (``training.objective grpo``): group-relative policy optimization on rollouts sampled by loom's inference
engine on the live policy (loom.rl.rollout), its loss a pure function (loom.rl.grpo), its objective
loom.rl.objective.GroupRelative; its rules (loom.methods.rollouts)."""

from __future__ import annotations

from loom.methods.base import Method
from loom.methods.rollouts import rollout_rules
from loom.rl.objective import GroupRelative

METHOD = Method("grpo", GroupRelative, GroupRelative, rules=rollout_rules)

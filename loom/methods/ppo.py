"""PPO (``training.objective ppo``): a value function on the policy and GAE over rollouts sampled as GRPO's are
(loom.rl.ppo_objective), its losses pure functions (loom.rl.ppo); its rules (loom.methods.rollouts and below)."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.methods.base import Method
from loom.methods.rollouts import grpo_loss_unused, rollout_rules
from loom.rl.ppo_objective import ProximalPolicy


def rules(cfg) -> None:
    """The rollouts' rules and GRPO's loss fields unset; the critic and KL choices that do not combine."""
    grpo_loss_unused(cfg)
    rollout_rules(cfg)
    if cfg.ppo.critic == "model" and cfg.lora.base_dtype == "nf4":
        raise ConfigError("ppo.critic", "model", "not with lora.base_dtype nf4 (the critic copies the base weights): "
                          "allowed head")
    if cfg.ppo.kl_penalty == "loss" and cfg.ppo.kl_estimator != "k1":
        raise ConfigError("ppo.kl_estimator", cfg.ppo.kl_estimator, "applies to the KL in the rewards: with "
                          "ppo.kl_penalty loss the loss term is k3 (leave the estimator at k1)")


METHOD = Method("ppo", ProximalPolicy, ProximalPolicy, rules=rules)

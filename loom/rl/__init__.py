"""Reinforcement learning from rewards: GRPO (``training.objective grpo``) with rollouts from loom's own engine on
the policy's live weights. ``grpo`` the math, ``rewards`` reward functions, ``arithmetic`` the embedded task,
``rollout`` the rollouts' pieces that GRPO's driver calls (loom.methods.grpo), ``ppo`` and ``ppo_objective`` PPO's
math, value function and rollouts. docs/rl.md."""

"""Reinforcement learning from rewards: GRPO (``training.objective grpo``) with rollouts from loom's own engine on
the policy's live weights. ``grpo`` the math, ``rewards`` reward functions, ``arithmetic`` the embedded task,
``rollout`` the rollout loader, ``objective`` the objective the trainer runs. docs/rl.md."""

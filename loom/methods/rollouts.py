"""The rules GRPO and PPO share: their rollouts (the [grpo] section's sampling, rewards and warm-up) come from
loom's inference engine on the live policy (loom.rl.sync), which generates on a whole model or on tensor-parallel
shards, at shapes of their own, from one policy."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.sections import Config, GrpoConfig
from loom.methods.base import ROLLOUTS_NOTE, PlanExtras, plain_text_rules

GRPO_LOSS_FIELDS = ("epsilon", "epsilon_high", "beta", "iterations", "loss_type", "scale_rewards")


def rollout_rules(cfg: Config) -> None:
    """The layouts and features the rollouts cannot run with yet: pipeline stages and context / expert parallelism
    (the engine runs on the whole model or its tensor-parallel shards), the logits fused away, torchft's replica
    groups, DiLoCo, host offload, CUDA graphs beyond ``graph_rules`` (docs/rl.md); the [grpo] section's own
    cross-field rules; the embedding split by rows (its rollouts' widths differ between ranks)."""
    plain_text_rules(cfg)
    g, p, t, objective = cfg.grpo, cfg.parallel, cfg.training, cfg.training.objective
    if p.fault_tolerance:
        raise ConfigError(
            "training.objective",
            objective,
            "not with parallel.fault_tolerance (its rollouts are not split over replica groups)",
        )
    if p.diloco_inner_steps:
        raise ConfigError(
            "parallel.diloco_inner_steps",
            p.diloco_inner_steps,
            f"not with training.objective = {objective} (its rollouts read one policy)",
        )
    if p.fsdp_embedding == "vocab":
        raise ConfigError(
            "parallel.fsdp_embedding",
            "vocab",
            f"not with training.objective {objective}: its micro-batches differ in width between ranks (each pads "
            "its rollouts to its own longest), and the split's collectives need equal token counts: allowed auto | "
            "gather",
        )
    if t.cuda_graphs:
        graph_rules(cfg)
    if cfg.data.document_positions:
        raise ConfigError(
            "data.document_positions",
            True,
            f"not with training.objective {objective} (each rollout is one sequence, positions from 0): allowed false",
        )
    if p.cpu_offload:
        raise ConfigError(
            "parallel.cpu_offload",
            True,
            f"not with training.objective {objective} (its engine "
            "generates on each rank's whole module): allowed false",
        )
    for key, value in (("parallel.pp", p.pp), ("parallel.cp", p.cp), ("parallel.ep", p.ep)):
        if value > 1:
            raise ConfigError(
                key,
                value,
                f"not supported with training.objective {objective} yet (the engine runs "
                "on the whole model or its tensor-parallel shards): allowed 1",
            )
    if cfg.model.fused_loss == "true":
        raise ConfigError(
            "model.fused_loss",
            True,
            f"training.objective {objective} needs the logits (per-token "
            "log-probabilities): allowed auto | false",
        )
    if g.warmup_steps > 0 and g.prompts:
        raise ConfigError(
            "grpo.warmup_steps",
            g.warmup_steps,
            "0 or -1 with grpo.prompts (the warm-up trains on the embedded task's worked examples)",
        )
    if g.warmup_steps >= t.steps:
        raise ConfigError("grpo.warmup_steps", g.warmup_steps, f"< training.steps ({t.steps})")
    if any(o not in "+*" for o in g.ops) or not g.ops:
        raise ConfigError("grpo.ops", g.ops, "operators from '+' and '*'")
    if g.max_staleness:
        async_rules(cfg)
    if g.judge and not g.judge_template.strip():
        raise ConfigError(
            "grpo.judge_template",
            "",
            "a template with {prompt} and {completion} for grpo.judge (text, or a file holding it)",
        )


# rollout methods whose training steps may replay CUDA graphs (training.cuda_graphs)
GRAPHED_OBJECTIVES = ("grpo", "ppo")


def graph_rules(cfg: Config) -> None:
    """training.cuda_graphs with rollouts (the layout's rules are loom.parallel.cuda_graphs_rules'): their rows
    are padded to a few fixed widths (loom.rl.rollout.bucket_width), the training step's shapes, and the engine
    generates through compiles of the blocks of its own, without graphs (loom.parallel.compile.graph_free); GRPO's
    and PPO's steps are the ones measured and tested so; not with asynchronous GRPO, whose sampler thread would run
    its engine while the trainer's graphs replay or record."""
    objective = cfg.training.objective
    if objective not in GRAPHED_OBJECTIVES:
        raise ConfigError(
            "training.cuda_graphs",
            True,
            f"not with training.objective {objective} yet (graph replay of rollout training is tested for "
            f"{' and '.join(GRAPHED_OBJECTIVES)} only): allowed false",
        )
    if cfg.grpo.max_staleness:
        raise ConfigError(
            "training.cuda_graphs",
            True,
            f"not with grpo.max_staleness {cfg.grpo.max_staleness} (the sampler's thread runs its engine while "
            "the training step's graphs replay): allowed with grpo.max_staleness 0",
        )


def async_rules(cfg: Config) -> None:
    """Asynchronous GRPO (grpo.max_staleness > 0; loom.rl.async_sampler): GRPO's alone; one update per batch of
    rollouts (its importance weights are against the step's own policy); not under TP (the sampler's thread would
    run the engine's collectives beside the trainer's) nor with a rollback (the batches in flight would not be
    rolled back with the weights)."""
    g, objective = cfg.grpo, cfg.training.objective
    for key, value, bad, allowed in (
        ("training.objective", objective, objective != "grpo", "grpo"),
        ("grpo.iterations", g.iterations, g.iterations != 1, "1"),
        ("parallel.tp", cfg.parallel.tp, cfg.parallel.tp > 1, "1"),
        ("training.nonfinite", cfg.training.nonfinite, cfg.training.nonfinite == "rollback", "stop | skip"),
    ):
        if bad:
            raise ConfigError(key, value, f"not with grpo.max_staleness {g.max_staleness}: allowed {allowed}")
    if g.sampler_device:
        import torch

        try:
            torch.device(g.sampler_device)
        except RuntimeError:
            raise ConfigError(
                "grpo.sampler_device", g.sampler_device, "a device such as cuda:1, or '' (the rank's own)"
            ) from None


def grpo_loss_unused(cfg: Config) -> None:
    """PPO samples with the [grpo] rollout fields; GRPO's loss fields would do nothing."""
    for key in GRPO_LOSS_FIELDS:
        if getattr(cfg.grpo, key) != getattr(GrpoConfig(), key):
            raise ConfigError(
                f"grpo.{key}",
                getattr(cfg.grpo, key),
                "GRPO's loss: not used by training.objective ppo (its [ppo] section has its own)",
            )


def step_through(loop, batches) -> list[dict]:
    """A driver's steps: ``batches()`` (this step's micro-batches) and the engine's step, around each the loop's
    cadence (loom.train.loop.Running), until the run ends or a stop request saved a step; the records."""
    with loop.running(consume=batches) as run:
        while run.next():
            with run.data_wait():
                mbs = batches()
            out = run.step(mbs)  # the engine's step
            if run.after(out, None):  # a stop request saved this step
                break
    return run.records


def reference_plan(cfg: Config) -> PlanExtras:
    """For the planner (GRPO's and RLOO's plan): the KL reference with grpo.beta > 0, a frozen copy of the policy
    (none under LoRA: adapters off); their generation is not in the estimate."""
    g = cfg.grpo
    frozen = int(g.beta > 0 and not cfg.lora.rank)
    note = ROLLOUTS_NOTE
    if g.max_staleness and g.sampler_device:
        note += f"; the asynchronous sampler's {g.sampler_device} (its snapshot and KV cache) is not planned"
    return PlanExtras(frozen=frozen, note=note, rollout_rows=cfg.training.global_batch_size)


def runner(drive):
    """A method's ``run``: the loop built for its objective, driven by ``drive``."""

    def run(cfg, objective, env=None, rules=()) -> list[dict]:
        from loom.train.loop import Loop  # the engine's build is heavy: imported when a run starts

        return drive(Loop(cfg, objective, env, rules))

    return run

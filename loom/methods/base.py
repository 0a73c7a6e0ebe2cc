"""What a training method is: one module (loom.methods.<name>) owning its objective, its data, its heads, its
cross-field rules and its run, described by a ``Method`` that the registry (loom.methods.METHODS) names."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loom.config.errors import ConfigError
from loom.config.sections import Config
from loom.runtime.env import DistEnv
from loom.train.objective import Objective


def no_rules(cfg: Config) -> None:
    """A method without rules of its own beyond the generic ones."""


def run_loop(
    cfg: Config,
    objective: Objective,
    env: DistEnv | None = None,
    rules: Sequence[Callable[[Config], None]] = (),
) -> list[dict]:
    """The loop around the engine for ``objective`` (``rules``: the method's, for the resolver): the records rank 0
    logged."""
    from loom.train.loop import Loop

    return Loop(cfg, objective, env, rules).fit()


def fit_loop(loop) -> list[dict]:
    """A built loop's own ``fit``: its loader's batches, step after step."""
    from loom.train.loop import Loop

    return Loop.fit(loop)


@dataclass(frozen=True)
class PlanExtras:
    """What a method holds beyond the policy, for the planner (loom.plan): ``frozen`` copies of the policy's shape
    (a reference, a teacher: their weights, and one forward each a step), None where it holds a model of another
    shape the planner does not know; ``trained`` more models of the policy's shape trained beside it (PPO's critic
    model: their state, activations and compute); ``note``: what of the method the estimate leaves out;
    ``rollout_rows``: a rollout method's completions a step (the inference engine's KV cache and weights)."""

    frozen: int | None = 0
    trained: int = 0
    note: str = ""
    rollout_rows: int = (
        0  # completions a step generates over all ranks (each rank decodes its share together)
    )


def no_extras(cfg: Config) -> PlanExtras:
    """A method that trains the policy alone."""
    return PlanExtras()


ROLLOUTS_NOTE = (
    "the rollouts' decode time is not in this estimate (it times the training step); their generation's memory "
    "(the engine's KV cache for seq_len positions, its weight copy) is"
)


@dataclass(frozen=True)
class Method:
    """``objective(cfg)``: what a step minimizes, with the data it reads and the heads it trains (its class:
    ``objective_class``, whose ``console`` / ``panels`` the logger and `loom report` show); ``rules(cfg)``: the
    method's cross-field rules, which the resolver is handed (loom.methods.rules_of); ``run(cfg, objective, env,
    rules)``: the whole job, returning rank 0's records; ``drive(loop)``: what runs a built loop's steps (the
    loop's ``fit``, or an RL driver), which ``Trainer(cfg).fit()`` calls too; ``plan(cfg)``: the models it holds
    beyond the policy, for the planner."""

    name: str
    objective_class: type
    objective: Callable[[Config], Objective]
    rules: Callable[[Config], None] = no_rules
    run: Callable[..., list[dict]] = run_loop
    drive: Callable[..., list[dict]] = fit_loop
    plan: Callable[[Config], PlanExtras] = no_extras  # what the planner counts beyond the policy


def chat_template_exists(cfg: Config) -> None:
    """data.chat_template names a file, or '' (the tokenizer folder's)."""
    d = cfg.data
    if d.chat_template and not os.path.isfile(d.chat_template):
        raise ConfigError(
            "data.chat_template",
            d.chat_template,
            "no such file (a Jinja chat template; '' = the tokenizer folder's)",
        )


def plain_text_rules(cfg: Config) -> None:
    """A method that reads neither conversations nor preference pairs: the SFT and pair fields of [data] mean
    nothing to it (a run that sets them has most likely forgotten the objective)."""
    d = cfg.data
    if d.chat_template:
        raise ConfigError(
            "data.chat_template", d.chat_template, "used by training.objective sft, dpo and reward only"
        )
    if d.loss_tokens != "assistant":
        raise ConfigError(
            "data.loss_tokens",
            d.loss_tokens,
            "used by training.objective sft only (dpo trains on the completions)",
        )
    if d.embedded_rejected != "auto":
        raise ConfigError(
            "data.embedded_rejected",
            d.embedded_rejected,
            "applies to the embedded preference pairs "
            "only (training.objective dpo or reward without data.source): leave it 'auto'",
        )


def pair_rules(cfg: Config) -> None:
    """A method that reads preference pairs (dpo, reward), rendered with the chat template."""
    d = cfg.data
    if d.embedded_rejected != "auto" and d.source:
        raise ConfigError(
            "data.embedded_rejected",
            d.embedded_rejected,
            "applies to the embedded preference pairs "
            "only (training.objective dpo or reward without data.source): leave it 'auto'",
        )
    if d.loss_tokens != "assistant":
        raise ConfigError(
            "data.loss_tokens",
            d.loss_tokens,
            "used by training.objective sft only (dpo trains on the completions)",
        )
    chat_template_exists(cfg)

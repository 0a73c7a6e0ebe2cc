"""``training.objective ppo``'s value function and rollouts: PPO with a value head on the policy, on rollouts from
loom's engine (GRPO's prompts, sampling, rewards and warm-up: loom.rl.rollout), the math in loom.rl.ppo, the
objective and the driver that calls these pieces in loom.methods.ppo.

A batch of rollouts is ``ppo.mini_batches x training.global_batch_size`` completions. Each rank samples and scores
its share and computes, with no-grad forwards, the rollout-time log-probabilities and values (and the reference's
log-probabilities); then the batch is gathered on every rank, and per-token rewards, GAE, returns and whitening are
computed over the whole global batch, the same on every rank. The batch then feeds ``ppo.epochs x
ppo.mini_batches`` optimizer steps: each pass draws a permutation of the global batch from (seed, rollout, pass),
each step takes the next ``global_batch_size`` rows of it and each rank its slice of those. So the minimized
loss, the whitening and the shuffle are the same whatever the data-parallel layout.

The value function (ppo.critic) is attached to the policy before parallelization, so the optimizer, DDP and
checkpoints treat it as any parameter: 'head' = the reward model's ``dim -> 1`` head (loom.infer.reward.score_head)
on the final norm's output, computed by a forward hook on the norm; 'model' = a separate model of the policy's
shape with that head, run on the same tokens by a forward hook on the policy. Either runs inside the policy's
forward, and only when asked (``forward_with_values``): the engine's generation forwards skip it. Under tensor
parallelism the TP plan splits the critic like the policy, and either head runs on this rank's sequence shard of
the hidden states with its weight whole, its values gathered whole on every rank (loom.parallel.tensor_parallel:
``score_head_style``); the engine runs on the policy's shards alone (loom.rl.sync)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loom.infer.reward import attach_score_head, score_head
from loom.numerics import IGNORE
from loom.rl.ppo import gae, kl_estimate, token_rewards, whiten
from loom.rl.rollout import (
    HELD,
    RolloutBatch,
    Rollouts,
    reference_logps,
    rows_to_batches,
    set_reference,
    token_logps,
)

# ---- the value function ------------------------------------------------------------------------------------------


class ValueCapture:
    """Whether the next forward should compute values (``capture``), and the values it computed (B, S) fp32."""

    def __init__(self):
        self.capture, self.values = False, None


def attach_value_head(model: nn.Module) -> nn.Module:
    """ppo.critic head: ``model.value_head``, a trainable ``dim -> 1`` linear read from the final norm's output
    (B, S, E). Call on the plain model (meta device or not) before parallelizing it; under LoRA after ``apply_lora``
    (the head trains)."""
    head = model.value_head = score_head(model)
    state = model.ppo_values = ValueCapture()

    def store(norm, args, hidden):
        if state.capture:
            state.values = head(hidden).squeeze(-1).float()  # (B, S)

    model.norm.register_forward_hook(store)
    return model


def attach_critic(model: nn.Module) -> nn.Module:
    """ppo.critic model: ``model.critic``, a second model of the policy's shape with the reward model's score head
    in place of its LM head, run on the same tokens inside the policy's forward (a forward hook), so DDP, the
    optimizer and checkpoints hold it with the policy. It is trained in full (under LoRA too); PPO copies the
    policy's weights into its trunk as PPO starts (``copy_trunk``)."""
    from loom.models.registry import build_model

    with torch.device(model.tok_embeddings.weight.device):
        critic = model.critic = attach_score_head(build_model(model.args))
    state = model.ppo_values = ValueCapture()
    init_policy_buffers = model.init_buffers

    def init_buffers(device) -> None:  # materializing the policy materializes the critic's RoPE table too
        init_policy_buffers(device)
        critic.init_buffers(device)

    def store(policy, args, logits):
        if state.capture:
            state.values = critic(*args).squeeze(-1).float()  # (B, S)

    model.init_buffers = init_buffers
    model.register_forward_hook(store)
    return model


@torch.no_grad()
def copy_trunk(policy: nn.Module, critic: nn.Module) -> None:
    """The policy's weights into the critic wherever a name and shape match (all but the head; under LoRA the base,
    not the adapters)."""
    from loom.models.common.init import canonical_name

    mine = {
        canonical_name(n): p
        for n, p in policy.named_parameters()
        if not canonical_name(n).startswith("critic.")
    }
    for name, p in critic.named_parameters():
        src = mine.get(canonical_name(name))
        if src is not None and src.shape == p.shape and name != "output.weight":
            p.copy_(src)


def plain(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (or the model)."""
    return getattr(model, "module", model)


def forward_with_values(
    model: nn.Module, inputs: torch.Tensor, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (B, S, V), values (B, S) fp32) of one forward of ``model`` (DDP-wrapped or not)."""
    state = plain(model).ppo_values
    state.capture = True
    try:
        logits = model(inputs, positions)
        values = state.values
    finally:
        state.capture, state.values = False, None
    return logits, values


# ---- rollouts ---------------------------------------------------------------------------------------------------


@dataclass
class PpoBatch(RolloutBatch):
    """A micro-batch of PPO's rollouts: beside the completion tokens (``labels``), per token the rollout-time
    log-probabilities (``old_logps``), values (``old_values``), the advantages (``advantages``, (B, S)), returns,
    and (ppo.kl_penalty loss) the reference's log-probabilities (``ref_token_logps``)."""

    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None


class PpoRollouts(Rollouts):
    """This rank's share of PPO's rollouts: the pieces PPO's driver (loom.methods.ppo.drive) calls each step: the
    warm-up's worked examples, then a global batch of rollouts (``prompts``, ``sample``, ``score``, ``to_rows``,
    ``forwards``, ``gather``, ``gae_advantages``, ``hold_batch``, ``set_ppo_stats``) reused for ppo.epochs x
    ppo.mini_batches steps (``mini_batch``; see the module's docstring)."""

    def __init__(self, cfg, tokenizer, dp_rank: int, dp_size: int):
        super().__init__(cfg, tokenizer, dp_rank, dp_size)
        self.p = cfg.ppo
        self.plan: list[tuple[int, int]] = []  # (pass, mini-batch) steps left on the held rollouts
        self.held: dict[str, torch.Tensor] = {}  # the global batch of rollouts
        self.rollout_key = 0  # the step that sampled the held rollouts (seeds their shuffles)

    def describe(self, global_batch: int, steps: int) -> list[str]:
        p, g = self.p, self.g
        return [
            f"data: ppo rollouts from {self.source.describe()}: {p.mini_batches} x {global_batch} completions "
            f"({g.group_size} per prompt, up to {g.max_new_tokens} new tokens, temperature {g.temperature}) per "
            f"batch of rollouts, {p.epochs} x {p.mini_batches} steps on each; rewards "
            + self.describe_rewards()
            + (f"; first {self.warmup} step(s): supervised warm-up on worked examples" if self.warmup else "")
        ]

    def state_dict(self) -> dict:
        return {"grpo_step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.plan, self.held = int(state.get("grpo_step", 0)), [], {}

    def bind(self, engine, objective) -> None:
        self.engine, self.objective = engine, objective
        self.generator = self.engine_generator(engine, self.rows * self.p.mini_batches)
        if self.p.kl_coef > 0 and not self.cfg.lora.rank:
            # a frozen policy without the value head; its weights are copied in as PPO starts (``set_reference``)
            self.reference, self._reference_set = engine.frozen_copy(copy_weights=False), False
        self.load_reward_model(engine)

    # ---- one batch of rollouts ------------------------------------------------------------------------------------
    def prompts(self) -> tuple[list[dict], list[list[int]]]:
        """This rank's rows of a batch of rollouts' prompts (ppo.mini_batches steps' worth) and their ids."""
        G = self.g.group_size
        rows = self.mine(
            self.source.problems(self.rows * self.p.mini_batches // G * self.dp_size, ("ppo", self.step))
        )
        return rows, self.prompt_ids(rows)

    def to_rows(self, prompts: list[list[int]], outs) -> tuple[RolloutBatch, torch.Tensor]:
        """(this rank's prompt + completion rows as one batch, which rows were cut at grpo.max_new_tokens (N,)
        bool); grpo.mask_truncated: those rows train on nothing."""
        (local,) = rows_to_batches(
            prompts,
            [o.token_ids for o in outs],
            len(prompts),
            self.pad_id,
            self.cfg.training.seq_len,
            self.cfg.parallel.tp,
            self.bucketed,
        )  # TP's sequence parallelism splits the width evenly; under training.cuda_graphs a fixed width
        truncated = torch.tensor([o.finish_reason == "length" for o in outs])
        if self.g.mask_truncated:
            local.labels[truncated] = IGNORE
        return local, truncated

    def hold_batch(self, glob: dict) -> None:
        """The global batch held for ppo.epochs x ppo.mini_batches steps, its shuffles seeded by this step."""
        p = self.p
        self.held, self.rollout_key = glob, self.step
        self.plan = [(e, m) for e in range(p.epochs) for m in range(p.mini_batches)]

    def reuse(self) -> None:
        """The held batch once more (nothing sampled, scored or synced)."""
        self.stats = {**self.stats, **HELD}

    @torch.no_grad()
    def forwards(self, local: RolloutBatch):
        """The rollout-time policy's log-probabilities and values (N, W), and the reference's log-probabilities
        (N, W; None without a KL), one no-grad forward each per micro-batch of rows."""
        g, p, engine = self.g, self.p, self.engine
        if p.kl_coef > 0 and self.reference is not None and not self._reference_set:
            set_reference(self)  # the policy as PPO starts (after the warm-up); on a resume, read back
            self._reference_set = True
        model = engine.parts[0]
        # PPO starts here (a resumed run keeps its critic)
        if p.critic == "model" and self.step == self.warmup + 1:
            copy_trunk(model, model.critic)
        model.eval()
        logps, values, refs = [], [], []
        try:
            for start in range(0, local.inputs.shape[0], self.micro):
                inputs = local.inputs[start : start + self.micro].to(engine.device)
                labels = local.labels[start : start + self.micro].to(engine.device)
                with engine.forward_context():
                    logits, v = forward_with_values(model, inputs)
                    logps.append(token_logps(logits, labels, g.temperature).cpu())
                    values.append(v.cpu())
                    if p.kl_coef > 0:
                        refs.append(reference_logps(model, self.reference, inputs, labels, g.temperature))
        finally:
            model.train()
        return torch.cat(logps), torch.cat(values), (torch.cat(refs) if refs else None)

    def gather(self, inputs, labels, old_logps, values, ref_logps, scores, per, truncated, lengths) -> dict:
        """Every rank's rows in rank order, on every rank (a sum over the data-parallel ranks of tensors that hold
        this rank's rows and zeros elsewhere), right-padded to the widest rank's width; fp32 / int64 on the CPU."""
        dims, device, n = self.engine.dims, self.engine.device, inputs.shape[0]
        widths = torch.zeros(self.dp_size, dtype=torch.float64)
        widths[self.dp_rank] = inputs.shape[1]
        width = int(dims.data_sum(widths.to(device)).max())

        def gather(t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
            shape = (n * self.dp_size, width) if t.dim() == 2 else (n * self.dp_size, *t.shape[1:])
            out = torch.zeros(shape, dtype=torch.float64)
            mine = out[self.dp_rank * n : (self.dp_rank + 1) * n]
            if t.dim() == 2:
                mine.fill_(fill)
                mine[:, : t.shape[1]] = t.double()
            else:
                mine.copy_(t.double())
            return dims.data_sum(out.to(device)).cpu()

        glob = {
            "inputs": gather(inputs, self.pad_id).long(),
            "labels": gather(labels, IGNORE).long(),
            "old_logps": gather(old_logps).float(),
            "old_values": gather(values).float(),
            "scores": gather(scores).float(),
            "per": gather(per).float(),
            "truncated": gather(truncated.float()),
            "lengths": gather(torch.tensor(lengths, dtype=torch.float64)),
        }
        if ref_logps is not None:
            glob["ref_logps"] = gather(ref_logps).float()
        return glob

    def gae_advantages(self, glob: dict) -> None:
        """Per-token rewards, GAE advantages and returns of the global batch (the same on every rank)."""
        p = self.p
        mask = (glob["labels"] != IGNORE).float()
        kl = None
        if "ref_logps" in glob:
            estimator = p.kl_estimator if p.kl_penalty == "reward" else "k3"
            glob["kl"] = kl_estimate(glob["old_logps"], glob["ref_logps"], estimator) * mask
            kl = glob["kl"] if p.kl_penalty == "reward" else None
        rewards = token_rewards(glob["scores"], mask, kl, p.kl_coef)
        if p.whiten_rewards:
            rewards = whiten(rewards, mask, shift_mean=False)
        advantages, returns = gae(rewards, glob["old_values"] * mask, mask, p.gamma, p.lam)
        if p.whiten_advantages:
            advantages = whiten(advantages, mask)
        glob.update(mask=mask, rewards=rewards, advantages=advantages, returns=returns)

    def mini_batch(self, epoch: int, index: int) -> list[PpoBatch]:
        """This rank's micro-batches of mini-batch ``index`` of pass ``epoch`` over the held rollouts."""
        h = self.held
        total, step_rows = h["inputs"].shape[0], self.rows * self.dp_size
        gen = torch.Generator().manual_seed(self.cfg.run.seed * 1_000_003 + self.rollout_key * 1009 + epoch)
        order = torch.randperm(total, generator=gen)[index * step_rows : (index + 1) * step_rows]
        mine = order[self.dp_rank * self.rows : (self.dp_rank + 1) * self.rows]
        width = h["inputs"].shape[1]
        out = []
        for start in range(0, len(mine), self.micro):
            rows = mine[start : start + self.micro]
            positions = torch.arange(width).expand(len(rows), width).contiguous()
            out.append(
                PpoBatch(
                    h["inputs"][rows],
                    h["labels"][rows],
                    positions,
                    torch.zeros_like(positions),
                    advantages=h["advantages"][rows],
                    old_logps=h["old_logps"][rows],
                    ref_token_logps=h["ref_logps"][rows]
                    if self.p.kl_penalty == "loss" and "ref_logps" in h
                    else None,
                    old_values=h["old_values"][rows],
                    returns=h["returns"][rows],
                )
            )
        return out

    def set_ppo_stats(self, h: dict, names: list[str], seconds) -> None:
        """The batch of rollouts' figures (global: every rank holds the whole batch)."""
        mask, n = h["mask"], float(h["scores"].shape[0])
        tokens = mask.sum().clamp(min=1)
        secs = self.engine.dims.data_sum(
            torch.tensor(seconds, dtype=torch.float64).to(self.engine.device)
        ).cpu()
        secs = secs / self.dp_size
        new_tokens = float(h["lengths"].sum())
        scores = h["scores"]
        self.stats = {
            "reward": float(scores.mean()),
            "reward_std": float(scores.std()) if n > 1 else 0.0,
            **{f"rewards/{name}": float(h["per"][:, k].mean()) for k, name in enumerate(names)},
            "completion_length": new_tokens / n,
            "truncated": float(h["truncated"].mean()),
            "ppo/values": float((h["old_values"] * mask).sum() / tokens),
            "ppo/returns": float((h["returns"] * mask).sum() / tokens),
            "ppo/token_reward": float((h["rewards"] * mask).sum() / tokens),
            **({"ppo/rollout_kl": float((h["kl"] * mask).sum() / tokens)} if "kl" in h else {}),
            "rollout_tokens_per_s": new_tokens / max(float(secs[0]), 1e-9),
            "time/generation_s": float(secs[0]),
            "time/scoring_s": float(secs[1]),
            "time/logps_s": float(secs[2]),
            **{
                f"rewards/{name}_std": float(h["per"][:, k].std()) if n > 1 else 0.0
                for k, name in enumerate(names)
            },
            **({"judge/unparsed": float(secs[5])} if self.judge is not None else {}),
            "time/weight_sync_s": float(secs[3]),
            "weight_sync_bytes": float(secs[4]),  # per rank
        }

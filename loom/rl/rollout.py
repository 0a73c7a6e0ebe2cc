"""Rollouts: what GRPO's driver (loom.methods.grpo.drive) samples and scores each step, the parts it does so with
(the generator on the policy's live weights, the reference, the reward functions, reward model and judge) and
the rollouts' state: prompts from the source, G completions each sampled by loom's engine on the policy's live
weights, rewards, group-normalized advantages, and (when needed) the log-probabilities of the rollout-time policy
and of the reference. Before GRPO, ``warmup_steps`` steps of worked examples (supervised).

Weights (loom.rl.sync): in one process and under DDP the engine runs on the trainer's own module
(``trainer.parts[0]``, the plain model inside any DDP wrapper; every rank's replica is whole and current after each
optimizer step): nothing to copy. Under FSDP2 it runs on a plain copy on each rank, refreshed from the shards
before each generation; under TP it runs tensor-parallel over the tp group on the trainer's own shards. The engine
installs its KV caches for a generation and removes them after, so training's forwards run the plain model. PP /
CP / EP are refused (loom.resolve; docs/rl.md)."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.config.errors import ConfigError, SharedError, UserError
from loom.data.loader import MicroBatch
from loom.models.common.lora import adapters_disabled
from loom.models.common.moe import count_tokens
from loom.numerics import IGNORE
from loom.parallel.tensor_parallel import to_local_loss
from loom.rl.arithmetic import ArithmeticTask
from loom.rl.grpo import group_advantages, loss_count
from loom.rl.judge import Judge
from loom.rl.prompts import PromptRows, conversational
from loom.rl.rewards import Rewards
from loom.train.objective import release_gathered

EMBEDDED_REWARDS = ("loom.rl.arithmetic:exact_answer", "loom.rl.arithmetic:digit_match")
EMBEDDED_WEIGHTS = (1.0, 0.5)
HELD = {
    "time/generation_s": 0.0,
    "time/scoring_s": 0.0,
    "time/logps_s": 0.0,
    "time/weight_sync_s": 0.0,
    "weight_sync_bytes": 0.0,
}  # the figures of a step on held rollouts: nothing sampled, scored or synced


@dataclass
class RolloutBatch(MicroBatch):
    """A micro-batch of completions: ``labels`` are the completion tokens (IGNORE elsewhere); per row its
    advantage (B,); per token the rollout-time policy's (None: the step's own, detached), the reference's
    (None: beta 0) and the sampler's (asynchronous GRPO's stale snapshot; None: the live policy sampled them)
    log-probabilities (B, S), aligned with ``labels``. ``warmup``: worked examples (cross-entropy)."""

    advantages: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    ref_token_logps: torch.Tensor | None = None
    sampler_logps: torch.Tensor | None = None
    warmup: bool = False


def reference_logps(
    model, reference, inputs: torch.Tensor, labels: torch.Tensor, temperature: float
) -> torch.Tensor:
    """The reference policy's log-probabilities of ``labels`` (on the host): a frozen copy where there is one, else
    ``model`` with its adapters disabled (LoRA)."""
    if reference is not None:
        logits = reference(inputs)
        release_gathered(reference)
    else:
        with adapters_disabled(model):
            logits = model(inputs)
    return token_logps(logits, labels, temperature).cpu()


def token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Each labelled token's log-probability under logits / temperature, fp32, 0 where IGNORE: logits (B, S, V)
    (vocab-sharded under TP's loss parallel, inside its context), labels (B, S) -> (B, S), a plain tensor."""
    b, s = labels.shape
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    nll = F.cross_entropy(scaled.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="none")
    return -to_local_loss(nll).view(b, s)


def row_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The tokens of each right-padded row, (B, S) bool: up to its last labelled position (its prompt and
    completion), not the padding after it, whose width depends on the batch's other rows and on the layout
    (``rows_to_batches`` rounds it up to a multiple of tp). labels (B, S) -> (B, S)."""
    cols = torch.arange(labels.shape[1], device=labels.device)  # (S,)
    last = torch.where(labels != IGNORE, cols, -1).amax(dim=1)  # (B,) -1: a row without labels counts nothing
    return cols <= last.unsqueeze(1)


def policy_forward(
    model, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None, call=None
):
    """``call(model, inputs, positions)`` (default: ``model(inputs, positions)``) for a training step on rollout
    rows: a mixture of experts' balance loss counts each row's own tokens only (``row_tokens``), so it is the same
    whatever the padding, and so the same under tensor parallelism as in one process."""
    args = getattr(getattr(model, "module", model), "args", None)  # inside a DDP wrapper: its module's
    if args is None or args.moe:  # a dense model counts nothing: no mask to build each step
        count_tokens(model, row_tokens(labels))
    return model(inputs, positions) if call is None else call(model, inputs, positions)


def bucket_width(width: int, seq_len: int) -> int:
    """The fixed width a batch of rows ``width`` wide is padded to under training.cuda_graphs: the next of 8, 12,
    16, 24, 32, 48, ... (powers of two and 1.5 x them: past 8, at most a third more tokens), at most ``seq_len``,
    so a run's training forwards take a handful of shapes, each captured once, whatever its rows' lengths."""
    bucket = 8
    while bucket < width:  # 8 -> 12 -> 16 -> 24 -> 32 -> 48 -> ...
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket * 4 // 3
    return max(width, min(bucket, seq_len))


def rows_to_batches(
    prompts: list[list[int]],
    completions: list[list[int]],
    micro: int,
    pad_id: int,
    seq_len: int,
    multiple: int = 1,
    bucketed: bool = False,
    **per_row,
) -> list[RolloutBatch]:
    """Rows prompt + completion as next-token inputs (B, S) and labels that are the completion's tokens only,
    right-padded to the longest row (``bucketed``: to its ``bucket_width``; rounded up to a multiple of
    ``multiple``: TP's sequence parallelism splits S evenly), cut into micro-batches of ``micro`` rows. The
    padding is masked (IGNORE labels after each row's end, causal attention), so the width changes no loss or
    gradient. ``per_row``: tensors (N, ...) cut the same way (advantages)."""
    full = [p + c for p, c in zip(prompts, completions)]
    need = -(-(max(len(f) for f in full) - 1) // multiple) * multiple
    if need > seq_len:
        raise ConfigError(
            "training.seq_len",
            seq_len,
            f"at least the longest prompt + completion ({need} tokens"
            + (f", a multiple of parallel.tp = {multiple}" if multiple > 1 else "")
            + ")",
        )
    width = max(need, bucket_width(need, seq_len) // multiple * multiple) if bucketed else need
    # one tensor each from padded lists (not a small tensor per row: 2N host allocations a step)
    inputs = torch.tensor([f[:-1] + [pad_id] * (width - len(f) + 1) for f in full], dtype=torch.long)
    labels = torch.tensor(
        [
            [IGNORE] * (len(p) - 1) + f[len(p) :] + [IGNORE] * (width - len(f) + 1)
            for f, p in zip(full, prompts)
        ],
        dtype=torch.long,
    )
    positions = torch.arange(width).expand(len(full), width).contiguous()
    out = []
    for start in range(0, len(full), micro):
        rows = slice(start, start + micro)
        out.append(
            RolloutBatch(
                inputs[rows],
                labels[rows],
                positions[rows],
                torch.zeros_like(positions[rows]),
                **{k: v[rows] for k, v in per_row.items()},
            )
        )
    return out


def std_of(total: float, squares: float, n: float) -> float:
    """The unbiased std of n values from their sum and sum of squares (0 for one value)."""
    return max((squares - total * total / n) / max(n - 1, 1.0), 0.0) ** 0.5


def warmup_steps(cfg) -> int:
    """grpo.warmup_steps resolved: -1 = half of training.steps on the embedded task, none with a prompts file."""
    g = cfg.grpo
    if g.warmup_steps >= 0:
        return g.warmup_steps
    return 0 if g.prompts else cfg.training.steps // 2


@contextlib.contextmanager
def kept_mode(model: torch.nn.Module):
    """``model``'s training mode as it was after the block. The engine puts the model it is given in eval mode;
    where that model is the policy itself (one process) the training steps before the first sampling (the
    warm-up) would then run in eval mode: without a mixture of experts' balance loss, unlike any sharded layout,
    whose engine runs its own module."""
    training = model.training
    try:
        yield model
    finally:
        model.train(training)


@torch.no_grad()
def copy_parameters(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """``src``'s parameters into ``dst``'s (the same model, built the same way), by canonical name."""
    from loom.models.common.init import canonical_name

    mine = {canonical_name(n): p for n, p in src.named_parameters()}
    for name, p in dst.named_parameters():
        p.copy_(mine[canonical_name(name)])


def check_policy_finite(engine, step: int) -> None:
    """Before sampling: weights that are not finite (an update with a huge learning rate) would make the sampler
    fail on NaN probabilities while the logged loss stays 0 (equal rewards give zero advantages). The run stops in
    one line, as the guard stops it (exit 1; the last complete checkpoint stays)."""
    from loom.config.errors import TrainingStopped

    if engine.env.any_rank(not engine.weights_finite()):
        raise TrainingStopped(
            f"step {step}: the policy's weights are not finite (the update before this step "
            "diverged; lower optimizer.lr): stopped before sampling, the last complete checkpoint "
            "stays"
        )


def sample_checked(sample, prompts, step: int):
    """``sample(prompts)``; logits that overflow to inf / NaN (exploding but finite weights) stop the run in one
    line instead of a traceback from the sampler."""
    from loom.config.errors import TrainingStopped

    try:
        return sample(prompts)
    except RuntimeError as err:
        if "probability tensor contains" in str(err):
            raise TrainingStopped(
                f"step {step}: the policy's sampling logits are not finite (its weights exploded; "
                "lower optimizer.lr): stopped, the last complete checkpoint stays"
            ) from None
        raise


REFERENCE_DIR = "rl_reference"  # <checkpoint dir>/rl_reference/<lineage>/: the KL reference a lineage took


def set_reference(rollouts) -> None:
    """The KL reference (grpo.beta / ppo.kl_coef > 0 without LoRA) the first time rollouts need it. At the first RL
    step (after the warm-up), the policy as it is then, saved under the run's checkpoint lineage
    (``<checkpoint dir>/rl_reference/<lineage>/``); on a run resumed past that step, that saved reference, so the
    resumed steps equal the uninterrupted run's (the resumed policy has moved away from it)."""
    from loom.checkpoint.manager import CorruptCheckpoint, load_model_weights, save_model_weights, verify

    engine = rollouts.engine
    ckpt = engine.checkpointer
    lineage = ckpt.lineage or "none"
    if rollouts.step <= rollouts.warmup + 1:
        copy_parameters(engine.parts[0], rollouts.reference)
        save_model_weights(
            rollouts.reference,
            os.path.join(ckpt.dir, REFERENCE_DIR, lineage),
            is_main=engine.env.is_main,
            barrier=engine.env.barrier,
            lineage=lineage,
        )
        return
    homes = [ckpt.dir] + ([os.path.dirname(ckpt.resumed_from)] if ckpt.resumed_from else [])
    candidates = [os.path.join(h, REFERENCE_DIR, lineage) for h in homes]

    def usable() -> str | None:
        for folder in candidates:
            try:
                verify(folder)
                return folder
            except CorruptCheckpoint:
                continue
        return None

    folder = engine.env.share_from_main(usable() if engine.env.is_main else None)
    if folder is not None:
        load_model_weights(folder, rollouts.reference)
        if engine.env.is_main:
            print(
                f"KL reference: restored from {folder} (taken at step {rollouts.warmup + 1} of this lineage)",
                flush=True,
            )
        return
    copy_parameters(engine.parts[0], rollouts.reference)
    if engine.env.is_main:
        print(
            f"KL reference: {candidates[0]} holds no complete reference of lineage {lineage} (a checkpoint from "
            "before references were kept): the resumed policy is the reference, so the KL term differs from the "
            "uninterrupted run's",
            flush=True,
        )


class Rollouts:
    """This rank's rollouts: the pieces GRPO's driver calls each step (``begin_step``, ``warmup_batches``,
    ``spent``, ``prompts``, ``sample``, ``score``, ``to_batches``, ``logps``, ``set_stats``, ``reuse``,
    ``end_step``), and what the loop keeps of them as the run's data (``describe``, ``validation``,
    ``state_dict``). ``bind(engine, objective)`` (the objective's ``prepare``) gives it the engine's model."""

    def __init__(self, cfg, tokenizer, dp_rank: int, dp_size: int):
        g, t = cfg.grpo, cfg.training
        if t.global_batch_size % (g.group_size * dp_size):
            raise ConfigError(
                "training.global_batch_size",
                t.global_batch_size,
                f"a multiple of grpo.group_size x data-parallel ranks ({g.group_size} x {dp_size}): "
                "every rank samples whole groups",
            )
        self.cfg, self.g, self.tokenizer = cfg, g, tokenizer
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.rows = t.global_batch_size // dp_size  # completions per step on this rank
        self.micro = t.micro_batch_size
        self.task = ArithmeticTask(cfg.run.seed, g.digits, g.ops) if not g.prompts else None
        self.source = self.task or PromptRows(g.prompts, cfg.run.seed)
        self.codec = None  # chat prompts' renderer (loom.infer.text.Codec), made on first use
        embedded = not g.rewards and not g.judge and not g.reward_model
        specs = [s.strip() for s in g.rewards.split(",") if s.strip()] or (
            list(EMBEDDED_REWARDS) if embedded else []
        )
        try:
            weights = [float(w) for w in g.reward_weights.split(",") if w.strip()]
        except ValueError:
            raise ConfigError(
                "grpo.reward_weights",
                g.reward_weights,
                "a comma list of numbers, one per reward function (e.g. 1,0.5)",
            ) from None
        if not weights and embedded:
            weights = list(EMBEDDED_WEIGHTS)
        self.judge = Judge(g) if g.judge else None
        extra = (("judge", self.judge, g.judge_weight),) if self.judge else ()
        self.rewards = Rewards(specs, weights, extra) if specs or extra else None
        self.reward_model = (
            None  # grpo.reward_model's scorer (loom.infer.reward.RewardScorer): loaded in bind
        )
        self.warmup = warmup_steps(cfg)
        self.pad_id = tokenizer.eos_id
        # training.cuda_graphs: the rows padded to a few fixed widths (``bucket_width``), each a shape the training
        # step's graphs are captured at once; otherwise to the longest row (the same losses and gradients)
        self.bucketed = t.cuda_graphs
        self.step = 0  # steps begun
        self.held: list[RolloutBatch] | None = None  # the last rollouts, reused grpo.iterations times
        self.uses = 0
        self.engine = self.objective = self.generator = self.weights = None
        self.reference = None  # beta > 0 without LoRA: a frozen copy of the policy as GRPO starts
        self._reference_set = False
        self.stats: dict[str, float] = {}
        self._handed_out: float | None = None  # when the last step's batches were handed to the engine
        self._trained: float | None = None  # the last step's training time

    # ---- what the loop keeps of them (the run's data) --------------------------------------------------------
    def describe(self, global_batch: int, steps: int) -> list[str]:
        """The startup line, naming the method whose rollouts these are (grpo, rloo, online_dpo)."""
        g = self.g
        return [
            f"data: {self.cfg.training.objective} rollouts from {self.source.describe()}: {global_batch // g.group_size} prompts x "
            f"{g.group_size} completions per step (up to {g.max_new_tokens} new tokens, temperature "
            f"{g.temperature}), {g.iterations} step(s) per batch of rollouts; rewards "
            + self.describe_rewards()
            + (f"; first {self.warmup} step(s): supervised warm-up on worked examples" if self.warmup else "")
        ]

    def describe_rewards(self) -> str:
        g = self.g
        return " + ".join(
            (
                [f"{float(w):g} x {n}" for w, n in zip(self.rewards.weights, self.rewards.names)]
                if self.rewards
                else []
            )
            + ([f"{g.reward_model_weight:g} x reward model {g.reward_model}"] if g.reward_model else [])
        )

    def validation(self, batches: int) -> list[MicroBatch]:
        return []

    def state_dict(self) -> dict:
        return {"grpo_step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.held, self.uses = int(state.get("grpo_step", 0)), None, 0

    def bind(self, engine, objective) -> None:
        """The live model: a generator on the engine's own module, under FSDP2 on its synced copy, under TP on the
        inference engine's tensor-parallel module over the training shards."""
        self.engine, self.objective = engine, objective
        self.generator = self.engine_generator(engine, self.rows)
        if self.g.beta > 0 and not self.cfg.lora.rank:  # built in the policy's layout before the engine runs
            self.reference, self._reference_set = engine.frozen_copy(), False
        self.load_reward_model(engine)

    def load_reward_model(self, engine) -> None:
        """grpo.reward_model on the engine's device, whole on every rank (it scores this rank's rollouts)."""
        if self.g.reward_model:
            from loom.infer.reward import load_reward_model

            try:
                self.reward_model = load_reward_model(self.g.reward_model, str(engine.device))
            except ConfigError as err:  # the loader names its own argument ("model", "score")
                raise ConfigError("grpo.reward_model", self.g.reward_model, err.allowed) from None

    def engine_generator(self, engine, max_batch: int):
        """A generator on the policy's weights as the inference engine sees them (loom.rl.sync); the judge, if any,
        is put on the training engine's device too."""
        from loom.infer.generator import Generator
        from loom.rl.sync import EngineWeights

        self.weights = EngineWeights.build(engine)
        if self.judge is not None:
            self.judge.device = str(engine.device)  # loaded there on first use
        # under TP every rank of the group continues with one token (the group's first rank's)
        with kept_mode(self.weights.model):
            return Generator.from_model(
                self.weights.model,
                self.tokenizer,
                compile=False,
                max_batch=max_batch,
                group=self.weights.group,
            )

    # ---- a step (loom.methods.grpo.drive) ----------------------------------------------------------------------
    def begin_step(self) -> int:
        """Count the next step (returned); the time since the last step's batches were handed out is its training."""
        now = time.perf_counter()
        self._trained = None if self._handed_out is None else now - self._handed_out
        self.step += 1
        return self.step

    def warmup_batches(self) -> list[RolloutBatch]:
        """The warm-up's batches (worked examples) with its figures."""
        batches = self.worked_examples()
        self.stats = {"grpo/warmup": 1.0}
        return batches

    def spent(self, uses: int) -> bool:
        """Whether the held rollouts are used up (``uses`` steps each, or none held): the step samples anew."""
        return self.held is None or self.uses >= uses

    def hold(self, batches: list[RolloutBatch]) -> list[RolloutBatch]:
        """New rollouts, this step their first use."""
        self.held, self.uses = batches, 1
        return batches

    def reuse(self) -> list[RolloutBatch]:
        """The held rollouts once more (nothing sampled, scored or synced)."""
        self.uses += 1
        self.stats = {**self.stats, **HELD}
        return self.held

    def end_step(self, batches: list[RolloutBatch]) -> list[RolloutBatch]:
        """The step's batches, handed to the engine now; the last step's training time joins the figures."""
        if self._trained is not None:
            self.stats["time/training_s"] = self._trained  # of the step before this one
        self._handed_out = time.perf_counter()
        return list(batches)

    # ---- batches --------------------------------------------------------------------------------------------
    def worked_examples(self) -> list[RolloutBatch]:
        """The embedded task's problems with their answers (and the EOS) as targets: the warm-up's batches."""
        if self.task is None:
            raise ConfigError(
                "grpo.warmup_steps",
                self.warmup,
                "0 with grpo.prompts (the warm-up trains on the embedded task's worked examples)",
            )
        rows = self.mine(self.task.problems(self.rows * self.dp_size, ("warmup", self.step)))
        enc = self.tokenizer.encode
        batches = rows_to_batches(
            [enc(r["prompt"]) for r in rows],
            [enc(r["answer"]) + [self.tokenizer.eos_id] for r in rows],
            self.micro,
            self.pad_id,
            self.cfg.training.seq_len,
            self.cfg.parallel.tp,
            self.bucketed,
        )
        for mb in batches:
            mb.warmup = True
        return batches

    def prompts(self, step: int | None = None) -> tuple[list[dict], list[list[int]]]:
        """This rank's rows of the step's (or ``step``'s) prompts and their ids, each repeated for its group
        (``prompt_ids``)."""
        step = self.step if step is None else step
        rows = self.mine(self.source.problems(self.rows // self.g.group_size * self.dp_size, ("grpo", step)))
        return rows, self.prompt_ids(rows)

    def sync(self) -> None:
        """The generator on the policy's current weights (a gather where FSDP2 shards; else nothing); weights that
        are not finite stop the run first."""
        check_policy_finite(self.engine, self.step)
        self.weights.sync()

    def sample(self, prompts: list[list[int]]) -> list:
        """One completion per prompt from the synced generator (``generate``); logits that are not finite stop
        the run in one line."""
        return sample_checked(self.generate, prompts, self.step)

    def advantages(self, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(group-relative advantages (N,), the global (sum, sum of squares, count) of the rewards, their std):
        the sums over every data-parallel rank (grpo.scale_rewards batch divides by the global std)."""
        g, dims, device = self.g, self.engine.dims, self.engine.device
        sums = dims.data_sum(
            torch.stack([total.sum(), (total**2).sum(), torch.tensor(float(len(total)))]).to(device).double()
        ).cpu()
        mean = sums[0] / sums[2]
        std = ((sums[1] - sums[2] * mean**2) / (sums[2] - 1).clamp(min=1)).clamp(min=0).sqrt()
        batch_std = std.float() if g.scale_rewards == "batch" else None
        return group_advantages(total, g.group_size, g.scale_rewards, batch_std), sums, std

    def to_batches(
        self, prompts: list[list[int]], outs, advantages: torch.Tensor
    ) -> tuple[list[RolloutBatch], torch.Tensor]:
        """(this rank's micro-batches of prompt + completion rows with their advantages, which rows were cut at
        grpo.max_new_tokens (N,) bool); grpo.mask_truncated: those rows train on nothing."""
        truncated = torch.tensor([o.finish_reason == "length" for o in outs])
        batches = rows_to_batches(
            [p[:] for p in prompts],
            [o.token_ids for o in outs],
            self.micro,
            self.pad_id,
            self.cfg.training.seq_len,
            self.cfg.parallel.tp,
            self.bucketed,
            advantages=advantages,
        )
        if self.g.mask_truncated:
            for i, mb in enumerate(batches):
                cut = truncated[i * self.micro : (i + 1) * self.micro]
                mb.labels[cut] = IGNORE
        return batches, truncated

    def prompt_ids(self, rows: list[dict]) -> list[list[int]]:
        """Each row's prompt ids, repeated for its group: a string tokenized as it is, a list of messages rendered
        with the chat template (data.chat_template; the tokenizer folder's or the built-in one) and its generation
        prompt, its special tokens as their ids (as ``apply_chat_template`` tokenizes)."""
        out = []
        for r in rows:
            if conversational(r["prompt"]):
                if self.codec is None:
                    from loom.data.chat import load_template
                    from loom.infer.text import Codec

                    self.codec = Codec(
                        self.tokenizer, load_template(self.cfg.data.chat_template, self.tokenizer)
                    )
                ids = self.codec.encode(r["prompt"])
            else:
                ids = self.tokenizer.encode(r["prompt"])
            out += [ids] * self.g.group_size
        return [list(p) for p in out]

    def score(
        self, rows: list[dict], prompts: list[list[int]], outs
    ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """(total (N,), each source's rewards (N, K), their names) of this rank's completions: the weighted reward
        functions (and judge), plus grpo.reward_model_weight x the reward model's score of prompt + completion.
        Conversational rows give the functions the prompt's messages and the completion as one assistant message
        (TRL's convention)."""
        G, n = self.g.group_size, len(outs)
        total, per, names = torch.zeros(n), torch.zeros(n, 0), []
        if self.rewards is not None:
            fields = {k: [r.get(k) for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
            texts = [r["prompt"] for r in rows for _ in range(G)]
            answers = [
                [{"role": "assistant", "content": o.text}] if conversational(p) else o.text
                for p, o in zip(texts, outs)
            ]
            error = None
            try:
                total, per = self.rewards.score(texts, answers, [o.token_ids for o in outs], fields)
            except UserError as err:  # a function that raised or returned what is not a reward
                error = str(err)
            error = self.engine.env.first_error(error) if self.engine is not None else error
            if error is not None:  # every rank stops; rank 0 prints it (each rank scores its own completions)
                raise SharedError(error)
            names = list(self.rewards.names)
        if self.reward_model is not None:
            model = torch.tensor(self.reward_model([pr + o.token_ids for pr, o in zip(prompts, outs)]))
            total = total + self.g.reward_model_weight * model
            per, names = torch.cat([per, model[:, None]], dim=1), names + ["reward_model"]
        return total, per, names

    def mine(self, rows: list) -> list:
        """This rank's share of the global step's rows (the global batch is the same whatever the layout)."""
        n = len(rows) // self.dp_size
        return rows[self.dp_rank * n : (self.dp_rank + 1) * n]

    def generate(
        self, prompts: list[list[int]], step: int | None = None, generator=None, weights=None
    ) -> list:
        """One completion (``loom.infer.Completion``) per prompt id list, from the engine on the live weights (or
        ``generator`` on ``weights``), seeded by the step (or ``step``)."""
        g, engine = self.g, self.engine
        generator, weights = generator or self.generator, weights or self.weights
        params = self.sampling_params(self.step if step is None else step)
        model = weights.model
        model.eval()
        try:
            with torch.no_grad(), engine.autocast():
                return generator.generate_ids(prompts, params)
        finally:
            engine = generator.engine  # the caches out: training forwards run the plain model
            engine.park() if g.keep_cache else engine.release()
            if not weights.copied:
                model.train()

    def sampling_params(self, step: int):
        """The sampling of ``step``'s completions on this rank, its seed the run's, the step's and the rank's."""
        from loom.infer.sampling import SamplingParams

        g = self.g
        return SamplingParams(
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            seed=(self.cfg.run.seed * 1_000_003 + step) * 1009 + self.dp_rank,
        )

    @torch.no_grad()
    def logps(self, batches: list[RolloutBatch]) -> None:
        """The rollout-time policy's token log-probabilities (grpo.iterations > 1: later steps' ratios are against
        them) and the reference's (beta > 0), one no-grad forward each per micro-batch."""
        g, engine = self.g, self.engine
        if g.iterations == 1 and g.beta == 0:
            return
        if g.beta > 0 and not self.cfg.lora.rank and not self._reference_set:
            # the policy as GRPO starts (after the warm-up), frozen; a resumed run reads it back from its lineage
            set_reference(self)
            self._reference_set = True
        model = engine.parts[0]
        model.eval()
        try:
            for mb in batches:
                inputs = mb.inputs.to(engine.device)
                labels = mb.labels.to(engine.device)
                with engine.forward_context():
                    if g.iterations > 1:
                        mb.old_logps = token_logps(model(inputs), labels, g.temperature).cpu()
                    if g.beta > 0:
                        mb.ref_token_logps = reference_logps(
                            model, self.reference, inputs, labels, g.temperature
                        )
        finally:
            model.train()

    def set_stats(self, batches, total, per, names, sums, std, truncated, outs, seconds) -> None:
        """The step's rollout figures over every data-parallel rank; the objective's normalizing counts."""
        g, dims, device = self.g, self.engine.dims, self.engine.device
        mask_tokens = sum(float((mb.labels != IGNORE).sum()) for mb in batches)
        count = sum(float(loss_count(mb.labels != IGNORE, g.loss_type, g.max_new_tokens)) for mb in batches)
        new_tokens = float(sum(len(o.token_ids) for o in outs))
        local = torch.tensor(
            [
                mask_tokens,
                count,
                new_tokens,
                float(truncated.sum()),
                *seconds,
                float(self.weights.bytes),
                self.judge.unparsed if self.judge is not None else 0.0,
                *per.sum(0).tolist(),
                *(per.double() ** 2).sum(0).tolist(),
            ],
            dtype=torch.float64,
        )
        glob = dims.data_sum(local.to(device)).cpu()
        n, k = float(sums[2]), len(names)
        self.objective.global_tokens, self.objective.global_count = float(glob[0]), float(glob[1])
        gen_s = float(glob[4]) / self.dp_size  # each rank's generation time, averaged over ranks
        self.stats = {
            "reward": float(sums[0]) / n,
            "reward_std": float(std),
            **{f"rewards/{name}": float(v) / n for name, v in zip(names, glob[10:])},
            **{
                f"rewards/{name}_std": std_of(float(s), float(q), n)
                for name, s, q in zip(names, glob[10 : 10 + k], glob[10 + k :])
            },
            **({"judge/unparsed": float(glob[9]) / self.dp_size} if self.judge is not None else {}),
            "completion_length": float(glob[2]) / n,
            "truncated": float(glob[3]) / n,
            "rollout_tokens_per_s": float(glob[2]) / max(gen_s, 1e-9),
            "time/generation_s": gen_s,
            "time/scoring_s": float(glob[5]) / self.dp_size,
            "time/logps_s": float(glob[6]) / self.dp_size,
            "time/weight_sync_s": float(glob[7]) / self.dp_size,
            "weight_sync_bytes": float(glob[8])
            / self.dp_size,  # per rank: each rank's copy receives the whole
        }

"""Reward models' score head and scoring with a trained reward model. The head is the model's own ``output`` linear
replaced by one of width 1 (``dim -> 1``, no bias, as transformers' ``LlamaForSequenceClassification.score``), put
on by ``attach_score_head`` after the model is built and before it is parallelized, as LoRA's adapters are: its
forward already ends in ``self.output(h)``, so it returns per-position scores (B, S, 1) instead of logits. In a loom
checkpoint the head keeps the name ``output.weight`` (shape (1, dim)); a Hugging Face export names it
``score.weight`` (loom.checkpoint.hf). The reward of a sequence is the head's value at its last non-pad token, as
transformers takes it. Training one: loom.methods.reward."""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from loom.config.errors import ConfigError


def attach_score_head(model: nn.Module) -> nn.Module:
    """Replace ``model.output`` (the LM head, LoRA-adapted or not) by a trainable ``dim -> 1`` linear without bias.
    Call on the plain model (meta device or not) before parallelizing it; under LoRA after ``apply_lora``, so the
    head is trained while the base stays frozen (PEFT's ``modules_to_save = ["score"]``)."""
    model.output = score_head(model)
    return model


def score_head(model: nn.Module) -> nn.Linear:
    """A trainable ``dim -> 1`` linear without bias on ``model``'s device (meta or not): the reward model's score
    head, and PPO's value head on the final hidden states (loom.rl.ppo_objective)."""
    head = nn.Linear(model.args.dim, 1, bias=False, device=model.tok_embeddings.weight.device)
    head.weight.requires_grad_(True)
    return head


def last_token_scores(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each row's score at its last non-pad token, fp32 (N,). scores: (N, S, 1); lengths: (N,) tokens per row."""
    rows = torch.arange(scores.shape[0], device=scores.device)
    return scores[rows, (lengths - 1).clamp(min=0), 0].float()


# ---- scoring ---------------------------------------------------------------------------------------------------


class RewardScorer:
    """A reward model ready to score: the model (eval, fp32 unless told), its tokenizer (None: token ids only) and
    chat template (None: strings only)."""

    def __init__(self, model: nn.Module, tokenizer=None, template=None):
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self._encoder = None

    def encode(self, item) -> list[int]:
        """Token ids of an item: a list of ids as it is; a string tokenized as it is; a conversation (a list of
        messages) rendered with the chat template as training renders pairs."""
        if isinstance(item, (list, tuple)) and all(isinstance(t, int) for t in item):
            return list(item)
        if self.tokenizer is None:
            raise ConfigError("score", type(item).__name__, "this model has no tokenizer: pass token ids")
        if isinstance(item, str):
            return list(self.tokenizer.encode(item))
        if isinstance(item, (list, tuple)) and all(isinstance(m, dict) for m in item):
            if self._encoder is None:
                from loom.data.chat import ChatEncoder, load_template

                self._encoder = ChatEncoder(
                    self.template or load_template("", self.tokenizer), self.tokenizer
                )
            return self._encoder.encode(list(item))[0]
        raise ConfigError(
            "score", type(item).__name__, "allowed: a string, a list of messages or a list of token ids"
        )

    @torch.no_grad()
    def __call__(self, items, batch_size: int = 8) -> list[float]:
        seqs = [self.encode(item) for item in items]
        if any(not s for s in seqs):
            raise ConfigError("score", "''", "an item without a token has no reward")
        longest = getattr(getattr(self.model, "args", None), "max_seq_len", None)
        for i, s in enumerate(seqs):
            if longest and len(s) > longest:  # RoPE past the table: refused, not scored wrongly
                raise ConfigError(
                    "score",
                    f"item {i + 1}",
                    f"{len(s):,} tokens, longer than the model's "
                    f"{longest:,} (its training.seq_len or max_position_embeddings): shorten it",
                )
        device = next(self.model.parameters()).device
        out: list[float] = []
        for first in range(0, len(seqs), batch_size):
            chunk = seqs[first : first + batch_size]
            lengths = torch.tensor([len(s) for s in chunk], device=device)
            ids = torch.zeros(
                len(chunk), int(lengths.max()), dtype=torch.int64, device=device
            )  # right-padded
            for i, s in enumerate(chunk):
                ids[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
            out += last_token_scores(
                self.model(ids), lengths
            ).tolist()  # causal: padding after a row changes nothing
        return out


def load_reward_model(path: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> RewardScorer:
    """A reward model from a ``training.objective reward`` run's checkpoint (``step_N`` or its run dir; LoRA merged)
    or a Hugging Face ``*ForSequenceClassification`` folder (``loom convert --to-hf`` of one)."""
    from loom.checkpoint.hf.config import CONFIG, read_hf_config
    from loom.checkpoint.hf.head import is_score_config
    from loom.checkpoint.hf.reader import llama_args_from_hf, load_hf_weights
    from loom.data import build_tokenizer
    from loom.infer.load import _run_config, find_source
    from loom.models.registry import build_model

    kind, folder = find_source(path)
    if kind == "hf":
        if not is_score_config(read_hf_config(folder, "score")):
            raise ConfigError(
                "score",
                folder,
                "not a reward model: its config.json names no *ForSequenceClassification "
                "architecture with num_labels 1",
            )
        with torch.device("meta"):
            model = attach_score_head(build_model(llama_args_from_hf(folder, "score")))
        model = model.to_empty(device=device)
        load_hf_weights(model, folder)
        tokenizer = (
            build_tokenizer(folder) if os.path.isfile(os.path.join(folder, "tokenizer.json")) else None
        )
        template = None
    elif kind == "run":
        from loom.checkpoint.manager import load_model_weights, verify
        from loom.data.chat import load_template
        from loom.models.common.lora import apply_lora, merge_lora
        from loom.resolve import resolve_model_args

        cfg = _run_config(folder)
        if cfg.training.objective != "reward":
            raise ConfigError(
                "score",
                folder,
                f"written by a training.objective {cfg.training.objective} run, not "
                "a reward model (training.objective reward)",
            )
        tokenizer = build_tokenizer(cfg.data.tokenizer)
        with torch.device("meta"):
            model = build_model(resolve_model_args(cfg, tokenizer).with_(fused_loss=False))
            apply_lora(model, cfg.lora)
            attach_score_head(model)
        model = model.to_empty(device=device)
        verify(folder)
        with warnings.catch_warnings():  # "no process group: loading in a single process" is the intent
            warnings.simplefilter("ignore", UserWarning)
            load_model_weights(folder, model)
        merge_lora(model)
        template = load_template(cfg.data.chat_template, tokenizer)
    else:
        raise ConfigError(
            "score",
            folder,
            f"a {CONFIG} import of `loom convert --from-hf`: score the Hugging Face folder itself",
        )
    model.init_buffers(torch.device(device))
    return RewardScorer(model.to(dtype).eval(), tokenizer, template)


def score(model_or_path, items, *, tokenizer=None, batch_size: int = 8, device: str = "cpu") -> list[float]:
    """The reward of each item (a string, a conversation as a list of messages, or a list of token ids) under a
    reward model: a loom Llama with its score head (``attach_score_head``; ``tokenizer`` for strings and
    conversations) or a path ``load_reward_model`` reads."""
    if isinstance(model_or_path, (str, os.PathLike)):
        scorer = load_reward_model(str(model_or_path), device)
    else:
        scorer = RewardScorer(model_or_path, tokenizer)
    was_training = scorer.model.training
    scorer.model.eval()
    try:
        return scorer(items, batch_size)
    finally:
        scorer.model.train(was_training)

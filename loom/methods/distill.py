"""Knowledge distillation (``training.objective distill``): a student trained on a frozen teacher's next-token
distributions over LM or SFT data (torchtune's KD recipe; TRL's GKD loss at beta 0 / 1), the loss taken over token
chunks from both models' final hidden states so that no full-vocabulary logits of the batch exist at once; the
teacher (distill.teacher: a Hugging Face folder, a loom checkpoint or run dir, or the initial student) built and
sharded as the student is; its rules; its run (the loop)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import DTensor

from loom.config.errors import ConfigError
from loom.config.sections import APPLIED, MUST_MATCH, Config, opt
from loom.data.loader import MicroBatch
from loom.methods import sft
from loom.methods.base import Method, plain_text_rules
from loom.models.common.lora import adapters_disabled
from loom.numerics import IGNORE, valid_tokens
from loom.train.objective import Objective, release_gathered


@dataclass
class DistillConfig:
    """Knowledge distillation (training.objective distill; docs/finetuning.md): torchtune's KD recipe."""

    teacher: str = opt(
        "",
        "the teacher's folder: a Hugging Face folder, a loom checkpoint (step_N, or `loom convert --from-hf`'s "
        "output) or a loom run dir (its newest complete checkpoint), of the student's vocabulary; '' = the initial "
        "student (a frozen copy; under LoRA the student with its adapters off)",
        resume=(APPLIED, "the teacher of the resumed steps (a run dir's newest checkpoint then)"),
    )
    temperature: float = opt(
        1.0,
        "the softmax temperature of both models' logits in the KL terms (the CE term is at 1); not rescaled by T^2 "
        "(TRL's GKD convention)",
        min=0.0,
        min_exclusive=True,
        resume=(APPLIED, "the loss from the next step"),
    )
    reverse_kl: float = opt(
        0.0,
        "the reverse KL's weight (the student's distribution against the teacher's), 1 - it the forward KL's (the "
        "teacher's against the student's): 0 = forward KL (torchtune's), 1 = reverse",
        min=0.0,
        max=1.0,
        resume=(APPLIED, "the loss from the next step"),
    )
    kd_ratio: float = opt(
        0.5,
        "the KL term's weight, 1 - it the hard-label cross-entropy's (torchtune's kd_ratio); 1 = distillation alone",
        min=0.0,
        max=1.0,
        resume=(APPLIED, "the loss from the next step"),
    )
    data: str = opt(
        "lm",
        "the data: 'lm' = packed text (every token takes the loss), 'sft' = conversations through the chat "
        "template (the assistant's tokens; needs data.document_positions true)",
        choices=("lm", "sft"),
        resume=(MUST_MATCH, "what the data stream is"),
    )


SECTIONS = {"distill": DistillConfig}  # --distill.teacher, [distill]

CHUNK_BYTES = 64 * 2**20  # one fp32 (rows, vocab) buffer of a chunk; the chunk's math holds about six of them


def default_chunk_rows(vocab: int) -> int:
    """Rows per chunk: one fp32 (rows, V) buffer within ``CHUNK_BYTES`` (128 rows at V = 128256), at least 1."""
    return max(1, CHUNK_BYTES // (4 * vocab))


def token_losses(
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reverse: float = 0.0,
    kd_ratio: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The definition on logits (N, V) of the student and teacher and labels (N,) (IGNORE: no loss), fp32: per token
    (the loss, its KD term, its CE term, the labelled mask). KD = (1 - reverse) KL(p || q) + reverse KL(q || p) with
    p, q the teacher's and student's softmax at ``temperature`` (not rescaled by T^2: TRL's GKD convention); CE the
    student's hard-label cross-entropy at temperature 1; loss = kd_ratio KD + (1 - kd_ratio) CE (torchtune's)."""
    s = torch.log_softmax(student.float() / temperature, dim=-1)  # (N, V)
    t = torch.log_softmax(teacher.float() / temperature, dim=-1)  # (N, V)
    forward = (t.exp() * (t - s)).sum(-1)  # KL(teacher || student) (N,)
    backward = (s.exp() * (s - t)).sum(-1)  # KL(student || teacher) (N,)
    kd = (1 - reverse) * forward + reverse * backward
    valid = labels != IGNORE
    ce = torch.nn.functional.cross_entropy(
        student.float(), torch.where(valid, labels, 0), reduction="none"
    )  # (N,)
    kd, ce = kd * valid, ce * valid
    return kd_ratio * kd + (1 - kd_ratio) * ce, kd, ce, valid


def _chunk_(
    zs: torch.Tensor,
    zt: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    reverse: float,
    kd_ratio: float,
    with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: student logits zs (n, V) fp32 (overwritten with d(summed loss)/d(zs) under ``with_grad``),
    teacher logits zt (n, V) fp32 (consumed), labels (n,). Returns the chunk's (KD, CE) token losses (n,), labelled
    tokens only; the loss is their kd_ratio mix (``token_losses``), its gradient written in place."""
    valid = labels != IGNORE  # (n,)
    target = torch.where(valid, labels, 0)[:, None]  # (n, 1)
    lse = torch.logsumexp(zs, dim=-1)  # (n,) at temperature 1, for CE
    ce = torch.where(valid, lse - zs.gather(1, target).squeeze(1), 0.0)  # (n,)
    t = torch.log_softmax(zt.div_(temperature), dim=-1)  # (n, V) teacher log p
    s = torch.log_softmax(zs / temperature, dim=-1)  # (n, V) student log q
    p, q = t.exp(), s.exp()
    log_ratio = s.sub_(t)  # log q - log p, in s's storage
    forward = -(p * log_ratio).sum(-1)  # KL(p || q) (n,)
    backward = (q * log_ratio).sum(-1)  # KL(q || p) (n,)
    kd = torch.where(valid, (1 - reverse) * forward + reverse * backward, 0.0)
    if with_grad:
        # d KL(p||q)/dz = (q - p) / T;  d KL(q||p)/dz = q (log q - log p - KL(q||p)) / T;  d CE/dz = softmax(z) - onehot
        g = (q - p).mul_((1 - reverse) * kd_ratio / temperature)
        if reverse:
            g.add_(q * (log_ratio - backward[:, None]), alpha=reverse * kd_ratio / temperature)
        if kd_ratio < 1:
            soft = zs.sub_(lse[:, None]).exp_()  # softmax at T = 1, in zs's storage
            soft.scatter_add_(1, target, -torch.ones_like(soft[:, :1]))
            g.add_(soft, alpha=1 - kd_ratio)
        zs.copy_(g.mul_(valid[:, None]))
    return kd, ce


def _accumulate(acc: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor) -> None:
    """acc (V, E) fp32 += dlogits.T (V, n) @ h (n, E), the product in the head's dtype: written in fp32 by cuBLAS on
    CUDA, rounded to the dtype before the fp32 sum elsewhere (as the fused linear + cross-entropy accumulates)."""
    if dlogits.dtype == acc.dtype:
        acc.addmm_(dlogits.T, h)
    elif dlogits.is_cuda:
        torch.addmm(acc, dlogits.T, h, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(dlogits.T @ h)


class _Distill(torch.autograd.Function):
    """The summed loss of ``chunked_distill_loss`` with its gradients computed chunk by chunk in forward (as the
    fused linear + cross-entropy does: loom.kernels.linear_ce), saved and scaled by the incoming scalar in
    backward: nothing of the teacher and no (rows, V) buffer outlives a chunk."""

    @staticmethod
    def forward(
        ctx, h, weight, h_teacher, w_teacher, labels, temperature, reverse, kd_ratio, rows, stats, grads
    ):
        grad_h = torch.zeros_like(h) if grads and ctx.needs_input_grad[0] else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if grads and ctx.needs_input_grad[1]
            else None
        )
        with_grad = grad_h is not None or grad_w is not None
        kd_sum = h.new_zeros((), dtype=torch.float32)
        ce_sum = h.new_zeros((), dtype=torch.float32)
        for start in range(0, h.shape[0], rows):
            h_c = h[start : start + rows]  # (n, E)
            zs = (h_c @ weight.T).float()  # (n, V)
            zt = (h_teacher[start : start + rows] @ w_teacher.T).float()  # (n, V)
            kd, ce = _chunk_(zs, zt, labels[start : start + rows], temperature, reverse, kd_ratio, with_grad)
            del zt
            kd_sum += kd.sum()
            ce_sum += ce.sum()
            if grad_h is not None:
                grad_h[start : start + rows] = (zs.to(weight.dtype) @ weight).to(h.dtype)
            if grad_w is not None:
                _accumulate(grad_w, zs.to(weight.dtype), h_c)
        stats.update(kd=kd_sum.detach(), ce=ce_sum.detach())
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return kd_ratio * kd_sum + (1 - kd_ratio) * ce_sum

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        dh = None if grad_h is None else grad_h * grad_loss.to(grad_h.dtype)
        dw = None if grad_w is None else grad_w * grad_loss.to(grad_w.dtype)
        return dh, dw, None, None, None, None, None, None, None, None, None


def chunked_distill_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    h_teacher: torch.Tensor,
    w_teacher: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reverse: float = 0.0,
    kd_ratio: float = 1.0,
    chunk_rows: int | None = None,
    stats: dict | None = None,
) -> torch.Tensor:
    """The summed ``token_losses`` (an fp32 scalar) of the student logits h @ weight.T against the teacher's
    h_teacher @ w_teacher.T, over token chunks of ``chunk_rows`` (default ``default_chunk_rows``): h (..., E),
    h_teacher (..., E_teacher), labels h's leading shape. Matmuls in the autocast dtype when autocast is on (as the
    model's own head would run), softmax and KL in fp32. ``stats``: gets the summed KD and CE terms ('kd', 'ce')."""
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        h, weight = h.to(dtype), weight.to(dtype)
        h_teacher, w_teacher = h_teacher.to(dtype), w_teacher.to(dtype)
    if weight.shape[0] != w_teacher.shape[0]:
        raise ValueError(
            f"distill: student vocabulary {weight.shape[0]} and teacher's {w_teacher.shape[0]} differ"
        )
    rows = chunk_rows or default_chunk_rows(weight.shape[0])
    with torch.autocast(device_type, enabled=False):
        return _Distill.apply(
            h.reshape(-1, h.shape[-1]),
            weight,
            h_teacher.reshape(-1, h_teacher.shape[-1]).detach(),
            w_teacher.detach(),
            labels.reshape(-1),
            float(temperature),
            float(reverse),
            float(kd_ratio),
            rows,
            {} if stats is None else stats,
            torch.is_grad_enabled(),  # a validation pass (no_grad) computes no gradient
        )


@contextlib.contextmanager
def _head(output: torch.nn.Module, fn):
    """``output`` (a model's LM head) computing ``fn(h)`` in place of its logits for a while: the model's own
    forward (where FSDP2 has its weight gathered) hands the final hidden states (B, S, E) to ``fn``."""
    output.forward = fn
    try:
        yield
    finally:
        del output.forward  # the class's forward again


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model under a DDP wrapper (FSDP2 wraps in place)."""
    return getattr(model, "module", model)


class Distillation(Objective):
    """Knowledge distillation: per labelled token of the LM or SFT data, kd_ratio x KD(teacher, student) +
    (1 - kd_ratio) x the hard-label CE (``token_losses``), summed and counted over the labelled tokens, so a step's
    loss is their mean over the global batch whatever the layout. The teacher runs first on the same micro-batch
    (no gradient, the step's autocast) up to its final hidden states; the student's forward then takes the chunked
    loss (``chunked_distill_loss``) in place of its logits, with both heads' weights at hand (FSDP2 keeps a root's
    parameters gathered after its forward; the teacher's are released after the loss).

    ``teacher``: '' = the initial student (a frozen copy of it built by ``prepare``, or under LoRA the student with
    its adapters off); else a folder (``build_teacher``)."""

    loss_in_forward = True  # the loss needs the teacher beside the hidden states: forward returns it
    STATS = ("kd_loss", "ce_loss")
    console = (("kd", "kd_loss", ".3f"), ("ce", "ce_loss", ".3f"))
    panels = (
        (
            "distillation",
            ("kd_loss", "ce_loss", "val_kd_loss"),
            "per labelled token: KL to the teacher, label CE",
        ),
    )

    def __init__(
        self,
        teacher: str = "",
        temperature: float = 1.0,
        reverse: float = 0.0,
        kd_ratio: float = 0.5,
        data: str = "lm",
        chunk_rows: int | None = None,
    ):
        self.teacher, self.data, self.chunk_rows = teacher, data, chunk_rows
        self.temperature, self.reverse, self.kd_ratio = temperature, reverse, kd_ratio
        self.teacher_model: torch.nn.Module | None = None  # set by prepare; None = the student, adapters off
        self._stats: dict[str, torch.Tensor] = {}

    def count(self, mb: MicroBatch) -> torch.Tensor:
        return valid_tokens(mb.labels)

    def prepare(self, engine) -> None:
        """The teacher, built before the first step (before a resumed run loads its checkpoint, so the initial
        student is the same one on a resume)."""
        if self.teacher:
            self.teacher_model = build_teacher(engine, self.teacher)
            return
        if not engine.cfg.model.init_from and engine.env.is_main:
            print(
                "warning: distill.teacher is unset and there is no model.init_from: the teacher is the student's own "
                "random initialization, a KL anchor to it and nothing to learn from; set distill.teacher to a "
                "trained model's folder (a Hugging Face folder, a loom checkpoint or run dir)",
                flush=True,
            )
        if not engine.cfg.lora.rank:
            self.teacher_model = engine.frozen_copy()

    def _teacher_hidden(self, model, mb: MicroBatch, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's final hidden states (B, S, E_teacher) of the micro-batch and its head's weight (V, E_teacher)
        as its forward left it (gathered under FSDP2)."""
        teacher = self.teacher_model if self.teacher_model is not None else _unwrapped(model)
        off = adapters_disabled(teacher) if self.teacher_model is None else contextlib.nullcontext()
        with torch.no_grad(), off, _head(teacher.output, lambda h: h):
            hidden = teacher(mb.inputs, positions)  # (B, S, E_teacher)
        weight = teacher.output.weight
        assert not isinstance(weight, DTensor), "distill: the teacher's head is sharded after its forward"
        return hidden, weight

    def forward(self, model, mb: MicroBatch, positions: torch.Tensor | None) -> torch.Tensor:
        hidden, weight = self._teacher_hidden(model, mb, positions)
        student = _unwrapped(model)
        stats: dict[str, torch.Tensor] = {}

        def loss_of(h: torch.Tensor) -> torch.Tensor:
            return chunked_distill_loss(
                h,
                student.output.weight,
                hidden,
                weight,
                mb.labels,
                self.temperature,
                self.reverse,
                self.kd_ratio,
                self.chunk_rows,
                stats,
            )

        with _head(student.output, loss_of):
            loss = model(mb.inputs, positions)
        if self.teacher_model is not None:
            release_gathered(self.teacher_model)
        for key, name in zip(("kd", "ce"), self.STATS):
            self._stats[name] = self._stats.get(name, 0) + stats[key]
        return loss

    def step_stats(self) -> dict[str, torch.Tensor]:
        stats, self._stats = self._stats, {}
        return stats


def teacher_folder(path: str) -> str:
    """The folder the teacher is read from: ``path``, or for a loom run dir its newest complete checkpoint
    (``checkpoints/step_N``)."""
    from loom.checkpoint.hf.config import CONFIG, is_loom_checkpoint
    from loom.checkpoint.manager import list_complete

    if (
        os.path.isdir(path)
        and not is_loom_checkpoint(path)
        and not os.path.isfile(os.path.join(path, CONFIG))
    ):
        done = list_complete(os.path.join(path, "checkpoints"))
        if done:
            return done[-1][1]
    return path


def teacher_kind(path: str) -> str:
    """'hf' for a Hugging Face folder or an imported loom checkpoint (``loom convert --from-hf``: its config kept),
    'run' for a checkpoint a loom training run wrote (its config.toml says the shape) or a run dir with one; a
    ConfigError otherwise."""
    from loom.checkpoint.hf.config import CONFIG, HF_CONFIG_COPY, is_loom_checkpoint

    if not os.path.isdir(path):
        raise ConfigError(
            "distill.teacher", path, "folder not found (a Hugging Face folder, a loom checkpoint or run dir)"
        )
    path = teacher_folder(path)
    if is_loom_checkpoint(path):
        if os.path.isfile(os.path.join(path, HF_CONFIG_COPY)):
            return "hf"
        if os.path.isfile(os.path.join(path, "config.toml")):
            return "run"
    elif os.path.isfile(os.path.join(path, CONFIG)):
        return "hf"
    raise ConfigError(
        "distill.teacher",
        path,
        "neither a Hugging Face folder (config.json) nor a complete loom checkpoint (a run's step_N folder, "
        "`loom convert --from-hf`'s output) nor a run dir with one in checkpoints/",
    )


def teacher_args(engine, path: str):
    """The teacher's model args: its folder's shape (a Hugging Face config, or the recorded run's resolved as the
    trainer resolved it), run with this run's kernels and sequence length; its vocabulary must be the student's."""
    kind, path = teacher_kind(path), teacher_folder(path)
    if kind == "hf":
        from loom.checkpoint.hf.reader import llama_args_from_hf

        args = llama_args_from_hf(path, "distill.teacher")
    else:
        from loom.config import build_config
        from loom.config.load import read_toml
        from loom.data import build_tokenizer
        from loom.resolve import resolve_model_args
        from loom.train.run_dir import recorded_values

        recorded = build_config(
            None,
            {
                **recorded_values(path, read_toml(os.path.join(path, "config.toml"))),
                "checkpoint.resume": "none",
            },
        )
        args = resolve_model_args(recorded, build_tokenizer(recorded.data.tokenizer), engine.kernels)
    vocab = engine.model_args.vocab_size
    if args.vocab_size != vocab:
        raise ConfigError(
            "distill.teacher",
            path,
            f"has a vocabulary of {args.vocab_size}: the student's is {vocab} (a teacher of the same tokenizer and "
            "vocabulary size; model.vocab_size sets the student's)",
        )
    return args.with_(max_seq_len=engine.cfg.training.seq_len, **engine.kernels.as_args())


def build_teacher(engine, path: str) -> torch.nn.Module:
    """The frozen teacher from ``path``, built on the meta device and parallelized in the student's layout (FSDP2
    shards it over the same ranks when the student is sharded; no activation checkpointing, no DDP wrapper: nothing
    runs backward through it), then its weights read (each rank its own shard), in eval mode."""
    from loom.checkpoint.hf.reader import check_checkpoint_shapes, load_hf_weights
    from loom.checkpoint.manager import load_model_weights
    from loom.models.registry import build_model
    from loom.train.engine import parallelize

    cfg = engine.cfg
    args = teacher_args(engine, path)
    kind, path = teacher_kind(path), teacher_folder(path)
    with torch.device("meta"):
        model = build_model(args)
    training = replace(cfg.training, activation_checkpointing="none")
    (teacher,) = parallelize(model)(
        model, engine.dims, training, cfg.parallel, engine.device, cfg.run.seed
    ).parts
    if kind == "hf":
        load_hf_weights(teacher, path)
    else:
        check_checkpoint_shapes(
            path, teacher, "distill.teacher", hint="; export it with `loom convert --to-hf`"
        )
        load_model_weights(path, teacher)
    teacher.requires_grad_(False)
    return teacher.eval()


def objective(cfg: Config) -> Distillation:
    d = cfg.distill
    return Distillation(d.teacher, d.temperature, d.reverse_kl, d.kd_ratio, d.data)


def rules(cfg: Config) -> None:
    """The data's own rules (lm: plain text; sft: SFT's), the teacher's folder, and the layouts the chunked loss
    does not take yet (a pipeline's last stage has no teacher; tensor and context parallelism would shard the
    logits or the tokens the two heads meet on)."""
    d, p = cfg.distill, cfg.parallel
    (sft.rules if d.data == "sft" else plain_text_rules)(cfg)
    if d.teacher:
        teacher_kind(d.teacher)
    for key, value in (("parallel.pp", p.pp), ("parallel.tp", p.tp), ("parallel.cp", p.cp)):
        if value > 1:
            raise ConfigError(key, value, "not supported with training.objective distill yet: allowed 1")


METHOD = Method("distill", Distillation, objective, rules=rules)

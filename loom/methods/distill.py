"""Knowledge distillation (``training.objective distill``): a student trained on a frozen teacher's next-token
distributions over LM or SFT data (torchtune's KD recipe; TRL's GKD loss, its generalized JSD included), the loss
taken over token chunks from both models' final hidden states so that no full-vocabulary logits of the batch exist at
once (under tensor parallelism over each rank's vocabulary shard); the teacher (distill.teacher: a Hugging Face folder, a loom checkpoint or run dir, or the initial student) built and
sharded as the student is; its rules; its run (the loop)."""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from loom.config.errors import ConfigError
from loom.config.sections import APPLIED, MUST_MATCH, Config, opt
from loom.data.loader import MicroBatch
from loom.methods import sft
from loom.methods.base import Method, PlanExtras, plain_text_rules
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
    divergence: str = opt(
        "kl",
        "the KD term: 'kl' = the KLs mixed by distill.reverse_kl; 'jsd' = TRL's generalized Jensen-Shannon "
        "divergence at distill.beta (GKDTrainer.generalized_jsd_loss)",
        choices=("kl", "jsd"),
        resume=(APPLIED, "the loss from the next step"),
    )
    reverse_kl: float = opt(
        0.0,
        "divergence kl: the reverse KL's weight (the student's distribution against the teacher's), 1 - it the "
        "forward KL's (the teacher's against the student's): 0 = forward KL (torchtune's), 1 = reverse",
        min=0.0,
        max=1.0,
        resume=(APPLIED, "the loss from the next step"),
    )
    beta: float = opt(
        0.5,
        "divergence jsd: TRL's GKD beta, the teacher's weight in the mixture m = beta p + (1 - beta) q; the term "
        "beta KL(p || m) + (1 - beta) KL(q || m), at 0 the forward KL, at 1 the reverse (as TRL)",
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


class Terms(NamedTuple):
    """The loss's settings: KD = (1 - reverse) KL(p || q) + reverse KL(q || p), or with ``jsd`` (a beta in (0, 1))
    TRL's generalized JSD; loss = kd_ratio KD + (1 - kd_ratio) CE; ``temperature`` divides both models' logits in KD."""

    temperature: float = 1.0
    reverse: float = 0.0
    kd_ratio: float = 1.0
    jsd: float | None = None


def terms(temperature: float, reverse: float, kd_ratio: float, jsd: float | None) -> Terms:
    """``Terms`` with TRL's endpoints of the JSD made its KLs (beta 0 = forward, 1 = reverse: its own branches)."""
    if jsd is not None and jsd in (0.0, 1.0):
        reverse, jsd = float(jsd), None
    return Terms(float(temperature), float(reverse), float(kd_ratio), None if jsd is None else float(jsd))


def token_losses(
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reverse: float = 0.0,
    kd_ratio: float = 1.0,
    jsd: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The definition on logits (N, V) of the student and teacher and labels (N,) (IGNORE: no loss), fp32: per token
    (the loss, its KD term, its CE term, the labelled mask). KD = (1 - reverse) KL(p || q) + reverse KL(q || p) with
    p, q the teacher's and student's softmax at ``temperature`` (not rescaled by T^2: TRL's GKD convention), or with
    ``jsd`` = beta TRL's generalized JSD beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q (beta 0 /
    1: the forward / reverse KL, as TRL); CE the student's hard-label cross-entropy at temperature 1; loss = kd_ratio
    KD + (1 - kd_ratio) CE (torchtune's)."""
    temperature, reverse, kd_ratio, jsd = terms(temperature, reverse, kd_ratio, jsd)
    s = torch.log_softmax(student.float() / temperature, dim=-1)  # (N, V)
    t = torch.log_softmax(teacher.float() / temperature, dim=-1)  # (N, V)
    if jsd is None:
        forward = (t.exp() * (t - s)).sum(-1)  # KL(teacher || student) (N,)
        backward = (s.exp() * (s - t)).sum(-1)  # KL(student || teacher) (N,)
        kd = (1 - reverse) * forward + reverse * backward
    else:
        m = torch.logaddexp(t + math.log(jsd), s + math.log1p(-jsd))  # (N, V) log of the mixture
        kd = jsd * (t.exp() * (t - m)).sum(-1) + (1 - jsd) * (s.exp() * (s - m)).sum(-1)
    valid = labels != IGNORE
    ce = torch.nn.functional.cross_entropy(
        student.float(), torch.where(valid, labels, 0), reduction="none"
    )  # (N,)
    kd, ce = kd * valid, ce * valid
    return kd_ratio * kd + (1 - kd_ratio) * ce, kd, ce, valid


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of a vocab-sharded head (tensor parallelism): vocabulary rows [start, start + its local
    rows); ``group``: the tp ranks that hold the others, over which a chunk's vocabulary reductions run."""

    group: object
    start: int


def vocab_shard(weight: torch.Tensor) -> tuple[torch.Tensor, VocabShard | None]:
    """A head's weight as this rank holds it: a plain tensor as it is (no shard); a DTensor sharded by rows over a
    1-D tp mesh (TP's column-parallel head) as its local rows (V/tp, E) and their ``VocabShard``."""
    if not isinstance(weight, DTensor):
        return weight, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = weight.device_mesh, tuple(weight.placements)
    assert mesh.ndim == 1 and placements == (Shard(0),), f"distill: a head laid out as {placements}"
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, placements)
    return weight.to_local(), VocabShard(mesh.get_group(), offset[0])


def _vocab_lse(shard: VocabShard | None, *xs: torch.Tensor) -> torch.Tensor:
    """The logsumexp over the whole vocabulary of each (n, v) slice in ``xs``: (len(xs), n), the same on every
    rank of the shard's group (each rank's own logsumexps gathered and combined)."""
    lse = torch.stack([torch.logsumexp(x, dim=-1) for x in xs])  # (k, n)
    if shard is None:
        return lse
    parts = [torch.empty_like(lse) for _ in range(dist.get_world_size(shard.group))]
    dist.all_gather(parts, lse, group=shard.group)
    return torch.logsumexp(torch.stack(parts), dim=0)  # (k, n)


def _vocab_sum(shard: VocabShard | None, *xs: torch.Tensor) -> torch.Tensor:
    """Per-token sums (n,) over this rank's vocabulary slice completed over the whole vocabulary: (len(xs), n)."""
    out = torch.stack(xs)  # (k, n)
    if shard is not None:
        dist.all_reduce(out, group=shard.group)
    return out


def _chunk_(
    zs: torch.Tensor,
    zt: torch.Tensor,
    labels: torch.Tensor,
    loss: Terms,
    with_grad: bool,
    shard: VocabShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: student logits zs (n, v) fp32 (overwritten with d(summed loss)/d(zs) under ``with_grad``),
    teacher logits zt (n, v) fp32 (consumed), labels (n,); v the whole vocabulary, or under ``shard`` this rank's
    slice of it (the softmax normalizers and per-token sums then completed over the tp group: two collectives).
    Returns the chunk's (KD, CE) token losses (n,), labelled tokens only; the loss is their kd_ratio mix
    (``token_losses``), its gradient written in place."""
    temperature, reverse, kd_ratio, jsd = loss
    valid = labels != IGNORE  # (n,)
    column = torch.where(valid, labels, 0) - (
        shard.start if shard is not None else 0
    )  # the label's column here
    mine = (column >= 0) & (column < zs.shape[1])  # (n,) the label is in this slice
    column = column.clamp(0, zs.shape[1] - 1)[:, None]  # (n, 1)
    s = zs / temperature  # (n, v)
    lse, lse_s, lse_t = _vocab_lse(shard, zs, s, zt.div_(temperature))  # (n,) each; CE's at temperature 1
    s = s.sub_(lse_s[:, None])  # student log q
    t = zt.sub_(lse_t[:, None])  # teacher log p
    p, q = t.exp(), s.exp()
    label = torch.where(mine, zs.gather(1, column).squeeze(1), 0.0)  # (n,) the label's logit, on its rank
    g = None
    if jsd is None:
        log_ratio = s.sub_(t)  # log q - log p, in s's storage
        forward, backward, label = _vocab_sum(
            shard, -(p * log_ratio).sum(-1), (q * log_ratio).sum(-1), label
        )  # KL(p || q), KL(q || p)
        kd = (1 - reverse) * forward + reverse * backward
        if with_grad:
            # d KL(p||q)/dz = (q - p) / T;  d KL(q||p)/dz = q (log q - log p - KL(q||p)) / T
            g = (q - p).mul_((1 - reverse) * kd_ratio / temperature)
            if reverse:
                g.add_(q * (log_ratio - backward[:, None]), alpha=reverse * kd_ratio / temperature)
    else:
        m = torch.logaddexp(t + math.log(jsd), s + math.log1p(-jsd))  # (n, v) log of beta p + (1 - beta) q
        to_p, to_q = t.sub_(m), s.sub_(m)  # log p - log m, log q - log m, in place
        kl_p, kl_q, label = _vocab_sum(shard, (p * to_p).sum(-1), (q * to_q).sum(-1), label)
        kd = jsd * kl_p + (1 - jsd) * kl_q
        if with_grad:
            # d/dz [beta KL(p||m) + (1 - beta) KL(q||m)] = (1 - beta) q (log q - log m - KL(q||m)) / T
            g = q.mul_(to_q.sub_(kl_q[:, None])).mul_((1 - jsd) * kd_ratio / temperature)
    kd = torch.where(valid, kd, 0.0)
    ce = torch.where(valid, lse - label, 0.0)  # (n,)
    if with_grad:
        if kd_ratio < 1:  # d CE/dz = softmax(z) - onehot(label)
            soft = zs.sub_(lse[:, None]).exp_()  # softmax at T = 1, in zs's storage
            soft.scatter_add_(1, column, -mine.to(soft.dtype)[:, None])
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
    backward: nothing of the teacher and no (rows, V) buffer outlives a chunk. Under a ``VocabShard`` the
    gradient of h is this rank's vocabulary slice's part (its caller sums it over the tp group)."""

    @staticmethod
    def forward(ctx, h, weight, h_teacher, w_teacher, labels, loss, rows, stats, grads, shard):
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
            kd, ce = _chunk_(zs, zt, labels[start : start + rows], loss, with_grad, shard)
            del zt
            kd_sum += kd.sum()
            ce_sum += ce.sum()
            if grad_h is not None:
                grad_h[start : start + rows] = (zs.to(weight.dtype) @ weight).to(h.dtype)
            if grad_w is not None:
                _accumulate(grad_w, zs.to(weight.dtype), h_c)
        stats.update(kd=kd_sum.detach(), ce=ce_sum.detach())
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return loss.kd_ratio * kd_sum + (1 - loss.kd_ratio) * ce_sum

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        dh = None if grad_h is None else grad_h * grad_loss.to(grad_h.dtype)
        dw = None if grad_w is None else grad_w * grad_loss.to(grad_w.dtype)
        return dh, dw, None, None, None, None, None, None, None, None


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
    jsd: float | None = None,
    shard: VocabShard | None = None,
) -> torch.Tensor:
    """The summed ``token_losses`` (an fp32 scalar) of the student logits h @ weight.T against the teacher's
    h_teacher @ w_teacher.T, over token chunks of ``chunk_rows`` (default ``default_chunk_rows``): h (..., E),
    h_teacher (..., E_teacher), labels h's leading shape. Matmuls in the autocast dtype when autocast is on (as the
    model's own head would run), softmax and KL in fp32. ``stats``: gets the summed KD and CE terms ('kd', 'ce').
    ``shard``: both weights are this rank's rows of the vocabulary (``vocab_shard``), h and h_teacher the whole
    tokens; the loss is the whole vocabulary's on every rank, h's gradient this rank's part of it."""
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
            terms(temperature, reverse, kd_ratio, jsd),
            rows,
            {} if stats is None else stats,
            torch.is_grad_enabled(),  # a validation pass (no_grad) computes no gradient
            shard,
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


def _as_head_output(loss: torch.Tensor, mesh, loss_parallel: bool) -> torch.Tensor:
    """The scalar loss (the same on every tp rank) as what TP's column-parallel head hands on unchanged: a
    replicated DTensor, which its hook turns into the plain scalar, or under ``loss_parallel`` (logits left
    vocab-sharded) a DTensor of one value per rank, which it passes on as it is (``Distillation.forward`` takes this
    rank's value). No communication either way."""
    if loss_parallel:
        return DTensor.from_local(loss.reshape(1), mesh, [Shard(0)], run_check=False)
    return DTensor.from_local(loss, mesh, [Replicate()], run_check=False)


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
        jsd: float | None = None,
    ):
        self.teacher, self.data, self.chunk_rows = teacher, data, chunk_rows
        self.temperature, self.reverse, self.kd_ratio, self.jsd = temperature, reverse, kd_ratio, jsd
        self.teacher_model: torch.nn.Module | None = None  # set by prepare; None = the student, adapters off
        self.loss_parallel = False  # set by prepare: under TP, the head's output is left vocab-sharded
        self._stats: dict[str, torch.Tensor] = {}

    def count(self, mb: MicroBatch) -> torch.Tensor:
        return valid_tokens(mb.labels)

    def prepare(self, engine) -> None:
        """The teacher, built before the first step (before a resumed run loads its checkpoint, so the initial
        student is the same one on a resume)."""
        self.loss_parallel = engine.loss_parallel
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
        """The teacher's final hidden states (B, S, E_teacher) of the micro-batch (the whole sequence under TP: its
        head's input hook gathers it) and its head's weight (V, E_teacher) as its forward left it (gathered under
        FSDP2; under TP a DTensor of vocabulary rows)."""
        teacher = self.teacher_model if self.teacher_model is not None else _unwrapped(model)
        off = adapters_disabled(teacher) if self.teacher_model is None else contextlib.nullcontext()
        kept = []
        with torch.no_grad(), off, _head(teacher.output, lambda h: kept.append(h) or h):
            teacher(mb.inputs, positions)  # what TP's output hook makes of the hidden states is not read
        (hidden,) = kept
        weight = teacher.output.weight
        assert not isinstance(weight, DTensor) or weight.device_mesh.ndim == 1, (
            "distill: the teacher's head is sharded after its forward"
        )
        return (hidden.to_local() if isinstance(hidden, DTensor) else hidden), weight

    def forward(self, model, mb: MicroBatch, positions: torch.Tensor | None) -> torch.Tensor:
        hidden, teacher_weight = self._teacher_hidden(model, mb, positions)
        w_teacher, _ = vocab_shard(teacher_weight)
        student = _unwrapped(model)
        stats: dict[str, torch.Tensor] = {}

        def loss_of(h: torch.Tensor) -> torch.Tensor:
            weight, shard = vocab_shard(student.output.weight)
            if (
                shard is not None
            ):  # TP: h is a DTensor, the whole sequence on every tp rank; its gradient summed
                mesh, h = h.device_mesh, h.to_local(grad_placements=[Partial()])
            loss = chunked_distill_loss(
                h,
                weight,
                hidden,
                w_teacher,
                mb.labels,
                self.temperature,
                self.reverse,
                self.kd_ratio,
                self.chunk_rows,
                stats,
                self.jsd,
                shard,
            )
            return loss if shard is None else _as_head_output(loss, mesh, self.loss_parallel)

        with _head(student.output, loss_of):
            loss = model(mb.inputs, positions)
        if isinstance(loss, DTensor):
            loss = loss.to_local().reshape(())
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
        model, engine.dims, training, engine.parallel, engine.device, cfg.run.seed
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
    jsd = d.beta if d.divergence == "jsd" else None
    return Distillation(d.teacher, d.temperature, d.reverse_kl, d.kd_ratio, d.data, jsd=jsd)


def rules(cfg: Config) -> None:
    """The data's own rules (lm: plain text; sft: SFT's), the teacher's folder, the other divergence's field, and
    the layouts the chunked loss does not take yet (a pipeline's last stage has no teacher; context parallelism
    would shard the tokens the two heads meet on)."""
    d, p = cfg.distill, cfg.parallel
    (sft.rules if d.data == "sft" else plain_text_rules)(cfg)
    if d.teacher:
        teacher_kind(d.teacher)
    name, value, default, needs = (  # the other divergence's field, which this one does not read
        ("distill.reverse_kl", d.reverse_kl, DistillConfig.reverse_kl, "kl")
        if d.divergence == "jsd"
        else ("distill.beta", d.beta, DistillConfig.beta, "jsd")
    )
    if value != default:
        raise ConfigError(
            name, value, f"does nothing without distill.divergence {needs}: set that too, or leave {name} out"
        )
    for key, value in (("parallel.pp", p.pp), ("parallel.cp", p.cp)):
        if value > 1:
            raise ConfigError(key, value, "not supported with training.objective distill yet: allowed 1")


def plan(cfg: Config) -> PlanExtras:
    """For the planner: without distill.teacher a frozen copy of the policy (none under LoRA: adapters off); a
    teacher folder is a model of its own shape, which the planner does not read."""
    if cfg.distill.teacher:
        return PlanExtras(frozen=None)
    return PlanExtras(frozen=int(not cfg.lora.rank))


METHOD = Method("distill", Distillation, objective, rules=rules, plan=plan)

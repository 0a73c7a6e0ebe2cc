"""Knowledge distillation (``training.objective distill``): the chunked loss and its gradients equal the direct
definition on full logits (forward, reverse and mixed KL, temperature, the hard-label CE mix, ignored tokens, a
larger teacher, TRL's generalized JSD); the definition equals TRL's GKD loss at beta 0 / 1 and torchtune's
ForwardKLLoss up to their conventions, the chunked JSD and its gradients TRL's at betas in (0, 1); and it trains from ``loom train``."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from loom.methods.distill import chunked_distill_loss, token_losses
from loom.numerics import IGNORE
from tests.tiny import tiny_args, tiny_config


def batch(seed=0, n=40, e=16, e_teacher=24, v=50):
    """Student hidden states and head (E = 16), a wider teacher's (E = 24), labels with ignored tokens."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, e, generator=g, dtype=torch.float64)
    w = torch.randn(v, e, generator=g, dtype=torch.float64) / 3
    ht = torch.randn(n, e_teacher, generator=g, dtype=torch.float64)
    wt = torch.randn(v, e_teacher, generator=g, dtype=torch.float64) / 3
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::3] = IGNORE
    return h, w, ht, wt, labels


@pytest.mark.parametrize(
    "temperature,reverse,kd_ratio,jsd",
    [
        (1.0, 0.0, 1.0, None),
        (2.0, 1.0, 1.0, None),
        (0.7, 0.3, 0.5, None),
        (1.5, 0.0, 0.0, None),
        (1.0, 0.5, 0.25, None),
        (1.0, 0.0, 1.0, 0.5),
        (2.0, 0.0, 0.6, 0.1),
        (0.7, 0.0, 1.0, 0.9),
    ],
)
def test_chunked_loss_and_gradients_equal_the_definition(temperature, reverse, kd_ratio, jsd):
    h, w, ht, wt, labels = batch()
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    expected = (
        token_losses(h1 @ w1.T, ht @ wt.T, labels, temperature, reverse, kd_ratio, jsd)[0].double().sum()
    )
    expected.backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    stats = {}
    got = chunked_distill_loss(
        h2, w2, ht, wt, labels, temperature, reverse, kd_ratio, chunk_rows=7, stats=stats, jsd=jsd
    )
    (2 * got).backward()  # the incoming gradient scales the saved ones
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h2.grad.double(), 2 * h1.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w2.grad.double(), 2 * w1.grad, rtol=1e-4, atol=1e-6)
    _, kd, ce, _ = token_losses(h @ w.T, ht @ wt.T, labels, temperature, reverse, kd_ratio, jsd)
    torch.testing.assert_close(stats["kd"].double(), kd.double().sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats["ce"].double(), ce.double().sum(), rtol=1e-5, atol=1e-5)


def test_identical_teacher_gives_zero_kd_and_no_kd_gradient():
    h, w, _, _, labels = batch()
    h = h.clone().requires_grad_()
    loss = chunked_distill_loss(h, w, h.detach(), w, labels, 1.3, 0.4, 1.0, chunk_rows=16)
    loss.backward()
    assert abs(loss.item()) < 1e-5 and h.grad.abs().max().item() < 1e-5


def test_frozen_head_takes_no_weight_gradient_and_no_grad_mode_computes_none():
    h, w, ht, wt, labels = batch()
    h = h.clone().requires_grad_()
    chunked_distill_loss(h, w, ht, wt, labels).backward()
    assert h.grad is not None and w.grad is None
    calls = []
    mm = torch.Tensor.__matmul__
    torch.Tensor.__matmul__ = lambda a, b: calls.append(1) or mm(a, b)  # count the matmuls: no gradient's
    try:
        with torch.no_grad():
            value = chunked_distill_loss(h, w, ht, wt, labels, chunk_rows=40)
    finally:
        torch.Tensor.__matmul__ = mm
    assert value.grad_fn is None and value.item() > 0 and len(calls) == 2  # the two heads' logits only


def test_definition_equals_trl_gkd_at_beta_0_and_1():
    """TRL's generalized_jsd_loss with beta 0 is KL(teacher || student), with beta 1 KL(student || teacher), both at
    the temperature and not rescaled by T^2, averaged over the labelled tokens: loom's KD term per token, averaged
    the same way (kd_ratio 1). TRL masks on the labels as given; loom's labels are already the next tokens, so the
    same labels serve both."""
    pytest.importorskip("trl", minversion="1.16")
    import trl
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    assert trl.__version__ == "1.16.0"  # the version compared
    h, w, ht, wt, labels = batch(1)
    student, teacher = (h @ w.T).float(), (ht @ wt.T).float()
    for beta, reverse in ((0.0, 0.0), (1.0, 1.0)):
        for temperature in (1.0, 2.0):
            theirs = GKDTrainer.generalized_jsd_loss(
                student[None], teacher[None], labels[None], beta=beta, temperature=temperature
            )
            mine = token_losses(student, teacher, labels, temperature, reverse, 1.0)[0]
            torch.testing.assert_close(mine.sum() / (labels != IGNORE).sum(), theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_and_its_gradients_equal_trl_gkd(beta):
    """distill.divergence jsd at distill.beta: the chunked loss (kd_ratio 1, averaged over the labelled tokens) and
    its gradients with respect to the student's hidden states and head equal TRL 1.16's
    GKDTrainer.generalized_jsd_loss differentiated by autograd on the full logits, at several temperatures (fp32)."""
    pytest.importorskip("trl", minversion="1.16")
    import trl
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    assert trl.__version__ == "1.16.0"  # the version compared
    h, w, ht, wt, labels = (x.float() if x.is_floating_point() else x for x in batch(4))
    teacher = ht @ wt.T
    count = (labels != IGNORE).sum()
    for temperature in (1.0, 2.0, 0.5):
        h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
        theirs = GKDTrainer.generalized_jsd_loss(
            (h1 @ w1.T)[None], teacher[None], labels[None], beta=beta, temperature=temperature
        )
        theirs.backward()
        h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
        mine = chunked_distill_loss(h2, w2, ht, wt, labels, temperature, 0.0, 1.0, chunk_rows=11, jsd=beta)
        (mine / count).backward()
        torch.testing.assert_close(mine / count, theirs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-4, atol=1e-6)


def test_torchtune_forward_kl_convention():
    """torchtune's ForwardKLLoss (its KD recipe's loss, no temperature) is -sum_v p log q averaged over the labelled
    tokens: the cross-entropy of the student against the teacher, i.e. loom's forward KL plus the teacher's entropy,
    a constant for the student (the same gradient). Its recipe mixes (1 - kd_ratio) CE + kd_ratio KD, as loom does.
    torchtune is not installed: its loss is written here from its definition."""
    h, w, ht, wt, labels = batch(2)
    student = (h @ w.T).float().requires_grad_()
    teacher = (ht @ wt.T).float()
    valid = labels != IGNORE
    p = F.softmax(teacher, -1)
    torchtune_kd = -((p * F.log_softmax(student, -1)).sum(-1) * valid).sum() / valid.sum()
    entropy = -((p * F.log_softmax(teacher, -1)).sum(-1) * valid).sum() / valid.sum()
    loss, kd, ce, _ = token_losses(student, teacher, labels, 1.0, 0.0, 0.5)
    torch.testing.assert_close(kd.sum() / valid.sum() + entropy, torchtune_kd)
    ce_mean = F.cross_entropy(student, labels, ignore_index=IGNORE)
    torch.testing.assert_close(loss.sum() / valid.sum(), 0.5 * ce_mean + 0.5 * (torchtune_kd - entropy))
    (g1,) = torch.autograd.grad(kd.sum() / valid.sum(), student)
    (g2,) = torch.autograd.grad(torchtune_kd, student)
    torch.testing.assert_close(g1, g2)


def test_objective_forward_equals_the_definition_on_a_wider_deeper_teacher():
    """The objective on plain models: the teacher's and student's heads meet inside the student's forward (its head
    replaced for the call), and the loss and the student's gradients equal the definition on full logits."""
    from loom.data.loader import MicroBatch
    from loom.methods.distill import Distillation
    from loom.models.llama import Llama
    from loom.models.registry import all_flavors

    base = all_flavors()["debug"].with_(vocab_size=128, max_seq_len=16)
    torch.manual_seed(0)
    student = Llama(base)
    teacher = Llama(base.with_(dim=96, n_layers=3, n_heads=6, n_kv_heads=2, ffn_dim=192)).requires_grad_(
        False
    )
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 128, (2, 16), generator=g)
    labels = torch.randint(0, 128, (2, 16), generator=g)
    labels[:, :5] = IGNORE
    mb = MicroBatch(inputs, labels, torch.arange(16).expand(2, 16), torch.zeros(2, 16, dtype=torch.long))
    objective = Distillation(temperature=2.0, reverse=0.25, kd_ratio=0.75, chunk_rows=5)
    objective.teacher_model = teacher
    loss = objective.forward(student, mb, None)
    loss.backward()
    got = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()
    logits = student(inputs)  # the student's own head is back
    expected = token_losses(
        logits.flatten(0, 1), teacher(inputs).flatten(0, 1), labels.flatten(), 2.0, 0.25, 0.75
    )
    expected[0].sum().backward()
    torch.testing.assert_close(loss, expected[0].sum())
    for n, p in student.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    stats = objective.step_stats()
    torch.testing.assert_close(stats["kd_loss"], expected[1].sum())
    torch.testing.assert_close(stats["ce_loss"], expected[2].sum())


def distill_records(run_dir) -> list[dict]:
    return [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "kd_loss" in r]


def test_embedded_default_and_a_run_dir_teacher_train_from_the_cli(tmp_path):
    """`loom train --training.objective distill` out of the box: the teacher is the initial student (KD 0 at the
    first step, then above 0 as the student moves); then that run's dir as the teacher of a shallower student (its
    newest checkpoint, its shape from its recorded config): KD above 0 from the first step, finite losses."""
    from loom.cli.main import main as loom_main

    cache = tmp_path / "cache"
    train = lambda run, *extra, **kw: loom_main(
        ["train", "--training.objective", "distill", *extra, *tiny_args(tmp_path / run, cache, **kw)]
    )
    assert train("default", **{"training.steps": 3, "checkpoint.at_end": "true"}) in (0, None)
    default = distill_records(tmp_path / "default")
    assert len(default) == 3 and abs(default[0]["kd_loss"]) < 1e-6 and default[-1]["kd_loss"] > 1e-6
    teacher = str(tmp_path / "default")
    assert train("student", "--distill.teacher", teacher, **{"training.steps": 2, "model.n_layers": 1}) in (
        0,
        None,
    )
    student = distill_records(tmp_path / "student")
    assert len(student) == 2 and all(r["kd_loss"] > 1e-4 and math.isfinite(r["loss"]) for r in student)


def test_a_hugging_face_teacher_loads_and_another_vocabulary_is_one_line(tmp_path, capsys):
    """A Hugging Face folder as the teacher and as the student's model.init_from: KD 0 at the first step (the
    teacher's weights read, on the same tokens and positions); a teacher of another vocabulary: exit 2 naming
    distill.teacher."""
    from loom.checkpoint.hf.export import export_hf
    from loom.cli.main import main as loom_main
    from loom.models.llama import Llama
    from loom.models.registry import all_flavors

    for vocab in (384, 512):
        args = all_flavors()["debug"].with_(vocab_size=vocab)
        torch.manual_seed(0)
        export_hf(Llama(args).state_dict(), args, str(tmp_path / f"hf{vocab}"))
    train = lambda run, teacher, *extra: loom_main(
        ["train", "--training.objective", "distill", "--distill.teacher", str(tmp_path / teacher), *extra]
        + tiny_args(tmp_path / run, tmp_path / "cache", **{"training.steps": 1})
    )
    assert train("same", "hf384", "--model.init_from", str(tmp_path / "hf384")) in (0, None)
    (record,) = distill_records(tmp_path / "same")
    assert abs(record["kd_loss"]) < 1e-6 and record["ce_loss"] > 0
    with pytest.raises(SystemExit) as err:
        train("other", "hf512")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err.value.code == 2 and len(lines) == 1 and "distill.teacher" in lines[0], lines


@pytest.mark.slow
def test_resume_mid_run_continues_bitwise(tmp_path):
    """4 steps saved at 2; a copy of the run resumed from step 2 writes steps 3..4 exactly as the uninterrupted run
    did (the default teacher, the initial student, rebuilt before the checkpoint is loaded)."""
    from loom.checkpoint.manager import step_dir_name
    from loom.train.trainer import Trainer

    run = lambda name, **extra: tiny_config(
        tmp_path / name,
        tmp_path / "cache",
        **{
            "training.objective": "distill",
            "training.steps": 4,
            "checkpoint.every": 2,
            "checkpoint.keep": 0,
            "run.deterministic": "true",
            **extra,
        },
    )
    whole = Trainer(run("whole")).fit()
    shutil.copytree(tmp_path / "whole", tmp_path / "part", ignore=shutil.ignore_patterns(".lock"))
    step2 = str(tmp_path / "part" / "checkpoints" / step_dir_name(2))
    resumed = Trainer(run("part", **{"checkpoint.resume": step2, "checkpoint.overwrite": "true"})).fit()
    key = lambda recs: [(r["step"], r["loss"], r["grad_norm"], r["kd_loss"], r["batch_hash"]) for r in recs]
    assert [r["step"] for r in resumed] == [3, 4] and key(resumed) == key(whole[2:])


def test_config_rules(tmp_path):
    """Refused in one line naming the field: the section under another objective, a missing or unrecognized teacher
    folder, the other divergence's field, context / pipeline parallelism, SFT data without per-document attention;
    tensor parallelism is taken."""
    from loom.config.errors import ConfigError
    from loom.methods import check_config
    from loom.methods.distill import objective

    distill = {"training.objective": "distill"}
    with pytest.raises(ConfigError, match="distill.kd_ratio"):
        check_config(tiny_config(**{"distill.kd_ratio": 1.0}))
    with pytest.raises(ConfigError, match="distill.teacher.*folder not found"):
        check_config(tiny_config(**distill, **{"distill.teacher": str(tmp_path / "nope")}))
    with pytest.raises(ConfigError, match="distill.teacher.*neither"):
        check_config(tiny_config(**distill, **{"distill.teacher": str(tmp_path)}))
    with pytest.raises(ConfigError, match="distill.reverse_kl.*distill.divergence kl"):
        check_config(tiny_config(**distill, **{"distill.divergence": "jsd", "distill.reverse_kl": 0.3}))
    with pytest.raises(ConfigError, match="distill.beta.*distill.divergence jsd"):
        check_config(tiny_config(**distill, **{"distill.beta": 0.3}))
    jsd = tiny_config(**distill, **{"distill.divergence": "jsd", "distill.beta": 0.3})
    check_config(jsd)
    assert objective(jsd).jsd == 0.3 and objective(tiny_config(**distill)).jsd is None
    for key in ("parallel.cp", "parallel.pp"):
        with pytest.raises(ConfigError, match=key):
            check_config(tiny_config(**distill, **{key: 2}))
    check_config(
        tiny_config(**distill, **{"parallel.tp": 2})
    )  # vocab-parallel (tests/distributed/test_sft_layouts)
    with pytest.raises(ConfigError, match="data.document_positions"):
        check_config(tiny_config(**distill, **{"distill.data": "sft"}))
    check_config(tiny_config(**distill, **{"distill.data": "sft", "data.document_positions": "true"}))


def test_bf16_autocast_runs_the_heads_in_bf16_and_stays_close():
    """Under bf16 autocast the head matmuls run in bf16 (as the model's own head would), the KL in fp32: close to the
    fp32 definition, and the head's fp32 weight gets an fp32 gradient."""
    h, w, ht, wt, labels = batch(3)
    h, w, ht, wt = h.float(), w.float().requires_grad_(), ht.float(), wt.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_distill_loss(h, w, ht, wt, labels, 1.5, 0.5, 0.5, chunk_rows=9)
    got.backward()
    expected = token_losses(h @ w.T, ht @ wt.T, labels, 1.5, 0.5, 0.5)[0].sum()
    assert got.dtype == torch.float32 and w.grad.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=3e-2, atol=1e-2)

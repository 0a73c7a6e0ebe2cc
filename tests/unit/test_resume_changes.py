"""Resuming with another config (loom.train.resume_changes): every field classified, a must-match change
refused before any weight is read, applied changes really in effect (logged LR, data position, optimizer
groups, loss scale) and printed once, and metrics.jsonl holding each step once after a resume."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil

import pytest
import torch

from loom.checkpoint.manager import step_dir_name
from loom.cli.main import main as loom_main
from loom.config import build_config
from loom.config.errors import UserError
from loom.config.load import all_keys
from loom.config.sections import Config, OptimizerConfig, all_sections
from loom.data.loader import Loader, Windows
from loom.data.token_file import TokenFile, TokenFileWriter
from loom.metrics.logger import MetricsLogger, rewind_metrics
from loom.train import resume_changes as rc
from loom.train.precision import LossScaler
from loom.train.schedule import SchedulerParts, lr_factor
from tests.tiny import tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, EVERY = 30, 10


# ---- the classification ------------------------------------------------------------------------------


def test_every_config_field_is_classified():
    """A field added to loom/config/sections.py fails here until its opt() says must match, applied or free."""
    fields = [f"{s}.{f.name}" for s, cls in all_sections().items() for f in dataclasses.fields(cls)]
    assert list(rc.rules()) == fields and sorted(fields) == sorted(all_keys())
    assert rc.unclassified() == []
    assert {kind for kind, _ in rc.rules().values()} == {rc.MUST_MATCH, rc.APPLIED, rc.FREE}
    assert all(why for _, why in rc.rules().values())


@pytest.mark.parametrize(
    "key,kind",
    [
        ("model.flavor", rc.MUST_MATCH),
        ("model.n_layers", rc.MUST_MATCH),
        ("model.vocab_size", rc.MUST_MATCH),
        ("model.tie_embeddings", rc.MUST_MATCH),
        ("model.moe_experts", rc.MUST_MATCH),
        ("model.moe_ffn_dim", rc.MUST_MATCH),
        ("data.tokenizer", rc.MUST_MATCH),
        ("data.source", rc.MUST_MATCH),
        ("run.seed", rc.MUST_MATCH),
        ("optimizer.name", rc.MUST_MATCH),
        ("optimizer.lr", rc.APPLIED),
        ("optimizer.schedule", rc.APPLIED),
        ("training.steps", rc.APPLIED),
        ("training.seq_len", rc.APPLIED),
        ("training.global_batch_size", rc.APPLIED),
        ("training.dtype", rc.APPLIED),
        ("training.eval_every", rc.APPLIED),
        ("model.moe_top_k", rc.APPLIED),
        ("model.attention", rc.FREE),
        ("model.fused_loss", rc.FREE),
        ("parallel.tp", rc.FREE),
        ("checkpoint.every", rc.FREE),
        ("metrics.every", rc.FREE),
        ("run.dir", rc.FREE),
        ("training.micro_batch_size", rc.FREE),
        ("optimizer.implementation", rc.FREE),
    ],
)
def test_classification_of_key_fields(key, kind):
    assert rc.kind_of(key) == kind


def test_docs_resume_md_is_current():
    with open(os.path.join(ROOT, "docs", "resume.md")) as fh:
        assert fh.read().strip() == rc.markdown().strip(), (
            "regenerate: python -m loom.train.resume_changes > docs/resume.md"
        )


# ---- comparing two configs (no training) ---------------------------------------------------------------


def with_(cfg: Config, **values) -> Config:
    cfg = copy.deepcopy(cfg)
    for key, value in values.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


BASE = with_(Config(), training__steps=30)


def test_applied_changes_make_the_one_printed_line():
    new = with_(BASE, optimizer__lr=0.01, training__steps=40)
    changes = rc.compare(rc.config_values(BASE), new, folder="ck", step=20)
    # in the order of loom/config/sections.py
    assert changes.line() == "resuming with changes: training.steps 30 -> 40, optimizer.lr 0.001 -> 0.01"


def test_free_changes_are_silent():
    new = with_(
        BASE,
        parallel__tp=2,
        checkpoint__every=5,
        metrics__every=1,
        model__attention="flash",
        run__dir="elsewhere",
        training__micro_batch_size=4,
    )
    assert rc.compare(rc.config_values(BASE), new, folder="ck", step=20).line() is None


def test_must_match_changes_name_each_field_old_and_new():
    new = with_(BASE, model__n_layers=4, model__flavor="debug_moe", run__seed=7, optimizer__lr=0.01)
    with pytest.raises(rc.ResumeMismatch) as err:
        rc.compare(rc.config_values(BASE), new, folder="runs/a/ck", step=20)
    msg = str(err.value)
    assert "\n" not in msg and "runs/a/ck (step 20)" in msg
    for part in ("run.seed 0 -> 7", "model.flavor debug -> debug_moe", "model.n_layers 0 -> 4"):
        assert part in msg
    assert "optimizer.lr" not in msg  # an applied change is no reason to refuse


def test_another_spelling_of_the_same_model_is_no_refusal():
    new = with_(BASE, model__n_layers=2)  # debug's own count
    diff = rc.model_difference(rc.config_values(BASE), new)
    assert diff == []
    changes = rc.compare(rc.config_values(BASE), new, folder="ck", step=20, model_difference=lambda: diff)
    assert changes.line() == "resuming with changes: model.n_layers 0 -> 2 (the same model)"
    assert [c.key for c in rc.model_difference(rc.config_values(BASE), with_(BASE, model__n_layers=3))] == [
        "model (n_layers)"
    ]


def test_fewer_steps_than_the_checkpoint_is_refused():
    with pytest.raises(rc.ResumeMismatch, match=r"training.steps = 10: .* at step 20; allowed >= 20"):
        rc.compare(rc.config_values(BASE), with_(BASE, training__steps=10), folder="ck", step=20)
    assert (
        rc.compare(rc.config_values(BASE), with_(BASE, training__steps=20), folder="ck", step=20).line()
        == "resuming with changes: training.steps 30 -> 20"
    )


def test_a_moved_tokenizer_file_with_the_same_bytes_is_the_same(tmp_path):
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text('{"x": 1}')
    b.write_text('{"x": 1}')
    c.write_text('{"x": 2}')
    old = rc.config_values(with_(BASE, data__tokenizer=str(a)))
    assert rc.compare(old, with_(BASE, data__tokenizer=str(b)), folder="ck", step=1).line() is None
    with pytest.raises(rc.ResumeMismatch, match="data.tokenizer"):
        rc.compare(old, with_(BASE, data__tokenizer=str(c)), folder="ck", step=1)


def test_a_recorded_tokenizer_copy_and_init_from_path_are_no_change(tmp_path, monkeypatch):
    """A checkpoint records the run dir's tokenizer copy (a folder) and absolute paths
    (loom.train.run_dir.record_run_files): the file the run started from, and the same folder given relative to
    this directory, are the same."""
    monkeypatch.chdir(tmp_path)
    os.makedirs("copy")
    os.makedirs("hf")
    (tmp_path / "copy" / "tokenizer.json").write_text('{"x": 1}')
    (tmp_path / "tok.json").write_text('{"x": 1}')
    old = rc.config_values(
        with_(BASE, data__tokenizer=str(tmp_path / "copy"), model__init_from=str(tmp_path / "hf"))
    )
    new = with_(BASE, data__tokenizer="tok.json", model__init_from="hf")
    assert rc.compare(old, new, folder="ck", step=1, model_difference=lambda: []).line() is None
    (tmp_path / "tok.json").write_text('{"x": 2}')
    with pytest.raises(rc.ResumeMismatch, match="data.tokenizer"):
        rc.compare(old, new, folder="ck", step=1)


def test_notes_where_a_change_is_not_exact():
    line = rc.compare(rc.config_values(BASE), with_(BASE, training__seq_len=128), folder="ck", step=1).line()
    assert line.startswith("resuming with changes: training.seq_len 256 -> 128 (not exact:")


# ---- applying: LR schedule, optimizer groups, loss scale, data position (units) ---------------------------


@pytest.mark.filterwarnings(
    "ignore:Detected call of `lr_scheduler.step\\(\\)` before"
)  # no optimizer steps here
def test_scheduler_takes_only_its_position_from_a_checkpoint():
    p = torch.nn.Parameter(torch.zeros(2, 2))

    class Parts:
        def __init__(self, cfg):
            self.optimizers = [torch.optim.AdamW([p], lr=cfg.lr)]

    old = OptimizerConfig(lr=1e-3, warmup_steps=1)
    a = SchedulerParts(Parts(old), 30, old)
    for _ in range(20):
        a.step()
    state = json.loads(json.dumps(a.state_dict()))

    same = SchedulerParts(Parts(old), 30, old)
    same.load_state_dict(state)  # unchanged config: bitwise the LR the saved run would have stepped with
    assert (
        same.schedulers[0].optimizer.param_groups[0]["lr"] == a.schedulers[0].optimizer.param_groups[0]["lr"]
    )
    same.step()
    a.step()
    assert (
        same.schedulers[0].optimizer.param_groups[0]["lr"] == a.schedulers[0].optimizer.param_groups[0]["lr"]
    )

    new = OptimizerConfig(lr=1e-2, warmup_steps=1, schedule="linear")
    b = SchedulerParts(Parts(new), 40, new)
    b.load_state_dict(state)
    assert b.schedulers[0].optimizer.param_groups[0]["lr"] == 1e-2 * lr_factor(20, 40, new)
    b.step()
    assert b.schedulers[0].optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * lr_factor(21, 40, new))


def test_optimizer_groups_take_this_runs_betas_eps_and_decay():
    from loom.train.optimizer import OptimizerParts

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    parts = OptimizerParts([model], OptimizerConfig(), torch.device("cpu"))
    rc.apply_optimizer_config(parts, OptimizerConfig(betas=[0.8, 0.9], eps=1e-6, weight_decay=0.05))
    decay, no_decay = parts.optimizers[0].param_groups
    assert decay["betas"] == (0.8, 0.9) and decay["eps"] == 1e-6 and decay["weight_decay"] == 0.05
    assert no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize(
    "old_dtype,new_dtype,old_init,expect",
    [
        ("float16", "float32", 2.0**16, 1.0),  # a float16 checkpoint's scale must not multiply fp32 gradients
        ("float32", "float16", 2.0**16, 2.0**10),  # into float16: the scale starts at loss_scale_init
        ("float16", "float16", 2.0**16, 2.0**10),  # another loss_scale_init: the scale restarts from it
        ("float16", "float16", 2.0**10, 512.0),  # unchanged: the checkpoint's dynamic scale goes on
    ],
)
def test_loss_scale_follows_this_runs_dtype(old_dtype, new_dtype, old_init, expect):
    saved = LossScaler(old_dtype == "float16", old_init, 1000)
    saved.scale, saved.good_steps, saved.skipped = (512.0, 7, 3) if old_dtype == "float16" else (1.0, 0, 0)
    training = with_(BASE, training__dtype=new_dtype, training__loss_scale_init=2.0**10).training
    scaler = LossScaler(new_dtype == "float16", training.loss_scale_init, 1000)
    scaler.load_state_dict(saved.state_dict())
    old = rc.config_values(with_(BASE, training__dtype=old_dtype, training__loss_scale_init=old_init))
    rc.restore_loss_scale(scaler, old, training)
    assert scaler.scale == expect and scaler.skipped == saved.skipped


def counting_file(path, n_tokens: int) -> TokenFile:
    """Token i is i, so a window's first token tells where it starts."""
    w = TokenFileWriter(str(path), eos_id=65535, vocab_size=65536, tokenizer="test-identity")
    w.add(torch.arange(n_tokens - 1))
    w.close()
    return TokenFile(str(path))


def loader(tf, seq_len, micro_batch) -> Loader:
    return Loader(
        [Windows(tf, seq_len, 0.0, "count")],
        [1.0],
        seed=1,
        eos_id=65535,
        dp_rank=0,
        dp_size=1,
        micro_batch=micro_batch,
        accumulation=1,
    )


def starts(step) -> list[int]:
    return step.micro_batches[0].inputs[:, 0].tolist()


def test_another_global_batch_continues_the_same_sample_order(tmp_path):
    tf = counting_file(tmp_path / "c.bin", 64 * 8 + 1)  # 64 windows of 8
    straight = loader(tf, 8, 4)
    expected = [s for _ in range(6) for s in starts(straight.next_step())]
    first = loader(tf, 8, 4)
    got = [s for _ in range(2) for s in starts(first.next_step())]
    bigger = loader(tf, 8, 8)  # global batch 4 -> 8
    bigger.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += [s for _ in range(2) for s in starts(bigger.next_step())]
    assert got == expected


def test_another_seq_len_keeps_the_epoch_fraction(tmp_path):
    tf = counting_file(tmp_path / "c.bin", 64 * 8 + 1)  # 64 windows of 8, 128 of 4, 32 of 16
    first = loader(tf, 8, 4)
    for _ in range(24):  # 96 windows: one epoch and a half
        first.next_step()
    state = first.state_dict()
    assert state["seq_len"] == 8 and state["counts"] == [96]
    half = loader(tf, 4, 4)
    half.load_state_dict(state)
    assert half.counts == [192] and half.consumed == 192  # epoch 1, half way: 128 + 64
    double = loader(tf, 16, 4)
    double.load_state_dict(state)
    assert double.counts == [48]  # 32 + 16
    old_checkpoint = {k: v for k, v in state.items() if k != "seq_len"}  # written before seq_len was saved
    half = loader(tf, 4, 4)
    half.load_state_dict(rc.loader_state(old_checkpoint, {"training.seq_len": 8}))
    assert half.counts == [192]
    # the second half of epoch 1 at the new length: windows the first half of the epoch did not take
    seen = {w for _ in range(16) for w in starts(half.next_step())}
    assert len(seen) == 64 and all(s % 4 == 0 for s in seen)


# ---- metrics.jsonl ---------------------------------------------------------------------------------------


def test_rewind_metrics_keeps_steps_up_to_n_atomically(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3, 4)] + [json.dumps({"note": "x"})]
    path.write_text("\n".join(lines) + '\n{"step": 5, "lo')  # a write cut short by a kill
    assert rewind_metrics(str(path), 2) == 3
    assert [json.loads(x).get("step") for x in path.read_text().splitlines()] == [1, 2, None]
    assert rewind_metrics(str(path), 2) == 0
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # no temporary file left
    assert rewind_metrics(str(tmp_path / "none.jsonl"), 3) == 0


def test_metrics_logger_rewind_inside_a_run(tmp_path):
    logger = MetricsLogger(str(tmp_path), 10, tensorboard=False, progress=False, start_step=0)
    rec = {
        "loss": 1.0,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens_per_s": 1.0,
        "tokens_per_s_per_device": 1.0,
        "mem_gib": 0.0,
    }
    for s in range(1, 6):
        logger.log({"step": s, **rec})
    assert logger.rewind(3) == 2
    for s in (4, 5, 6):
        logger.log({"step": s, **rec})
    logger.close()
    with open(tmp_path / "metrics.jsonl") as fh:
        assert [json.loads(x)["step"] for x in fh] == [1, 2, 3, 4, 5, 6]


# ---- resumed runs (in process, the tiny debug model) ------------------------------------------------
# All marked slow: they share a 30-step run; the quick loop (-m "not slow") keeps the unit tests above.


def args(run_dir, cache, **extra) -> list[str]:
    return tiny_args(
        run_dir,
        cache,
        **{
            "run.seed": 3,
            "run.deterministic": "true",
            "training.steps": STEPS,
            "training.global_batch_size": 4,
            "checkpoint.every": EVERY,
            "checkpoint.keep": 0,
            "checkpoint.at_end": None,
            "metrics.progress": "false",
            **extra,
        },
    )


def records(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def ckpt(run_dir, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", step_dir_name(step))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("token_cache"))


@pytest.fixture(scope="module")
def base(tmp_path_factory, cache) -> str:
    """A finished run of 30 steps: checkpoints at 10, 20, 30, metrics every step."""
    run_dir = str(tmp_path_factory.mktemp("base") / "run")
    assert loom_main(["train", *args(run_dir, cache)]) == 0
    return run_dir


def copy_run(base, tmp_path) -> str:
    dest = str(tmp_path / "run")
    shutil.copytree(base, dest, ignore=shutil.ignore_patterns(".lock"))
    return dest


def resume(run_dir, cache, capsys, **extra) -> tuple[list[dict], str]:
    capsys.readouterr()
    assert loom_main(["train", *args(run_dir, cache, **extra)]) == 0
    out = capsys.readouterr().out
    return records(run_dir), out


def changes_line(out: str) -> str | None:
    lines = [x for x in out.splitlines() if x.startswith("resuming with changes: ")]
    assert len(lines) <= 1, out
    return lines[0] if lines else None


@pytest.mark.slow
def test_resume_from_step_20_keeps_each_step_once_and_continues_bitwise(base, cache, tmp_path, capsys):
    run_dir = copy_run(base, tmp_path)
    assert [r["step"] for r in records(run_dir)] == list(range(1, 31))
    recs, out = resume(
        run_dir, cache, capsys, **{"checkpoint.resume": ckpt(run_dir, 20), "checkpoint.overwrite": "true"}
    )
    assert "resumed from step 20" in out and "dropped 10 record(s) after step 20" in out
    assert changes_line(out) is None  # nothing changed, nothing printed
    assert [r["step"] for r in recs] == list(range(1, 31))  # each step exactly once
    # the same config continues exactly like the uninterrupted run (the re-derived LR and groups are bitwise)
    key = [(r["step"], r["loss"], r["grad_norm"], r["lr"], r["batch_hash"]) for r in recs]
    assert key == [(r["step"], r["loss"], r["grad_norm"], r["lr"], r["batch_hash"]) for r in records(base)]


def expected_lr(step: int, total: int, **opt) -> float:
    cfg = OptimizerConfig(warmup_steps=1, **opt)
    return cfg.lr * lr_factor(step - 1, total, cfg)  # metrics' step is 1-based


@pytest.mark.slow
def test_a_changed_lr_is_applied_and_printed(base, cache, tmp_path, capsys):
    run_dir = copy_run(base, tmp_path)
    recs, out = resume(
        run_dir,
        cache,
        capsys,
        **{"checkpoint.resume": ckpt(run_dir, 20), "checkpoint.overwrite": "true", "optimizer.lr": 0.01},
    )
    assert changes_line(out) == "resuming with changes: optimizer.lr 0.001 -> 0.01"
    assert out.count("resuming with changes") == 1
    assert [r["step"] for r in recs] == list(range(1, 31))
    for r in recs[20:]:
        assert r["lr"] == pytest.approx(expected_lr(r["step"], STEPS, lr=0.01), rel=1e-12)
    assert recs[19]["lr"] == pytest.approx(expected_lr(20, STEPS))  # the steps before stay as they were
    assert recs[20]["loss"] == records(base)[20]["loss"]  # step 21's forward ran on the same weights and data
    assert recs[21]["loss"] != records(base)[21]["loss"]  # ... its update used the new LR


@pytest.mark.slow
def test_more_steps_and_another_schedule_are_applied(base, cache, tmp_path, capsys):
    run_dir = copy_run(base, tmp_path)
    recs, out = resume(run_dir, cache, capsys, **{"training.steps": 40, "optimizer.schedule": "linear"})
    assert (
        changes_line(out)
        == "resuming with changes: training.steps 30 -> 40, optimizer.schedule cosine -> linear"
    )
    assert [r["step"] for r in recs] == list(range(1, 41))
    for r in recs[30:]:
        assert r["lr"] == pytest.approx(expected_lr(r["step"], 40, schedule="linear"), rel=1e-12)
    assert recs[-1]["lr"] == pytest.approx(1e-4)  # the new schedule ends at min_lr_ratio x peak


@pytest.mark.slow
def test_weight_decay_and_betas_reach_the_optimizer(base, cache, tmp_path):
    from loom.train.trainer import Trainer

    run_dir = copy_run(base, tmp_path)
    cfg = build_config(
        None,
        dict(
            a[2:].split("=", 1)
            for a in args(
                run_dir,
                cache,
                **{"optimizer.weight_decay": 0.02, "optimizer.betas": "0.8,0.9", "optimizer.eps": 1e-6},
            )
        ),
    )
    trainer = Trainer(cfg)
    trainer.resume()
    assert trainer.step == STEPS
    decay, no_decay = trainer.optimizer.param_groups
    assert (decay["weight_decay"], decay["betas"], decay["eps"]) == (0.02, (0.8, 0.9), 1e-6)
    assert no_decay["weight_decay"] == 0.0


@pytest.mark.slow
def test_a_changed_seq_len_goes_on_from_the_same_data_position(base, cache, tmp_path, capsys):
    run_dir = copy_run(base, tmp_path)
    recs, out = resume(
        run_dir,
        cache,
        capsys,
        **{"checkpoint.resume": ckpt(run_dir, 20), "checkpoint.overwrite": "true", "training.seq_len": 16},
    )
    assert changes_line(out).startswith("resuming with changes: training.seq_len 32 -> 16 (not exact: ")
    assert [r["step"] for r in recs] == list(range(1, 31))
    assert [r["tokens"] for r in recs[19:]] == [20 * 4 * 32 + i * 4 * 16 for i in range(11)]
    with open(os.path.join(ckpt(run_dir, 30), "trainer_state.json")) as fh:
        loader_state = json.load(fh)["loader"]
    # twice the windows
    assert loader_state["seq_len"] == 16 and loader_state["consumed"] == 2 * 20 * 4 + 10 * 4


@pytest.mark.slow
def test_a_changed_global_batch_size_continues_the_sample_order(base, cache, tmp_path, capsys):
    run_dir = copy_run(base, tmp_path)
    recs, out = resume(
        run_dir,
        cache,
        capsys,
        **{
            "checkpoint.resume": ckpt(run_dir, 20),
            "checkpoint.overwrite": "true",
            "training.global_batch_size": 8,
        },
    )
    assert changes_line(out) == "resuming with changes: training.global_batch_size 4 -> 8"
    assert [r["tokens"] for r in recs[19:]] == [20 * 4 * 32 + i * 8 * 32 for i in range(11)]
    with open(os.path.join(ckpt(run_dir, 30), "trainer_state.json")) as fh:
        assert json.load(fh)["loader"]["consumed"] == 20 * 4 + 10 * 8


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra,named",
    [
        ({"model.n_layers": 3}, ["model.n_layers 0 -> 3"]),
        ({"model.flavor": "debug_moe"}, ["model.flavor debug -> debug_moe"]),
        (
            {"model.vocab_size": 512, "model.tie_embeddings": "true"},
            ["model.vocab_size 0 -> 512", "model.tie_embeddings flavor -> true"],
        ),
        ({"model.moe_experts": 2}, ["model.moe_experts 0 -> 2"]),
    ],
)
def test_a_shape_change_is_one_line_exit_2_before_any_worker(
    base, cache, tmp_path, capsys, monkeypatch, extra, named
):
    import loom.cli.train

    def no_worker(argv):
        raise AssertionError("the precheck must refuse before a worker starts")

    monkeypatch.setattr(loom.cli.train, "run_worker", no_worker)
    run_dir = copy_run(base, tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        loom_main(["train", *args(run_dir, cache, **extra)])
    assert code.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("loom: error: cannot resume from ")
    assert ckpt(run_dir, 30) + " (step 30)" in err
    for part in named:
        assert part in err


@pytest.mark.slow
def test_the_trainer_refuses_a_shape_change_before_reading_weights(base, cache, tmp_path, monkeypatch):
    """Without the CLI's precheck (the Python API, torchrun -m loom.train), the trainer checks before loading."""
    from loom.checkpoint.manager import CheckpointManager
    from loom.config.errors import SharedError
    from loom.train.trainer import Trainer

    def no_load(*a, **k):
        raise AssertionError("weights read before the config check")

    run_dir = copy_run(base, tmp_path)
    cfg = build_config(None, dict(a[2:].split("=", 1) for a in args(run_dir, cache, **{"model.n_layers": 3})))
    trainer = Trainer(cfg)
    monkeypatch.setattr(CheckpointManager, "load", no_load)
    with pytest.raises(SharedError, match=r"model.n_layers 0 -> 3") as err:
        trainer.resume()
    assert isinstance(err.value, UserError)


@pytest.mark.slow
def test_precheck_finds_the_checkpoint_auto_picks(base, cache, tmp_path):
    run_dir = copy_run(base, tmp_path)
    cfg = build_config(None, dict(a[2:].split("=", 1) for a in args(run_dir, cache, **{"run.seed": 4})))
    with pytest.raises(rc.ResumeMismatch, match=r"step_00000030 \(step 30\): run.seed 3 -> 4"):
        rc.check_before_start(cfg)
    cfg.checkpoint.resume = ckpt(run_dir, 10)
    with pytest.raises(rc.ResumeMismatch, match=r"step_00000010 \(step 10\): run.seed 3 -> 4"):
        rc.check_before_start(cfg)
    cfg.checkpoint.resume = "none"
    rc.check_before_start(cfg)  # a fresh start compares nothing


def test_tensorboard_hides_the_steps_a_resume_writes_again(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rec = {
        "loss": 1.0,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens_per_s": 1.0,
        "tokens_per_s_per_device": 1.0,
        "mem_gib": 0.0,
    }
    first = MetricsLogger(str(tmp_path), 6, tensorboard=True, progress=False, start_step=0)
    for s in range(1, 6):
        first.log({"step": s, **rec, "loss": 1.0})
    first.close()
    resumed = MetricsLogger(str(tmp_path), 6, tensorboard=True, progress=False, start_step=3)  # from step 3
    for s in (4, 5, 6):
        resumed.log({"step": s, **rec, "loss": 2.0})
    resumed.rewind(5)  # a rollback to step 5
    resumed.log({"step": 6, **rec, "loss": 3.0})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (1, 1.0),
        (2, 1.0),
        (3, 1.0),
        (4, 2.0),
        (5, 2.0),
        (6, 3.0),
    ]
    with open(tmp_path / "metrics.jsonl") as fh:  # the resume itself rewinds the file (Trainer.resume)
        assert [json.loads(x)["step"] for x in fh] == [1, 2, 3, 4, 5, 4, 5, 6]

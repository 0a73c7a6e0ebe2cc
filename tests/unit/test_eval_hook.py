"""``training.eval_every`` also runs a Python callable (``training.eval_hook``) and lm-evaluation-harness tasks
(``training.eval_tasks``) on the live model; their numbers reach metrics.jsonl as ``eval/<name>``. They run in eval
mode, leave the random generators and the training mode as they found them, and a wrong setting stops the run
before its first step."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys

import numpy as np
import pytest
import torch

from loom.config.errors import ConfigError, UserError
from loom.eval.hook import EvalContext, import_callable, training_evals
from tests.tiny import tiny_config

CALLS: list[dict] = []


def probe(ctx: EvalContext) -> dict:
    """A generation-free eval: the log-likelihood of a fixed text through the harness backend, plus what the
    context says; it draws from every random generator, which the run must not notice."""
    torch.rand(3), random.random(), np.random.rand()
    CALLS.append({"step": ctx.step, "training": ctx.model.training, "main": ctx.is_main})
    ((logp, _),) = ctx.harness().loglikelihood([_Request(("def main():", "\n    return 0"))])
    return {"loglik": logp, "tokens": torch.tensor(len(ctx.tokenizer.encode("def main():")))}


def not_a_dict(ctx: EvalContext):
    return [1.0]


class _Request:
    def __init__(self, args):
        self.args = args


def config(tmp_path, **overrides):
    return tiny_config(
        tmp_path / "run",
        tmp_path / "cache",
        **{
            "run.device": "cpu",
            "training.eval_every": 2,
            "training.eval_batches": 1,
            "metrics.progress": "false",
            "training.eval_hook": "tests.unit.test_eval_hook:probe",
            **overrides,
        },
    )


def records(tmp_path) -> list[dict]:
    with open(tmp_path / "run" / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh]


def test_the_hook_is_logged_at_every_validation_point(tmp_path):
    from loom.train.trainer import Trainer

    CALLS.clear()
    Trainer(config(tmp_path)).fit()
    recs = records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [s["step"] for s in CALLS] == [2, 4] and not any(s["training"] for s in CALLS) and CALLS[0]["main"]
    for r in recs:
        evaluated = r["step"] % 2 == 0
        assert ("eval/loglik" in r) == evaluated and ("eval/tokens" in r) == evaluated
        if evaluated:
            assert r["eval/tokens"] == 11.0 and r["eval/loglik"] < 0 and r["val_loss"] is not None
    assert recs[1]["eval/loglik"] != recs[3]["eval/loglik"]  # the model trained in between


def test_the_hook_leaves_random_generators_and_training_mode_as_found(tmp_path):
    from loom.train.trainer import Trainer

    trainer = Trainer(config(tmp_path))
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    values = trainer.run_evals()
    assert set(values) == {"eval/loglik", "eval/tokens"}
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])
    assert all(part.training for part in trainer.parts)


def test_harness_tasks_are_logged(tmp_path):
    pytest.importorskip("lm_eval")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from loom.train.trainer import Trainer
    from tests.unit.test_eval_harness import write_tasks

    tasks = write_tasks(tmp_path / "tasks")
    Trainer(
        config(
            tmp_path,
            **{
                "training.eval_hook": None,
                "training.eval_tasks": "loomtest_mc,loomtest_roll",
                "training.eval_tasks_include": tasks,
                "training.eval_tasks_limit": 2,
                "training.steps": 2,
            },
        )
    ).fit()
    (last,) = [r for r in records(tmp_path) if r["step"] == 2]
    assert 0 <= last["eval/loomtest_mc/acc"] <= 1 and last["eval/loomtest_roll/bits_per_byte"] > 0
    assert last["eval/loomtest_mc/sample_len"] == 2


def test_wrong_settings_stop_the_run_before_it_starts(tmp_path, monkeypatch):
    for spec, expected in (
        ("no_colon", "expected 'module:function'"),
        ("no.such.module:f", "cannot be imported"),
        ("tests.unit.test_eval_hook:missing", "has no 'missing'"),
        ("tests.unit.test_eval_hook:CALLS", "is not callable"),
    ):
        with pytest.raises(ConfigError, match=expected):
            training_evals(config(tmp_path, **{"training.eval_hook": spec}), "run", True)
    from loom.methods import check_config

    with pytest.raises(ConfigError, match=r"not with parallel.pp > 1 or parallel.cp > 1"):
        check_config(config(tmp_path, **{"parallel.pp": 2}))
    assert training_evals(config(tmp_path, **{"training.eval_every": 0}), "run", True) is None
    if importlib.util.find_spec("lm_eval"):  # an unknown task names training's field, not loom eval's option
        with pytest.raises(
            ConfigError, match=r"^training.eval_tasks = 'no_such_task_x': no such task in lm-eval"
        ):
            training_evals(config(tmp_path, **{"training.eval_tasks": "no_such_task_x"}), "run", True)
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(
        UserError,
        match=r"^training.eval_tasks needs the 'lm-eval' package \(pip install "
        r"'loom-train\[eval\]'\)$",
    ):
        training_evals(config(tmp_path, **{"training.eval_tasks": "hellaswag"}), "run", True)


def test_a_hook_must_return_numbers(tmp_path):
    from loom.train.trainer import Trainer

    trainer = Trainer(config(tmp_path, **{"training.eval_hook": "tests.unit.test_eval_hook:not_a_dict"}))
    with pytest.raises(UserError, match="returned a list; it must return a dict of names to numbers"):
        trainer.run_evals()
    assert import_callable("tests.unit.test_eval_hook:probe") is probe


def test_on_two_ranks(tmp_path):
    """FSDP2 and tensor parallelism: every rank runs the hook (the sharded forwards meet in their collectives) and
    rank 0 logs what a single process logs for the same weights. Data parallelism runs generate_until tasks; on a
    sharded model they are refused before the first step."""
    pytest.importorskip("lm_eval")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from tests.distributed.harness import run_jobs, run_one
    from tests.tiny import tiny_overrides
    from tests.unit.test_eval_harness import GEN, write_tasks

    tasks = write_tasks(tmp_path / "tasks")

    def job(name, **extra):
        return tiny_overrides(
            tmp_path / name,
            tmp_path / "cache",
            **{
                "training.steps": 2,
                "training.eval_every": 2,
                "training.eval_batches": 1,
                "metrics.progress": "false",
                "training.eval_hook": "tests.unit.test_eval_hook:probe",
                **extra,
            },
        )

    generating = {
        "training.eval_hook": None,
        "training.eval_tasks": "loomtest_gen",
        "training.eval_tasks_include": tasks,
    }
    single = run_one(job("single"))[-1]
    fsdp, tp, ddp, refused = run_jobs(
        2,
        [
            job("fsdp", **{"parallel.dp_shard": 2}),
            job("tp", **{"parallel.tp": 2, "parallel.dp_shard": 1}),
            job("ddp", **{"parallel.dp_replicate": 2, "parallel.dp_shard": 1}, **generating),
            job("refused", **{"parallel.dp_shard": 2}, **generating),
        ],
        str(tmp_path),
    )
    for result in (fsdp, tp):
        assert "error" not in result, result.get("error")
        last = result["records"][-1]
        assert last["eval/tokens"] == single["eval/tokens"]
        assert last["eval/loglik"] == pytest.approx(single["eval/loglik"], rel=1e-4)
    assert "error" not in ddp, ddp.get("error")
    assert ddp["records"][-1]["eval/loomtest_gen/sample_len"] == len(GEN)
    assert "training.eval_tasks = 'loomtest_gen': generate text" in refused["error"]
    assert not os.path.exists(tmp_path / "refused" / "metrics.jsonl")

"""GRPO on a GPU (skipped without CUDA): the engine runs on the trainer's module with CUDA graphs; after GRPO
updates in bfloat16 its cached decode logits equal the plain model's (float32 weights, both under the run's
autocast), the recipe's run raises the greedy accuracy as on the CPU, and asynchronous GRPO's sampler process
samples on the refreshed weights."""

from __future__ import annotations

import pathlib

import pytest
import torch

from loom.methods.grpo import GroupRelative
from loom.train.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def recipe(tmp_path, **overrides):
    from loom.config import build_config

    return build_config(
        str(ROOT / "recipes" / "grpo_debug.toml"),
        {
            "run.dir": str(tmp_path / "run"),
            "run.device": "cuda",
            "metrics.progress": "false",
            "metrics.tensorboard": "false",
            "checkpoint.at_end": "false",
            **overrides,
        },
    )


def test_engine_with_cuda_graphs_follows_the_updates(tmp_path):
    """The rollout engine keeps its caches and decode graphs between steps (grpo.keep_cache): after more GRPO
    updates, a replay of the graph captured at the first rollout gives the plain model's logits (the capture casts
    the float32 weights inside the graph, not from autocast's cache of that moment)."""
    cfg = recipe(
        tmp_path,
        **{
            "training.steps": "8",
            "grpo.warmup_steps": "4",
            "optimizer.warmup_steps": "2",
            "training.dtype": "bfloat16",
            "training.eval_every": "0",
            "training.eval_hook": "",
            "grpo.beta": "0.04",
        },
    )
    trainer = Trainer(cfg, objective=GroupRelative(cfg))
    records = trainer.fit()
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records) and "reward" in records[-1]
    engine, model = trainer.objective.rollouts.generator.engine, trainer.parts[0]
    assert engine.cuda_graphs and engine.caches and (engine.batch, 1) in engine._graphs  # parked, not freed
    graph = engine._graphs[(engine.batch, 1)]
    rows, device = engine.batch, trainer.device
    tokens = torch.tensor([trainer.tokenizer.encode("3+4=7")] * rows, device=device)  # (B, 5)
    model.eval()
    with torch.no_grad(), trainer.engine.autocast():
        plain = model(tokens[:1])[:, -1].float()
        engine.allocate(rows, tokens.shape[1])
        engine.prefill(tokens[:, :-1], torch.full((rows,), 3, device=device))
        cached = engine.step(tokens[:, -1:], torch.full((rows, 1), 4, device=device))[:, 0].float()
        assert engine._graphs[(rows, 1)] is graph  # the replay of the first rollout's capture
        engine.release()
    torch.testing.assert_close(cached, plain.expand_as(cached), rtol=2e-2, atol=2e-2)


def test_recipe_raises_the_accuracy(tmp_path):
    records = Trainer(cfg := recipe(tmp_path, **{"metrics.every": "1"}), objective=GroupRelative(cfg)).fit()
    accuracy = {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}
    assert 1 - accuracy[200] < (1 - accuracy[120]) * 2 / 3, accuracy


def test_the_sampler_process_samples_the_refreshed_weights(tmp_path):
    """grpo.sampler_process on the last GPU (cuda:1 beside the trainer's cuda:0 on two): the child's generator
    (compiled, CUDA graphs) on the snapshot it shares through CUDA IPC, refreshed in place after each step: step 3's
    and step 4's sampler log-probabilities are those of the weights one step back, far from the next weights'; no
    child is left."""
    import multiprocessing

    from tests.unit.test_grpo_async import sampler_gaps

    device = f"cuda:{torch.cuda.device_count() - 1}"
    gaps = sampler_gaps(
        tmp_path,
        **{
            "run.device": "cuda",
            "training.dtype": "float32",
            "training.compile": True,  # the child compiles its generator's blocks too
            "grpo.sampler_device": device,
            "grpo.sampler_process": True,
        },
    )
    assert all(same < 2e-2 and other > max(10 * same, 5e-2) for same, other in gaps), gaps
    assert not multiprocessing.active_children()

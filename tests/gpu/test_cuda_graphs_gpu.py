"""training.cuda_graphs on one GPU: the compiled blocks replayed as CUDA graphs give the losses of the same compiled
run without graphs (fp32, with and without accumulation, a validation pass in between)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.tiny import tiny_overrides

pytestmark = pytest.mark.gpu


def losses(tmp_path, name: str, micro: int, **extra) -> list[float]:
    from loom.config import build_config
    from loom.train.trainer import Trainer

    over = {
        **tiny_overrides(),
        "run.device": "cuda",
        "training.compile": "true",
        "training.steps": 6,
        "training.global_batch_size": 8,
        "training.micro_batch_size": micro,
        "training.eval_every": 3,
        "data.val_fraction": 0.1,
        "run.dir": str(tmp_path / name),
        **extra,
    }
    cfg = build_config(None, {k: str(v) for k, v in over.items()})
    return [r["loss"] for r in Trainer(cfg).fit()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("micro", [8, 4])  # one micro-batch per step; two accumulated
def test_cuda_graphs_give_the_compiled_losses(tmp_path, micro):
    plain = losses(tmp_path, "plain", micro)
    graphs = losses(tmp_path, "graphs", micro, **{"training.cuda_graphs": "true"})
    assert len(plain) == len(graphs) == 6
    for a, b in zip(plain, graphs):
        assert abs(a - b) <= 1e-5 * abs(a)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("objective", ["grpo", "ppo"])
def test_rollout_steps_with_graphs_give_the_compiled_losses(tmp_path, objective):
    """GRPO / PPO (fp32, compiled, 3 warm-up steps then 5 on rollouts): with training.cuda_graphs the steps' losses
    equal the same compiled run's without graphs (their rows padded to fixed widths, the engine generating through
    its graph-free compiles of the blocks: the same kernels, so the same rollouts); the training step saw at most
    two widths, and the engine swapped in a graph-free compile for every block."""
    from loom.config import build_config
    from loom.train.trainer import Trainer

    def run(name: str, graphs: bool):
        over = {
            "run.dir": str(tmp_path / name),
            "run.device": "cuda",
            "training.objective": objective,
            "training.compile": "true",
            "training.cuda_graphs": str(graphs).lower(),
            "training.dtype": "float32",
            "training.steps": 8,
            "grpo.warmup_steps": 3,
            "optimizer.warmup_steps": 2,
            "training.eval_every": 0,
            "training.eval_hook": "",
            "metrics.every": 1,
            "metrics.progress": "false",
            "metrics.tensorboard": "false",
            "checkpoint.at_end": "false",
        }
        recipe = pathlib.Path(__file__).resolve().parents[2] / "recipes" / "grpo_debug.toml"
        cfg = build_config(str(recipe), {k: str(v) for k, v in over.items()})
        trainer, widths = Trainer(cfg), set()
        step = trainer.engine.step

        def recording(mbs, number):
            widths.update(mb.inputs.shape[1] for mb in mbs)
            return step(mbs, number)

        trainer.engine.step = recording
        records = trainer.fit()
        engine = trainer.objective.rollouts.generator.engine
        assert len(engine._graph_free) == (trainer.model_args.n_layers if graphs else 0)
        return [r["loss"] for r in records], widths

    plain, _ = run("plain", False)
    graphed, widths = run("graphs", True)
    assert len(graphed) == 8 and len(widths) <= 2, widths
    for a, b in zip(plain, graphed):
        assert abs(a - b) <= 1e-4 * max(abs(a), 1e-3), (plain, graphed)

"""training.cuda_graphs on one GPU: the compiled blocks replayed as CUDA graphs give the losses of the same compiled
run without graphs (fp32, with and without accumulation, a validation pass in between), GRPO's and PPO's too; the
inference engine's kept decode graphs survive the cuBLAS workspace clearing those graphs' recordings do."""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.tiny import tiny_overrides

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


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


@pytest.mark.parametrize("micro", [8, 4])  # one micro-batch per step; two accumulated
def test_cuda_graphs_give_the_compiled_losses(tmp_path, micro):
    plain = losses(tmp_path, "plain", micro)
    graphs = losses(tmp_path, "graphs", micro, **{"training.cuda_graphs": "true"})
    assert len(plain) == len(graphs) == 6
    for a, b in zip(plain, graphs):
        assert abs(a - b) <= 1e-5 * abs(a)


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
            # a reward that differs within a group (the tiny model's answers are never right): non-zero losses
            "grpo.rewards": "tests.unit.test_grpo_async:token_sum_reward",
            **({"grpo.beta": 0.05, "grpo.iterations": 2} if objective == "grpo" else {"ppo.kl_coef": 0.05}),
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
    assert all(plain[3:]), plain  # the rollout steps' losses are not all zero
    for a, b in zip(plain, graphed):
        assert abs(a - b) <= 1e-4 * max(abs(a), 1e-3), (plain, graphed)


def test_kept_decode_graph_survives_a_cleared_blas_workspace():
    """A decode graph the engine keeps replays correctly after cuBLAS's cached workspaces are dropped and the
    allocator's free memory released (what torch.compile's CUDA graph trees do around each recording, as
    training.cuda_graphs' steps between two GRPO rollouts do): the capture's matmuls use a workspace of the graph's
    own pool, not a cached one freed under it (an illegal address on an H200 before)."""
    from loom.infer.engine import Engine
    from loom.models.registry import all_flavors, build_model

    torch.manual_seed(0)
    args = all_flavors()["debug"].with_(
        dim=1024, n_heads=8, n_kv_heads=8, ffn_dim=2816, vocab_size=512, max_seq_len=64
    )
    model = build_model(args).cuda().eval()
    engine = Engine(model, compile=False, cuda_graphs=True)
    tokens = torch.randint(0, 512, (4, 9), device="cuda")
    with torch.no_grad():
        plain = model(tokens)[:, -1]
        engine.allocate(4, 9)
        engine.prefill(tokens[:, :-1], torch.full((4,), 7, device="cuda"))
        first = engine.step(tokens[:, -1:], torch.full((4, 1), 8, device="cuda"))[:, 0].clone()
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        junk = [torch.full((1 << 22,), float("nan"), device="cuda") for _ in range(64)]  # takes freed memory
        engine.prefill(tokens[:, :-1], torch.full((4,), 7, device="cuda"))
        again = engine.step(tokens[:, -1:], torch.full((4, 1), 8, device="cuda"))[:, 0].clone()
        torch.cuda.synchronize()
        assert len(engine._graphs) == 1 and all(j.isnan().all() for j in junk)
    torch.testing.assert_close(first, plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, plain, rtol=1e-4, atol=1e-4)

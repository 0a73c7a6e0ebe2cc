"""training.cuda_graphs with rollouts (grpo, ppo): rows padded to a few fixed widths give the losses, gradient norms
and weights of rows padded to their longest (fp32 rounding: the padding is masked); the inference engine and the
evaluation hooks run the blocks through their compile without graphs, never through training's graph-replaying one
(the GPU runs the graphs: tests/gpu/test_cuda_graphs_gpu.py, bench/grpo.py with --set training.cuda_graphs=true); the
finite-weights check before each sampling."""

from __future__ import annotations

import pytest
import torch

from loom.rl.rollout import bucket_width, rows_to_batches
from loom.train.trainer import Trainer
from tests.tiny import tiny_config


def test_bucket_widths():
    """8, 12, 16, 24, 32, 48, ...: a handful of shapes, at most seq_len (never narrower than the rows)."""
    buckets = {1: 8, 8: 8, 9: 12, 12: 12, 13: 16, 17: 24, 25: 32, 33: 48, 49: 64, 64: 64}
    assert {w: bucket_width(w, 64) for w in buckets} == buckets
    assert bucket_width(13, 14) == 14 and bucket_width(5, 6) == 6
    assert len({bucket_width(w, 512) for w in range(1, 513)}) == 13
    (mb,) = rows_to_batches(
        [[1, 2, 3], [4]], [[5, 6, 9], [7, 9]], micro=2, pad_id=9, seq_len=32, bucketed=True
    )
    assert mb.inputs.tolist() == [[1, 2, 3, 5, 6, 9, 9, 9], [4, 7, 9, 9, 9, 9, 9, 9]]
    assert mb.labels[:, 5:].eq(-100).all() and mb.positions.shape == (2, 8)


def run(tmp_path, objective: str, graphed: bool):
    """4 steps (1 warm-up) of ``objective`` with a KL reference and reused rollouts, a reward that varies within a
    group (GRPO: an evaluation hook's greedy generation every 2 steps too); ``graphed``: as training.cuda_graphs runs them (the
    CPU refuses the field, so set up here after the build): the rows at fixed widths, the blocks compiled as
    ``apply_compile`` compiles them for graphs (Dynamo's eager backend), the generator rebuilt on them as the
    rollouts' ``bind`` builds it. (losses, grad norms, the widths trained on, the final weights, the graphed
    compile's calls: all, and those with gradients in train mode)."""
    from loom.parallel.compile import apply_compile

    extra = (
        {
            "grpo.beta": 0.05,
            "grpo.iterations": 2,
            "training.eval_every": 2,
            "training.eval_hook": "loom.rl.arithmetic:greedy_accuracy",
        }
        if objective == "grpo"
        else {"ppo.kl_coef": 0.05, "ppo.mini_batches": 2, "ppo.epochs": 1}
    )
    cfg = tiny_config(
        tmp_path / f"{objective}_{graphed}",
        None,
        **{
            "training.objective": objective,
            "training.steps": 4,
            "training.global_batch_size": 8,
            "training.micro_batch_size": 4,
            "grpo.group_size": 4,
            "grpo.warmup_steps": 1,
            "grpo.max_new_tokens": 6,
            "grpo.rewards": "tests.unit.test_grpo_async:token_sum_reward",
            "grpo.lr_ratio": 1.0,
            "optimizer.lr": 3e-2,
            "metrics.progress": "false",
            **extra,
        },
    )
    trainer = Trainer(cfg)
    calls = {"all": 0, "training": 0}
    if graphed:
        rollouts, model = trainer.objective.rollouts, trainer.parts[0]
        rollouts.bucketed = True  # what training.cuda_graphs sets
        apply_compile(model.layers, cuda_graphs=True, backend="eager")
        for block in model.layers.values():

            def counted(
                *a, _call=block._compiled_call_impl, _block=block, **kw
            ):  # the graphed compile, counted
                calls["all"] += 1
                calls["training"] += _block.training and torch.is_grad_enabled()
                return _call(*a, **kw)

            block._compiled_call_impl = counted
        rollouts.generator = rollouts.engine_generator(trainer.engine, rollouts.generator.max_batch)
    widths, step = [], trainer.engine.step

    def recording(mbs, number):
        widths.append({mb.inputs.shape[1] for mb in mbs})
        return step(mbs, number)

    trainer.engine.step = recording
    records = trainer.fit()
    assert sum("eval/accuracy" in r for r in records) == (2 if objective == "grpo" else 0)
    weights = {k: v.detach().clone() for k, v in trainer.parts[0].named_parameters()}
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], widths, weights, calls


@pytest.mark.parametrize("objective", ["grpo", "ppo"])
def test_graphed_steps_give_the_same_losses(tmp_path, objective):
    """The same run as it runs today and as training.cuda_graphs runs it: every step's loss and gradient norm and
    the weights after the last equal to fp32 rounding (the wider rows' padding is masked; the blocks' compiles run
    the same code); the trained widths are the fixed ones; the graphed compile ran for the training forwards alone
    (2 blocks x 2 micro-batches x 4 steps, train mode, gradients) and the rollout-time log-probabilities' no-grad
    forwards at the training widths, never for the rollouts' or the evaluation's generation."""
    loss, norm, widths, weights, _ = run(tmp_path, objective, False)
    loss_b, norm_b, widths_b, weights_b, calls = run(tmp_path, objective, True)
    assert all(w == {8} or w == {12} for w in widths_b) and widths_b != widths
    assert any(loss[1:]) and all(n > 0 for n in norm)  # the advantages are not all zero
    # the loss is a mean of per-token terms of size ~1 that cancel (GRPO's third step: -0.04), so its rounding is
    # at the terms' scale, not its own: 1.5e-6 measured on an AMD EPYC, where rtol 2e-5 / atol 1e-7 failed
    torch.testing.assert_close(loss_b, loss, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(norm_b, norm, rtol=2e-5, atol=1e-7)
    # AdamW turns a rounding difference in a gradient near zero into up to a whole step of the LR (3e-2 here):
    # 8e-5 measured on that machine; masked padding that leaked would move weights by steps of the LR
    for name, w in weights.items():
        torch.testing.assert_close(weights_b[name], w, rtol=0, atol=3e-4, msg=name)
    # the rollout-time log-probabilities' no-grad forwards at the training widths (the reference is a model of its
    # own): per batch of rollouts (steps 2 and 4) its micro-batches (GRPO 2; PPO's two steps' worth, 4) x 2 blocks
    assert calls["training"] == 2 * 2 * 4, calls
    assert calls["all"] - calls["training"] == 2 * (2 if objective == "grpo" else 4) * 2, calls


def test_the_engine_runs_the_blocks_without_training_graphs():
    """Blocks compiled as training.cuda_graphs compiles them (``apply_compile``, here with Dynamo's eager backend:
    the CPU has no graphs): the engine's prefills and decode steps call each block's compile without graphs, never
    the graph-replaying one, and give the plain model's greedy tokens; so do the forwards inside ``graph_free`` (the
    loop's evaluation hooks), an engine's own swap nested in it; a training forward calls the graphed one."""
    from loom.infer import Generator, SamplingParams
    from loom.models.registry import all_flavors, build_model
    from loom.parallel.compile import GRAPH_FREE, apply_compile, graph_free, graph_free_blocks

    torch.manual_seed(0)
    args = all_flavors()["debug"].with_(vocab_size=256, max_seq_len=64)
    model, plain = build_model(args), build_model(args)
    plain.load_state_dict(model.state_dict())
    apply_compile(model.layers, cuda_graphs=True, backend="eager")
    calls = {"graphed": 0}
    for block in model.layers.values():
        assert GRAPH_FREE in block.__dict__

        def counted(*a, _call=block._compiled_call_impl, **kw):  # the graphed compile, counted as it runs
            calls["graphed"] += 1
            return _call(*a, **kw)

        block._compiled_call_impl = counted
    prompts = [[5, 6, 7], [8, 9]]
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    outs = Generator.from_model(model, compile=False, cuda_graphs=False).generate_ids(prompts, greedy)
    want = Generator.from_model(plain, compile=False, cuda_graphs=False).generate_ids(prompts, greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert calls["graphed"] == 0  # no prefill or decode shape reached the graphed compile
    with graph_free(
        graph_free_blocks(model)
    ):  # as the loop runs its evaluation hooks: a generator inside too
        Generator.from_model(model, compile=False, cuda_graphs=False).generate_ids(prompts, greedy)
        model(torch.tensor(prompts[1:]))
    assert calls["graphed"] == 0
    model.train()
    model(torch.tensor(prompts[:1]))
    assert calls["graphed"] == args.n_layers  # training's forwards still do


def test_all_finite_reads_every_weight_with_one_sum_each():
    """The check before each sampling (and each save): a NaN, +inf or -inf anywhere is caught; weights so large
    that their sums overflow are still finite (checked element by element then); empty tensors count nothing."""
    from loom.train.engine import all_finite

    ok = [torch.randn(3, 4), torch.zeros(0), torch.randn(5, dtype=torch.bfloat16)]
    assert all_finite(ok) and all_finite([])
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(7)
        t[3] = bad
        assert not all_finite([*ok, t])
    assert all_finite([*ok, torch.full((10,), 3e38)])  # |sum| past fp32's range, every element finite

"""GRPO on the embedded arithmetic task: loom against TRL's GRPOTrainer (transformers' generation, no vLLM), one GPU,
one process, the same run, from the same weights, on the same prompts in the same order.

    python -m bench.grpo --out bench/results/grpo_125m_h100.json                    # recipes/grpo_125m.toml, GPU
    python -m bench.grpo --flavor debug --device cpu --steps 3 --sft-steps 20 --eval-problems 40 --out /tmp/g.json

1. Warm-up: loom trains the recipe's model on the task's worked examples (``grpo.warmup_steps`` of supervised
   steps, the GRPO objective's own warm-up) and exports it as a Hugging Face folder with its byte tokenizer (a
   tokenizer.json that transformers' ``AutoTokenizer`` loads, the same ids).
2. Accuracy before: greedy exact-match answers on a fixed held-out set of problems (``loom.rl.arithmetic``'s,
   ``--eval-problems`` of them), one evaluator for every folder: loom's engine on the folder's weights in fp32
   (transformers' greedy ``generate`` beside it, a check of the export).
3. loom GRPO from the folder for ``--steps`` steps at a constant LR (the recipe's optimizer.lr x grpo.lr_ratio),
   rollouts from loom's engine on the live weights (the recipe's compiled blocks, decode steps as CUDA graphs on a
   GPU): steps/s, rollout tokens/s, weight-sync time and the step's split (loom's ``time/*`` fields), reward curve;
   then exported and evaluated.
4. TRL from the same folder: a ``datasets.Dataset`` of the prompts loom's rollouts drew, in that order (TRL's
   sampler unshuffled), the same reward functions with the same weights, every hyperparameter mapped field by field
   (``trl_mapping``: written into the result); steps/s, the split (its generation and reward calls timed), reward
   curve; then saved and evaluated by the same evaluator.
5. The comparison against the issue's bar: loom >= 2x TRL's steps/s, and loom's accuracy gain >= TRL's.

Steps/s counts every step after the first ``--skip-steps`` (compilation, graph capture, allocator warm-up) as the
wall time between the ends of consecutive steps, logging included, for both systems. The weights train in fp32
under bf16 autocast on both sides (loom's training.dtype bfloat16; TRL's bf16 over the fp32 folder); on the CPU
both run fp32 and loom eager (``--set training.compile=true`` compiles there too).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import time

from bench.common import command, default_commit, environment, write_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "grpo_125m.toml")


# ------------------------------------------------------------------------------------------------ loom's side
def loom_config(a, run_dir: str, **overrides):
    """The recipe with the command line's ``--set`` fields and the bench's own (``overrides``: dotted -> str)."""
    from loom.config import build_config

    base = {
        "model.flavor": a.flavor,
        "run.device": a.device,
        "run.dir": run_dir,
        "metrics.tensorboard": "false",
        "metrics.progress": "false",
        "checkpoint.at_end": "false",
        "training.eval_every": "0",
        "training.eval_hook": "",
        "metrics.every": "1",
    }
    if a.device == "cpu":  # fp32 and eager: the CPU run checks the pipeline, it measures nothing
        base.update({"training.dtype": "float32", "training.compile": "false"})
    sets = dict(s.split("=", 1) for s in a.set)
    return build_config(a.recipe, {**base, **sets, **{k: str(v) for k, v in overrides.items()}})


def trainer_of(cfg):
    from loom.methods.grpo import GroupRelative
    from loom.train.trainer import Trainer

    return Trainer(cfg, objective=GroupRelative(cfg))


def reward_functions(cfg):
    """The run's reward functions and weights as loom's rollouts resolve them (``loom.rl.rewards.Rewards``): the
    embedded task's two by default, or grpo.rewards / grpo.reward_weights."""
    from loom.rl.rewards import Rewards
    from loom.rl.rollout import EMBEDDED_REWARDS, EMBEDDED_WEIGHTS

    g = cfg.grpo
    specs = [s.strip() for s in g.rewards.split(",") if s.strip()]
    weights = [float(w) for w in g.reward_weights.split(",") if w.strip()]
    return Rewards(specs or list(EMBEDDED_REWARDS), weights or (None if specs else list(EMBEDDED_WEIGHTS)))


def describe_rewards(rewards) -> str:
    return " + ".join(
        f"{float(w):g} x {fn.__module__}:{fn.__name__}" for w, fn in zip(rewards.weights, rewards.functions)
    )


def export(trainer, folder: str) -> None:
    """The trainer's model as a Hugging Face folder (fp32 weights) with the byte tokenizer as a tokenizer.json."""
    from loom.checkpoint.hf.export import export_hf
    from loom.checkpoint.hf.tokenizer import tokenizer_export

    shutil.rmtree(folder, ignore_errors=True)
    state = {k: v.detach() for k, v in trainer.parts[0].state_dict().items()}
    export_hf(
        state,
        trainer.model_args,
        folder,
        tokenizer=tokenizer_export(trainer.cfg.data.tokenizer, trainer.model_args.max_seq_len),
    )


def warm_up(a, folder: str) -> dict:
    """Supervised warm-up (the GRPO objective's warm-up steps only), exported to ``folder``."""
    # loom refuses a GRPO run that is all warm-up: built with one GRPO step after it, stopped before that step
    run_dir = os.path.join(a.run_dir, "warmup")
    lr_warmup = min(
        loom_config(a, run_dir).optimizer.warmup_steps, a.sft_steps
    )  # a short --sft-steps: all of it
    cfg = loom_config(
        a,
        run_dir,
        **{
            "training.steps": a.sft_steps + 1,
            "grpo.warmup_steps": a.sft_steps,
            "grpo.beta": 0,
            "optimizer.warmup_steps": lr_warmup,
        },
    )
    trainer = trainer_of(cfg)
    trainer.cfg.training.steps = a.sft_steps
    t0 = time.perf_counter()
    records = trainer.fit()
    seconds = time.perf_counter() - t0
    export(trainer, folder)
    out = {
        "steps": a.sft_steps,
        "seconds": seconds,
        "loss_first": records[0]["loss"],
        "loss_last": records[-1]["loss"],
        "lr": cfg.optimizer.lr,
        "schedule": cfg.optimizer.schedule,
        "lr_warmup_steps": cfg.optimizer.warmup_steps,
        "rows_per_step": cfg.training.global_batch_size,
    }
    free(trainer)
    return out


def grpo_config(a, folder: str, run_dir: str, lr: float, seed: int):
    """loom's GRPO part: from ``folder``, no warm-up, a constant LR ``lr`` from the first step, ``run.seed`` seed."""
    return loom_config(
        a,
        run_dir,
        **{
            "model.init_from": folder,
            "training.steps": a.steps,
            "run.seed": seed,
            "grpo.warmup_steps": 0,
            "optimizer.lr": lr,
            "grpo.lr_ratio": 1.0,
            "optimizer.schedule": "constant",
            "optimizer.warmup_steps": 0,
        },
    )


def run_loom(a, cfg, out_folder: str) -> tuple[dict, list[dict]]:
    """loom GRPO for cfg.training.steps steps, exported to ``out_folder``: (its figures, the prompt rows its
    rollouts drew, in order)."""
    reset_memory(a.device)
    trainer = trainer_of(cfg)
    source = trainer.objective.rollouts.source
    drawn, draw = [], source.problems

    def recording(
        n, key
    ):  # the bench's record of the prompts loom's rollouts draw (to check TRL gets the same)
        rows = draw(n, key)
        drawn.extend(rows)
        return rows

    source.problems = recording
    mine, theirs = trainer.objective.rollouts.rewards, reward_functions(cfg)  # what TRL is given
    assert mine.functions == theirs.functions and mine.weights.tolist() == theirs.weights.tolist()
    t0 = time.perf_counter()
    records = trainer.fit()
    wall = time.perf_counter() - t0
    export(trainer, out_folder)
    # the tokens each record's tokens_per_s counts
    per_step = cfg.training.global_batch_size * cfg.training.seq_len
    step_s = [per_step / r["tokens_per_s"] for r in records]
    assert [r["step"] for r in records] == list(range(1, cfg.training.steps + 1)), "metrics.every must be 1"
    timed = records[a.skip_steps :]
    # the step's split, mean seconds over the timed steps but the last: time/training_s is on the next record
    split = {"step": [], "generation": [], "scoring": [], "logps": [], "weight_sync": [], "training": []}
    for k in range(a.skip_steps, len(records) - 1):
        split["step"].append(step_s[k])
        for name in ("generation", "scoring", "logps", "weight_sync"):
            split[name].append(records[k].get(f"time/{name}_s", 0.0))
        split["training"].append(records[k + 1]["time/training_s"])
    split = {name: mean(v) for name, v in split.items()}
    split["other"] = split["step"] - sum(v for k, v in split.items() if k != "step")
    out = {
        "steps": len(records),
        "wall_s": wall,
        "first_step_s": step_s[0],
        "steps_per_s": len(timed) / sum(step_s[a.skip_steps :]),
        "steps_per_s_all": len(records) / sum(step_s),
        "step_s": step_s,
        "time_split_mean_s": split,
        "rollout_tokens_per_s_median": median(r["rollout_tokens_per_s"] for r in timed),
        "weight_sync_s_mean": statistics.fmean(r.get("time/weight_sync_s", 0.0) for r in timed),
        "weight_sync_bytes": records[-1].get("weight_sync_bytes", 0.0),
        "reward_curve": [r["reward"] for r in records],
        "exact_answer_curve": [r.get("rewards/exact_answer") for r in records],
        "completion_length_curve": [r["completion_length"] for r in records],
        "loss_curve": [r["loss"] for r in records],
        "kernels": trainer.kernels.describe(),
        "compile": cfg.training.compile,
        "dtype": cfg.training.dtype,
        "optimizer_implementation": cfg.optimizer.implementation,
        "engine_cuda_graphs": bool(trainer.objective.rollouts.generator.engine.cuda_graphs),
        "peak_memory_gib": peak_memory(a.device),
    }
    free(trainer)
    return out, drawn


# ------------------------------------------------------------------------------------------------- TRL's side
def trl_mapping(cfg) -> list[dict]:
    """Each loom field of the GRPO run and the TRL GRPOConfig field given its value (``loom`` None: a TRL field
    set to what loom does without a field for it; ``note`` says how it is matched)."""
    g, t, o = cfg.grpo, cfg.training, cfg.optimizer
    bf16 = t.dtype == "bfloat16"
    rows = [
        ("grpo.group_size", "num_generations", g.group_size, ""),
        (
            "training.micro_batch_size",
            "per_device_train_batch_size",
            t.micro_batch_size,
            "completions per forward / backward",
        ),
        (
            "training.global_batch_size / training.micro_batch_size",
            "gradient_accumulation_steps",
            t.global_batch_size // t.micro_batch_size,
            "micro-batches per optimizer step",
        ),
        (
            None,
            "steps_per_generation",
            t.global_batch_size // t.micro_batch_size,
            "one generation of training.global_batch_size completions per optimizer step (x num_iterations)",
        ),
        (
            "training.global_batch_size / grpo.group_size",
            "generation_batch_size / num_generations",
            t.global_batch_size // g.group_size,
            "prompts per generation",
        ),
        ("grpo.iterations", "num_iterations", g.iterations, ""),
        ("grpo.max_new_tokens", "max_completion_length", g.max_new_tokens, ""),
        ("grpo.temperature", "temperature", g.temperature, ""),
        ("grpo.top_p", "top_p", g.top_p, ""),
        (None, "top_k", 0, "off on both"),
        ("grpo.beta", "beta", g.beta, "k3 KL to a frozen reference (none at 0)"),
        ("grpo.epsilon", "epsilon", g.epsilon, ""),
        ("grpo.epsilon_high", "epsilon_high", g.epsilon_high or g.epsilon, "loom's 0 = epsilon"),
        ("grpo.loss_type", "loss_type", g.loss_type, ""),
        ("grpo.scale_rewards", "scale_rewards", g.scale_rewards, ""),
        ("grpo.mask_truncated", "mask_truncated_completions", g.mask_truncated, ""),
        (
            "grpo.rewards / grpo.reward_weights",
            "reward_funcs / reward_weights",
            describe_rewards(reward_functions(cfg)),
            "the same Python functions (TRL calls them with the dataset's 'answer' column)",
        ),
        (
            "optimizer.lr x grpo.lr_ratio",
            "learning_rate",
            o.lr * g.lr_ratio,
            "constant (the bench's GRPO part)",
        ),
        ("optimizer.schedule", "lr_scheduler_type", "constant", ""),
        ("optimizer.warmup_steps", "warmup_steps", 0, ""),
        ("optimizer.betas", "adam_beta1 / adam_beta2", list(o.betas), ""),
        ("optimizer.eps", "adam_epsilon", o.eps, ""),
        ("optimizer.weight_decay", "weight_decay", o.weight_decay, ""),
        ("training.max_norm", "max_grad_norm", t.max_norm, ""),
        ("training.dtype", "bf16", bf16, "fp32 weights and AdamW state, bf16 autocast, on both"),
        (
            "training.activation_checkpointing",
            "gradient_checkpointing",
            t.activation_checkpointing != "none",
            "TRL's GRPOConfig defaults to True: set to loom's",
        ),
        ("run.seed", "seed", cfg.run.seed, "the sampling streams differ (each system's own RNG)"),
        (
            "the prompts of loom's step k",
            "train_dataset, shuffle_dataset",
            "the same rows; shuffle_dataset false",
            "a datasets.Dataset of the prompts loom's rollouts drew, in order; TRL's sampler unshuffled",
        ),
    ]
    return [{"loom": lf, "trl": tf, "value": v, **({"note": n} if n else {})} for lf, tf, v, n in rows]


def trl_config(cfg, out_dir: str, steps: int, device: str):
    from trl import GRPOConfig

    g, t, o = cfg.grpo, cfg.training, cfg.optimizer
    return GRPOConfig(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.global_batch_size // t.micro_batch_size,
        steps_per_generation=t.global_batch_size // t.micro_batch_size,
        num_generations=g.group_size,
        num_iterations=g.iterations,
        max_completion_length=g.max_new_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=0,
        beta=g.beta,
        epsilon=g.epsilon,
        epsilon_high=g.epsilon_high or g.epsilon,
        loss_type=g.loss_type,
        scale_rewards=g.scale_rewards,
        mask_truncated_completions=g.mask_truncated,
        reward_weights=reward_functions(cfg).weights.tolist(),
        learning_rate=o.lr * g.lr_ratio,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_epsilon=o.eps,
        weight_decay=o.weight_decay,
        max_grad_norm=t.max_norm,
        bf16=t.dtype == "bfloat16",
        use_cpu=device == "cpu",
        gradient_checkpointing=t.activation_checkpointing != "none",
        seed=cfg.run.seed,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
        remove_unused_columns=False,
    )


class _Timed:
    """Wall seconds spent in a wrapped callable, per TRL step (the GPU synchronized after each call)."""

    def __init__(self, device: str):
        self.device, self.seconds = device, 0.0

    def wrap(self, fn):
        import functools

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync(self.device)
                self.seconds += time.perf_counter() - t0

        return timed


def run_trl(a, cfg, folder: str, rows: list[dict], out_folder: str) -> dict:
    """TRL's GRPOTrainer from ``folder`` on ``rows`` (in order) for ``a.steps`` steps, then saved to
    ``out_folder``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    reset_memory(a.device)
    generation, scoring = _Timed(a.device), _Timed(a.device)
    seen: list[str] = []

    def recording(fn):  # the first function also records each group's prompt, in the order TRL trains on them
        def first(prompts, completions, **kw):
            seen.extend(prompts[:: cfg.grpo.group_size])
            return fn(prompts=prompts, completions=completions, **kw)

        first.__name__ = fn.__name__
        return first

    rewards = reward_functions(cfg)
    funcs = [scoring.wrap(recording(fn) if k == 0 else fn) for k, fn in enumerate(rewards.functions)]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    args = trl_config(cfg, os.path.join(a.run_dir, "trl_out"), a.steps, a.device)
    ends: list[float] = []
    splits: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *_, **__):
            ends.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            sync(a.device)
            ends.append(time.perf_counter())
            splits.append((generation.seconds, scoring.seconds))
            generation.seconds = scoring.seconds = 0.0

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=funcs,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer._generate_single_turn = generation.wrap(trainer._generate_single_turn)  # transformers' generate
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    shutil.rmtree(out_folder, ignore_errors=True)
    trainer.save_model(out_folder)
    step_s = [b - e for e, b in zip(ends, ends[1:])]
    logs = [h for h in trainer.state.log_history if "reward" in h]
    timed = slice(a.skip_steps, None)
    split = {
        "step": mean(step_s[timed]),
        "generation": mean(s[0] for s in splits[timed]),
        "scoring": mean(s[1] for s in splits[timed]),
    }
    split["training_and_other"] = split["step"] - split["generation"] - split["scoring"]
    out = {
        "steps": len(step_s),
        "wall_s": wall,
        "first_step_s": step_s[0],
        "steps_per_s": len(step_s[timed]) / sum(step_s[timed]),
        "steps_per_s_all": len(step_s) / sum(step_s),
        "step_s": step_s,
        "time_split_mean_s": split,
        # generated tokens (mean completion length x completions) per second of generation
        "rollout_tokens_per_s_median": median(
            h["completions/mean_length"] * cfg.training.global_batch_size / s[0]
            for h, s in list(zip(logs, splits))[timed]
        ),
        "reward_curve": [h["reward"] for h in logs],
        "exact_answer_curve": [h.get("rewards/exact_answer/mean") for h in logs],
        "completion_length_curve": [h.get("completions/mean_length") for h in logs],
        "loss_curve": [h.get("loss") for h in logs],
        "optim": str(args.optim),
        "bf16": args.bf16,
        "generation": "transformers generate (no vLLM, no compile)",
        "prompts_match_dataset": seen[: len(rows)] == [r["prompt"] for r in rows][: len(seen)],
        "peak_memory_gib": peak_memory(a.device),
    }
    del trainer, model
    gc.collect()
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return out


# -------------------------------------------------------------------------------------------------- evaluation
def held_out(cfg, n: int) -> list[dict]:
    """The fixed evaluation problems: loom.rl.arithmetic.greedy_accuracy's draw (seed -1), ``n`` of them."""
    from loom.rl.arithmetic import ArithmeticTask

    return ArithmeticTask(seed=-1, digits=cfg.grpo.digits, ops=cfg.grpo.ops).problems(n, ("held-out",))


def accuracy(folder: str, problems: list[dict], device: str, max_new: int) -> float:
    """Greedy exact-match accuracy of the folder's model on ``problems``: loom's engine on its fp32 weights (the one
    evaluator of every system's weights)."""
    import torch

    from loom.data.tokenizers import ByteTokenizer
    from loom.infer.generator import Generator
    from loom.infer.sampling import SamplingParams
    from loom.rl.arithmetic import exact_answer

    gen = Generator(folder, device=device, dtype="float32", compile=False, max_batch=len(problems), tp=False)
    enc = ByteTokenizer().encode  # the folder's tokenizer.json has the same ids; no BOS added, as in training
    try:
        outs = gen.generate_ids(
            [enc(r["prompt"]) for r in problems], SamplingParams(max_new_tokens=max_new, temperature=0.0)
        )
    finally:
        gen.engine.close()
    del gen
    if device == "cuda":
        torch.cuda.empty_cache()
    return sum(exact_answer([], [o.text for o in outs], [r["answer"] for r in problems])) / len(problems)


def hf_accuracy(folder: str, problems: list[dict], device: str, max_new: int) -> float:
    """The same with transformers' greedy ``generate`` (fp32, left-padded prompts): a check of the export."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loom.rl.arithmetic import exact_answer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    batch = tok([r["prompt"] for r in problems], return_tensors="pt", padding=True).to(device)
    with torch.no_grad():
        ids = model.generate(**batch, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return sum(exact_answer([], texts, [r["answer"] for r in problems])) / len(problems)


def evaluate(folder: str, problems: list[dict], device: str, max_new: int) -> dict:
    return {
        "accuracy": accuracy(folder, problems, device, max_new),
        "accuracy_transformers": hf_accuracy(folder, problems, device, max_new),
    }


# ------------------------------------------------------------------------------------------------------ helpers
def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0


def mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def reset_memory(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def free(trainer) -> None:
    import torch

    rollouts = getattr(trainer.objective, "rollouts", None)
    if rollouts is not None and rollouts.generator is not None:
        rollouts.generator.engine.close()
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def one_seed(
    a, warmed: str, lr: float, seed: int, problems: list[dict], before: dict, systems: list[str]
) -> dict:
    """Each system's GRPO from ``warmed`` with ``run.seed`` ``seed`` (its prompts and its sampling), evaluated."""
    cfg = grpo_config(a, warmed, os.path.join(a.run_dir, "loom_grpo"), lr, seed)
    max_new = cfg.grpo.max_new_tokens
    results, drawn = {}, None
    if "loom" in systems:
        results["loom"], drawn = run_loom(a, cfg, os.path.join(a.run_dir, "hf_loom_grpo"))
        results["loom"]["after"] = evaluate(
            os.path.join(a.run_dir, "hf_loom_grpo"), problems, a.device, max_new
        )
    # the prompts of loom's rollouts in order (loom.rl.rollout draws them from the task by step)
    from loom.rl.arithmetic import ArithmeticTask

    task, per_step = (
        ArithmeticTask(cfg.run.seed, cfg.grpo.digits, cfg.grpo.ops),
        cfg.training.global_batch_size // cfg.grpo.group_size,
    )
    rows = [
        r for s in range(1, a.steps + 1, cfg.grpo.iterations) for r in task.problems(per_step, ("grpo", s))
    ]
    if drawn is not None:
        assert drawn == rows, "the bench's prompt list is not what loom's rollouts drew"
    if "trl" in systems:
        results["trl"] = run_trl(a, cfg, warmed, rows, os.path.join(a.run_dir, "hf_trl_grpo"))
        results["trl"]["after"] = evaluate(
            os.path.join(a.run_dir, "hf_trl_grpo"), problems, a.device, max_new
        )
    for name, r in results.items():
        r["accuracy_gain"] = r["after"]["accuracy"] - before["accuracy"]
        print(
            f"seed {seed}: {name} {r['steps_per_s']:.2f} steps/s, accuracy {r['after']['accuracy']:.4f} "
            f"({r['accuracy_gain']:+.4f})",
            flush=True,
        )
    return {"seed": seed, "results": results}


def compare(runs: list[dict]) -> dict:
    """The issue's bars over the seeds: the median steps/s ratio (>= 2) and the mean accuracy gains (loom's >=
    TRL's), with the standard error of the mean paired difference (0 with one seed)."""
    ratios = [r["results"]["loom"]["steps_per_s"] / r["results"]["trl"]["steps_per_s"] for r in runs]
    gains = {k: [r["results"][k]["accuracy_gain"] for r in runs] for k in ("loom", "trl")}
    diffs = [x - y for x, y in zip(gains["loom"], gains["trl"])]
    ratio = median(ratios)
    return {
        "steps_per_s_ratio": ratio,
        "steps_per_s_ratios": ratios,
        "steps_per_s_bar": 2.0,
        "meets_steps_per_s_bar": ratio >= 2.0,
        "seeds": len(runs),
        "accuracy_gain_loom": mean(gains["loom"]),
        "accuracy_gain_trl": mean(gains["trl"]),
        "accuracy_gain_difference": mean(diffs),
        "accuracy_gain_difference_sem": statistics.stdev(diffs) / len(diffs) ** 0.5
        if len(diffs) > 1
        else 0.0,
        "meets_accuracy_bar": mean(gains["loom"]) >= mean(gains["trl"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=RECIPE, help="loom's GRPO recipe (model, task, batch, LRs, [grpo])")
    p.add_argument("--flavor", default="125M")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="GRPO steps of each system (default: the recipe's training.steps - grpo.warmup_steps)",
    )
    p.add_argument(
        "--sft-steps", type=int, default=None, help="warm-up steps (default: the recipe's grpo.warmup_steps)"
    )
    p.add_argument("--skip-steps", type=int, default=5, help="first GRPO steps left out of steps/s")
    p.add_argument("--eval-problems", type=int, default=2000)
    p.add_argument(
        "--seeds",
        default="0",
        help="GRPO runs of each system from the one warmed folder, one per run.seed "
        "(its prompts and sampling), e.g. 0,1,2: the accuracy bar compares "
        "mean gains",
    )
    p.add_argument("--systems", default="loom,trl")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="a loom config field for both parts (TRL's config follows through the mapping)",
    )
    p.add_argument("--run-dir", default="/tmp/loom_bench_grpo")
    p.add_argument("--out", default="bench/results/grpo.json")
    p.add_argument("--commit", default=default_commit())
    a = p.parse_args()
    systems = a.systems.split(",")
    a.seeds = [int(x) for x in a.seeds.split(",")]
    base = loom_config(a, os.path.join(a.run_dir, "probe"))
    if a.steps is None:
        a.steps = base.training.steps - base.grpo.warmup_steps
    if a.sft_steps is None:
        a.sft_steps = base.grpo.warmup_steps
    assert a.skip_steps < a.steps, "--skip-steps must leave timed steps"
    lr = base.optimizer.lr * base.grpo.lr_ratio
    warmed = os.path.join(a.run_dir, "hf_warmed")
    t_start = time.perf_counter()

    warm = warm_up(a, warmed)
    cfg = grpo_config(a, warmed, os.path.join(a.run_dir, "loom_grpo"), lr, a.seeds[0])
    problems = held_out(cfg, a.eval_problems)
    max_new = cfg.grpo.max_new_tokens
    before = evaluate(warmed, problems, a.device, max_new)
    print(
        f"warm-up: {warm['steps']} steps in {warm['seconds']:.1f} s, loss {warm['loss_last']:.4f}; accuracy "
        f"before GRPO {before['accuracy']:.3f} (transformers {before['accuracy_transformers']:.3f})",
        flush=True,
    )
    g, runs = cfg.grpo, []
    for (
        seed
    ) in a.seeds:  # the result is rewritten after each seed: a run cut short keeps the seeds it finished
        runs.append(one_seed(a, warmed, lr, seed, problems, before, systems))
        comparison = compare(runs) if len(systems) == 2 else {}
        doc = {
            "benchmark": "grpo",
            "environment": environment(a.commit, command(), ("trl", "datasets", "accelerate", "peft")),
            "settings": {
                "recipe": os.path.relpath(a.recipe, ROOT),
                "flavor": a.flavor,
                "device": a.device,
                "task": {"digits": g.digits, "ops": g.ops, "seeds": [r["seed"] for r in runs]},
                "grpo_steps": a.steps,
                "timed_steps": a.steps - a.skip_steps,
                "prompts_per_step": cfg.training.global_batch_size // g.group_size,
                "group_size": g.group_size,
                "max_new_tokens": g.max_new_tokens,
                "grpo_lr": lr,
                "eval_problems": a.eval_problems,
                "rewards": describe_rewards(reward_functions(cfg)),
                "loom_overrides": a.set,
                "loom_compile": cfg.training.compile,
            },
            "trl_mapping": trl_mapping(cfg),
            "warmup": warm,
            "accuracy_before": before,
            "runs": runs,
            "comparison": comparison,
            "total_wall_s": time.perf_counter() - t_start,
        }
        write_result(a.out, doc)
    print(
        f"\n{'seed':>4} {'system':<6} {'steps/s':>8} {'step ms':>8} {'gen ms':>7} {'score ms':>8} {'acc before':>10} "
        f"{'acc after':>9} {'gain':>6}"
    )
    for run in runs:
        for name, r in run["results"].items():
            s = r["time_split_mean_s"]
            print(
                f"{run['seed']:>4} {name:<6} {r['steps_per_s']:>8.2f} {1e3 * s['step']:>8.1f} "
                f"{1e3 * s['generation']:>7.1f} {1e3 * s['scoring']:>8.1f} {before['accuracy']:>10.3f} "
                f"{r['after']['accuracy']:>9.3f} {r['accuracy_gain']:>+6.3f}"
            )
    if comparison:
        print("comparison:", json.dumps(comparison))
    print(f"total {doc['total_wall_s']:.0f} s; wrote {a.out}")


if __name__ == "__main__":
    main()

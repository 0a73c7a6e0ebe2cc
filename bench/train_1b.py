"""Single-GPU training throughput: loom vs transformers' LlamaForCausalLM, same run, same GPU.

Both train the Llama-3.2-1B shape (loom flavor ``1B``) at seq 2048 with fp32 master weights,
bf16 autocast compute, a fused AdamW (loom: its own Triton kernel, ``optimizer.implementation = auto``;
transformers: PyTorch's ``fused=True``) and clipping at 1.0, on the same token batches. Variants:
loom eager, loom compiled (per-block torch.compile), transformers eager (SDPA attention) and
transformers + torch.compile. Each variant runs in its own process (clean peak memory).

    python -m bench.train_1b --variants loom_compile,hf_compile --steps 20 --warmup 5 \\
        --out bench/results/train_1b_h100.json

Writes one JSON with device, library versions, git commit, the command and, per variant,
tokens/s, MFU (loom's FLOPs convention, dense bf16 peak) and peak reserved memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from bench.common import (
    command,
    default_commit,
    environment,
    hf_llama_config,
    hf_train_step,
    joules_per_token,
    profile_steps_by_kind,
    run_children,
    time_steps,
    write_result,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SEQ = 2048
_PLAIN = {
    "model.attention": "sdpa",
    "model.fused_norm": "false",
    "model.fused_rope": "false",
    "model.fused_swiglu": "false",
    "model.fused_loss": "false",
}
# loom variants: config overrides on top of the common settings; kernels default to ``auto``
VARIANTS = {
    "loom_eager": {},
    "loom_compile": {"training.compile": "true"},
    # the compiled blocks replayed as CUDA graphs (torch.compile's reduce-overhead): the host launch gaps
    "loom_compile_graphs": {"training.compile": "true", "training.cuda_graphs": "true"},
    "loom_eager_plain": _PLAIN,  # no loom kernels: PyTorch SDPA and plain modules
    # PyTorch's fused AdamW instead of loom's Triton AdamW (what ``auto`` picks on CUDA)
    "loom_compile_torch_adamw": {"training.compile": "true", "optimizer.implementation": "fused"},
    "loom_compile_unfused_loss": {"training.compile": "true", "model.fused_loss": "false"},
    "loom_compile_float8_tensorwise": {"training.compile": "true", "training.float8": "tensorwise"},
    "loom_compile_float8_rowwise": {"training.compile": "true", "training.float8": "rowwise"},
    # packed documents (attention never crosses a document): loom's kernel vs SDPA with a dense mask
    "loom_docs_flash": {
        "training.compile": "true",
        "data.document_positions": "true",
        "model.attention": "flash",
    },
    "loom_docs_sdpa": {
        "training.compile": "true",
        "data.document_positions": "true",
        "model.attention": "sdpa",
    },
    "loom_docs_flex": {
        "training.compile": "true",
        "data.document_positions": "true",
        "model.attention": "flex",
    },
    "loom_docs_auto": {"training.compile": "true", "data.document_positions": "true"},  # times flash vs flex
    # early-loss experiments (same batches): no LR warmup (as the transformers variants here), and the
    # residual projections drawn with std 0.02 (flat, as transformers) or 0.02/sqrt(2 layers) (depth)
    "loom_compile_no_warmup": {
        "training.compile": "true",
        "optimizer.warmup_steps": "0",
        "optimizer.schedule": "constant",
    },
    "loom_compile_flat_init": {"training.compile": "true", "model.residual_init": "flat"},
    "loom_compile_depth_init": {"training.compile": "true", "model.residual_init": "depth"},
    "hf_eager": None,
    "hf_compile": None,
}
DEFAULT_VARIANTS = ("loom_eager", "loom_compile", "hf_eager", "hf_compile")


def loom_trainer(micro_batch: int, overrides: dict, run_dir: str, seq: int):
    from loom.config import build_config
    from loom.train.trainer import Trainer

    cfg = build_config(
        None,
        {
            "model.flavor": "1B",
            "training.seq_len": str(seq),
            "training.global_batch_size": str(micro_batch),
            "training.micro_batch_size": str(micro_batch),
            "training.dtype": "bfloat16",
            "training.steps": "1000",
            "optimizer.lr": "3e-4",
            "optimizer.implementation": "auto",
            "checkpoint.at_end": "false",
            "run.dir": run_dir,
            "metrics.tensorboard": "false",
            **overrides,
        },
    )
    return Trainer(cfg)


def hf_model(args, compile_: bool):
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(hf_llama_config(args, torch.float32)).cuda()  # fp32 master weights, as loom
    if compile_:
        model = torch.compile(model)
    return model


def run_variant(
    variant: str,
    micro_batch: int,
    steps: int,
    warmup: int,
    run_dir: str,
    seq: int = SEQ,
    extra: dict | None = None,
    profile: bool = False,
) -> dict:
    import torch

    torch.manual_seed(0)
    overrides = {**(extra or {}), **(VARIANTS[variant] or {})}
    trainer = loom_trainer(micro_batch, overrides, run_dir, seq)  # also the data source for HF
    kernels = _kernels(variant, trainer)
    args = trainer.model_args
    batches = [
        trainer.loader.next_step().micro_batches for _ in range(warmup + steps + (4 if profile else 0))
    ]
    attention_times = getattr(
        trainer, "attention_times", None
    )  # before the transformers variants drop the trainer
    if variant.startswith("loom"):
        step_fn = trainer.train_step
        n_params = sum(p.numel() for p in trainer.params)
    else:
        del trainer
        torch.cuda.empty_cache()
        model = hf_model(args, variant == "hf_compile")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        n_params = sum(p.numel() for p in model.parameters())
        step_fn = hf_train_step(model, list(model.parameters()), opt)

    torch.cuda.reset_peak_memory_stats()
    times, losses, first_step_s, gpus = time_steps(step_fn, batches[: warmup + steps], warmup)
    # after the timed steps, on batches of their own: kernel time per step by category (bench.lora's --profile)
    by_kind = profile_steps_by_kind(step_fn, batches[warmup + steps :], run_dir, variant) if profile else None
    from loom.metrics.flops import flops_per_token, peak_flops

    tokens = micro_batch * seq
    med = statistics.median(times)
    tps = tokens / med
    peak = peak_flops(torch.cuda.get_device_name(), "bfloat16")
    return {
        "variant": variant,
        "overrides": overrides,
        "params": n_params,
        "micro_batch": micro_batch,
        "attention_times": attention_times,
        "seq_len": seq,
        "kernels": kernels,
        "losses": losses,
        "steps_timed": steps,
        "warmup_steps": warmup,
        "step_s_median": med,
        "step_s_min": min(times),
        "step_s_max": max(times),
        "tokens_per_s": tps,
        "mfu": tps * flops_per_token(args, seq) / peak if peak else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "first_step_s": first_step_s,
        "gpus": gpus,
        "joules_per_token": joules_per_token(gpus, tps),
        "final_loss": losses[-1],
        "profile": by_kind,
    }


# float8's loss curve against bf16's (issue 54): the mean loss of the last LAST steps within this relative distance
# of bf16's on the same batches, stated before the >= 500-step GPU run that checks it
FLOAT8_CURVE_TOLERANCE, LAST, WINDOW = 0.02, 100, 50


def curve_gap(base: list[float], other: list[float]) -> dict:
    """How far ``other``'s loss curve runs from ``base``'s (same batches, step by step): the relative difference of
    each WINDOW-step mean, and of the last LAST steps' mean against FLOAT8_CURVE_TOLERANCE."""
    n = min(len(base), len(other))

    def rel(lo: int, hi: int) -> float:
        return statistics.fmean(other[lo:hi]) / statistics.fmean(base[lo:hi]) - 1

    windows = [rel(i, i + WINDOW) for i in range(0, n - WINDOW + 1, WINDOW)]
    last = min(LAST, n)
    gap = rel(n - last, n)
    return {
        "steps": n,
        "window": WINDOW,
        "window_rel_diff": windows,
        "last_steps": last,
        "last_rel_diff": gap,
        "tolerance": FLOAT8_CURVE_TOLERANCE,
        "within": n >= 500 and abs(gap) <= FLOAT8_CURVE_TOLERANCE,
    }


def _kernels(variant: str, trainer) -> str | None:
    if not variant.startswith("loom"):
        return None
    return trainer.kernels.describe() + (f", float8={trainer.cfg.training.float8}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"from {', '.join(VARIANTS)}")
    p.add_argument("--seq", type=int, default=SEQ)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="bench/results/train_1b.json")
    p.add_argument("--commit", default=default_commit())
    p.add_argument("--run-dir", default="/tmp/loom_bench")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for every loom variant, e.g. model.flavor=8B (repeatable)",
    )
    p.add_argument(
        "--profile", action="store_true", help="also the kernel time by category of 3 profiled steps"
    )
    a = p.parse_args()
    extra = dict(kv.split("=", 1) for kv in a.set)
    if a.variant:  # child: one variant, result as the last stdout line
        res = run_variant(
            a.variant,
            a.micro_batch,
            a.steps,
            a.warmup,
            os.path.join(a.run_dir, a.variant),
            a.seq,
            extra,
            a.profile,
        )
        print("RESULT " + json.dumps(res), flush=True)
        return
    child = (
        [
            "--micro-batch",
            str(a.micro_batch),
            "--steps",
            str(a.steps),
            "--warmup",
            str(a.warmup),
            "--run-dir",
            a.run_dir,
            "--seq",
            str(a.seq),
        ]
        + [x for kv in a.set for x in ("--set", kv)]
        + (["--profile"] if a.profile else [])
    )
    results = run_children("bench.train_1b", a.variants.split(","), child, ROOT)
    by = {r["variant"]: r for r in results if "error" not in r}
    ratios = {}
    if "loom_eager" in by and "hf_eager" in by:
        ratios["loom_eager_vs_hf_eager"] = by["loom_eager"]["tokens_per_s"] / by["hf_eager"]["tokens_per_s"]
    for v in by:
        if v.startswith("loom") and "hf_compile" in by:
            ratios[f"{v}_vs_hf_compile"] = by[v]["tokens_per_s"] / by["hf_compile"]["tokens_per_s"]
    for a_, b_ in (
        ("loom_compile", "loom_compile_unfused_loss"),
        ("loom_compile", "loom_compile_torch_adamw"),
        ("loom_docs_flash", "loom_docs_sdpa"),
        ("loom_docs_flex", "loom_docs_flash"),
        ("loom_docs_auto", "loom_docs_flash"),
        ("loom_compile_float8_tensorwise", "loom_compile"),
        ("loom_compile_float8_rowwise", "loom_compile"),
        ("loom_eager", "loom_eager_plain"),
    ):
        if a_ in by and b_ in by:
            ratios[f"{a_}_vs_{b_}"] = by[a_]["tokens_per_s"] / by[b_]["tokens_per_s"]
    curves = {
        f"{v}_vs_loom_compile": curve_gap(by["loom_compile"]["losses"], by[v]["losses"])
        for v in ("loom_compile_float8_tensorwise", "loom_compile_float8_rowwise")
        if v in by and "loom_compile" in by
    }
    doc = {
        "benchmark": "train_1b",
        "environment": environment(a.commit, command()),
        "results": results,
        "ratios": ratios,
        "loss_curves": curves,
    }
    write_result(a.out, doc)
    print(f"\n{'variant':<32} {'tok/s':>10} {'MFU':>7} {'peak GiB':>9} {'first step s':>12}")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<32} ERROR {r['error'][-300:]}")
        else:
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
            print(
                f"{r['variant']:<32} {r['tokens_per_s']:>10.0f} {mfu:>7} {r['peak_reserved_gib']:>9.1f} "
                f"{r['first_step_s']:>12.1f}"
            )
    print("ratios:", json.dumps(ratios))
    for name, gap in curves.items():
        print(
            f"{name}: last {gap['last_steps']} steps {100 * gap['last_rel_diff']:+.2f}% (within: {gap['within']})"
        )


if __name__ == "__main__":
    main()

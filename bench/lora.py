"""LoRA and QLoRA fine-tuning throughput and memory: loom vs transformers + PEFT, same batches, same run, one GPU.

Rank-16 adapters (alpha 32, no dropout) on every linear (q, k, v, o, gate, up, down), the frozen base in bf16 and
the adapters in fp32 under bf16 autocast on both sides (PEFT's default upcast of adapters over a bf16 base), AdamW
on the adapters (loom: its Triton AdamW; transformers: PyTorch's fused), clipping at 1.0, seq 2048, the embedded
stdlib corpus as seq-2048 windows (an SFT loss mask changes no FLOPs). QLoRA: the base linears in NF4 with
double-quantized scales (loom: torchao; transformers: bitsandbytes 4-bit, loaded from a saved random model as
``from_pretrained`` does, then PEFT's ``prepare_model_for_kbit_training`` as TRL calls it), full activation
checkpointing. Each variant runs in its own process (clean peak memory).

    python -m bench.lora --flavor 1B --variants loom_lora,hf_peft_compile --micro-batch 4 --out bench/results/lora_1b_h100.json
    python -m bench.lora --flavor 8B --variants loom_qlora,hf_qlora_bnb --micro-batch 1 --out bench/results/qlora_8b_h100.json

Per variant: tokens/s (median step), MFU (the frozen base's forward and input-gradient FLOPs and the adapters' full
training FLOPs: ``loom.metrics.flops.flops_per_token`` with adapter parameters), the peak memory reserved during the
timed steps and over the whole process (model build included), the first step's time and the losses.
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
SEQ, RANK, ALPHA = 2048, 16, 32
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_LORA = {
    "lora.rank": str(RANK),
    "lora.alpha": str(ALPHA),
    "lora.targets": "all",
    "lora.base_dtype": "bfloat16",
}
_QLORA = {**_LORA, "lora.base_dtype": "nf4", "training.activation_checkpointing": "full"}
VARIANTS = {  # loom: config overrides; transformers: None
    "loom_lora": {**_LORA, "training.compile": "true"},
    "loom_lora_eager": _LORA,
    "loom_lora_unfused": {**_LORA, "training.compile": "true", "lora.fused": "false"},
    "loom_lora_graphs": {**_LORA, "training.compile": "true", "training.cuda_graphs": "true"},
    "loom_lora_fp32_base": {**_LORA, "lora.base_dtype": "float32", "training.compile": "true"},
    "loom_qlora": {**_QLORA, "training.compile": "true"},
    "loom_qlora_eager": _QLORA,
    "loom_full_ft": {"training.compile": "true"},  # full fine-tuning, for scale
    "hf_peft": None,
    "hf_peft_compile": None,
    "hf_qlora_bnb": None,
}


def loom_trainer(flavor: str, micro_batch: int, overrides: dict, run_dir: str, seq: int):
    from loom.config import build_config
    from loom.train.trainer import Trainer

    cfg = build_config(
        None,
        {
            "model.flavor": flavor,
            "training.seq_len": str(seq),
            "training.global_batch_size": str(micro_batch),
            "training.micro_batch_size": str(micro_batch),
            "training.dtype": "bfloat16",
            "training.steps": "1000",
            "optimizer.lr": "2e-4",
            "optimizer.weight_decay": "0.0",
            "optimizer.implementation": "auto",
            "checkpoint.at_end": "false",
            "run.dir": run_dir,
            "metrics.tensorboard": "false",
            **overrides,
        },
    )
    return Trainer(cfg)


def peft_config():
    from peft import LoraConfig

    return LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        lora_dropout=0.0,
        target_modules=HF_TARGETS,
        bias="none",
        task_type="CAUSAL_LM",
    )


def hf_lora_model(args, compile_: bool):
    """transformers' Llama in bf16 with PEFT adapters (fp32: PEFT upcasts adapters over a bf16 base)."""
    import torch
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    with torch.device("cuda"):
        model = LlamaForCausalLM(hf_llama_config(args, torch.bfloat16)).to(torch.bfloat16)
    model = get_peft_model(model, peft_config())
    return torch.compile(model) if compile_ else model


def hf_qlora_model(args, folder: str):
    """bitsandbytes NF4 (double quantization, bf16 compute) loaded from a saved random model, as a user's
    ``from_pretrained(..., quantization_config=...)``; then PEFT's k-bit preparation with gradient checkpointing, as
    TRL does for a 4-bit model."""
    import torch
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    if not os.path.exists(os.path.join(folder, "config.json")):
        with torch.device("cuda"):
            LlamaForCausalLM(hf_llama_config(args, torch.bfloat16)).to(torch.bfloat16).save_pretrained(folder)
        torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = LlamaForCausalLM.from_pretrained(
        folder, quantization_config=bnb, dtype=torch.bfloat16, device_map={"": 0}
    )
    model = prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    return get_peft_model(model, peft_config())


def run_variant(
    variant: str,
    flavor: str,
    micro_batch: int,
    steps: int,
    warmup: int,
    run_dir: str,
    seq: int,
    profile_steps: bool = False,
) -> dict:
    import torch

    from loom.config.sections import LoraConfig
    from loom.metrics.flops import flops_per_token, peak_flops
    from loom.models.llama import FLAVORS
    from loom.train.trainer import count_params

    torch.manual_seed(0)
    overrides = VARIANTS[variant]
    # the data of every variant: loom's stdlib windows (for transformers, a one-layer loom model reads them)
    trainer = loom_trainer(
        flavor,
        micro_batch,
        overrides if overrides is not None else {"model.n_layers": "1"},
        os.path.join(run_dir, variant),
        seq,
    )
    args = trainer.model_args.with_(n_layers=FLAVORS[flavor].n_layers)
    batches = [trainer.loader.next_step().micro_batches for _ in range(warmup + steps)]
    kernels = trainer.kernels.describe() if overrides is not None else None
    if overrides is not None:
        step_fn = trainer.train_step
        trainable = sum(p.numel() for p in trainer.params if p.requires_grad)
        full_ft = "lora.rank" not in overrides
    else:
        del trainer
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if variant == "hf_qlora_bnb":
            model = hf_qlora_model(args, os.path.join(run_dir, "hf_random_base"))
        else:
            model = hf_lora_model(args, variant == "hf_peft_compile")
        params = [p for p in model.parameters() if p.requires_grad]
        trainable = sum(p.numel() for p in params)
        full_ft = False
        opt = torch.optim.AdamW(params, lr=2e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
        model.train()
        step_fn = hf_train_step(model, params, opt)

    expected = count_params(args, LoraConfig(rank=RANK, alpha=ALPHA))[1]
    assert full_ft or trainable == expected, (
        f"{variant}: {trainable} trainable parameters, loom's count {expected}"
    )
    build_peak = torch.cuda.max_memory_reserved() / 2**30
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    times, losses, first_step_s, gpus = time_steps(step_fn, batches[: warmup + steps], warmup)
    profile = (
        profile_steps_by_kind(step_fn, batches[warmup : warmup + 4], run_dir, variant)
        if profile_steps
        else None
    )
    tps = micro_batch * seq / statistics.median(times)
    peak = peak_flops(torch.cuda.get_device_name(), "bfloat16")
    flops = flops_per_token(args, seq, None if full_ft else expected)
    return {
        "variant": variant,
        "flavor": flavor,
        "overrides": overrides,
        "kernels": kernels,
        "micro_batch": micro_batch,
        "seq_len": seq,
        "trainable_params": trainable,
        "steps_timed": steps,
        "warmup_steps": warmup,
        "step_s_median": statistics.median(times),
        "step_s_min": min(times),
        "step_s_max": max(times),
        "tokens_per_s": tps,
        "flops_per_token": flops,
        "mfu": tps * flops / peak if peak else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "build_peak_reserved_gib": build_peak,
        "first_step_s": first_step_s,
        "gpus": gpus,
        "joules_per_token": joules_per_token(gpus, tps),
        "losses": losses,
        "profile": profile,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--variants", default="loom_lora,hf_peft_compile", help=f"from {', '.join(VARIANTS)}")
    p.add_argument("--flavor", default="1B")
    p.add_argument("--seq", type=int, default=SEQ)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="bench/results/lora.json")
    p.add_argument("--commit", default=default_commit())
    p.add_argument("--run-dir", default="/tmp/loom_bench_lora")
    p.add_argument(
        "--profile", action="store_true", help="also the kernel time by category of 3 profiled steps"
    )
    a = p.parse_args()
    if a.variant:  # child: one variant, result as the last stdout line
        res = run_variant(a.variant, a.flavor, a.micro_batch, a.steps, a.warmup, a.run_dir, a.seq, a.profile)
        print("RESULT " + json.dumps(res), flush=True)
        return
    child = [
        "--flavor",
        a.flavor,
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
    ] + (["--profile"] if a.profile else [])
    results = run_children("bench.lora", a.variants.split(","), child, ROOT)
    by = {r["variant"]: r for r in results if "error" not in r}
    ratios = {}
    for loom_v, hf_v in (
        ("loom_lora", "hf_peft_compile"),
        ("loom_lora_graphs", "hf_peft_compile"),
        ("loom_lora", "hf_peft"),
        ("loom_lora_eager", "hf_peft"),
        ("loom_qlora", "hf_qlora_bnb"),
        ("loom_qlora_eager", "hf_qlora_bnb"),
    ):
        if loom_v in by and hf_v in by:
            ratios[f"{loom_v}_vs_{hf_v}"] = {
                "tokens_per_s": by[loom_v]["tokens_per_s"] / by[hf_v]["tokens_per_s"],
                "peak_reserved": by[loom_v]["peak_reserved_gib"] / by[hf_v]["peak_reserved_gib"],
            }
    doc = {
        "benchmark": "lora",
        "environment": environment(a.commit, command()),
        "results": results,
        "ratios": ratios,
    }
    write_result(a.out, doc)
    print(f"\n{'variant':<22} {'tok/s':>9} {'MFU':>6} {'peak GiB':>9} {'build GiB':>9} {'first s':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<22} ERROR {r['error'][-600:]}")
        else:
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
            print(
                f"{r['variant']:<22} {r['tokens_per_s']:>9.0f} {mfu:>6} {r['peak_reserved_gib']:>9.2f} "
                f"{r['build_peak_reserved_gib']:>9.2f} {r['first_step_s']:>8.1f}"
            )
    print("ratios:", json.dumps(ratios))


if __name__ == "__main__":
    main()

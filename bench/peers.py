"""loom against torchtitan on the same GPUs, one after the other in one call, every setting matched.

A workload (``--workload``: ``llama3_3b``, ``llama3_8b``, ``qwen3_moe_12l``, ``deepseek_v3_proxy``) names a model
shape both frameworks build, the GPUs, sequence length, batch, activation checkpointing and compile. For it this tool

1. writes the shared inputs into ``--run-dir``: a text file (``data/data.jsonl``, one document per line, from this
   Python's standard-library sources, as loom's embedded default) and a ``tokenizer.json`` of the model's vocabulary
   size made with ``tokenizers`` (a byte-level BPE trained on that text, filled up with reserved tokens);
2. runs torchtitan's own trainer unchanged, ``python -m torch.distributed.run ... -m torchtitan.train --job.config_file
   <toml>``, with the TOML this tool writes (``titan_config``) and the model shape registered as a flavor by a module
   it imports (``experimental.custom_import``, the trainer's hook for it; the flavor starts from torchtitan's own,
   e.g. its ``30B-A3B`` with fewer layers);
3. runs ``loom train`` with the same settings (``loom_config``) on the same file (tokenized beforehand by ``loom data
   prepare``) and tokenizer;
4. writes one JSON: both sides' median tokens/s per GPU after ``--warmup`` steps, MFU on torchtitan's and on loom's
   FLOP convention, peak reserved memory, launch-to-first-step seconds, the ratio loom / torchtitan, the settings
   matched and every remaining difference (``DIFFERENCES`` and the workload's own), device, versions, commit, command.

Settings matched (anchors of the 2026-11-27 pair): fp32 master weights, bf16 parameters for compute, fp32 gradient
reduction (FSDP2 over every GPU; expert parallelism where the workload has it), per-block compile, op-level selective
AC, AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1; each framework's default kernel), clipping at 1.0,
``PYTORCH_ALLOC_CONF=expandable_segments:True``, SDPA with torchtitan's backend priority (cuDNN, flash, math; set
for loom's processes by a ``sitecustomize`` that the loom side alone gets: ``--loom-sdpa default`` leaves PyTorch's
order), a metrics line every step on both sides. torchtitan's trainer needs a CUDA device (it sets ``cuda:<local rank>``), so this runs on
GPUs only; tests/unit/test_bench_peers.py checks the config writing and log parsing on the CPU.

torchtitan 0.2.2 and what it needs that the GPU image lacks travel as wheels: ``python -m bench.peers
--download-wheels bench/wheels`` here (a git-ignored folder: carry it), then on the GPU machine

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site bench/wheels/*.whl && \\
        export PYTHONPATH=/tmp/site:$PYTHONPATH && \\
        python3 -m bench.peers --workload llama3_3b --out $OUT/peers_llama3_3b_2gpu_h200.json
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import asdict, dataclass, field, replace

from bench.common import (
    JOB_ENV,
    GpuSampler,
    command,
    default_commit,
    environment,
    failure,
    joules_per_token,
    write_result,
)

# what torchtitan 0.2.2 needs that the GPU image lacks (it has torch 2.11, tokenizers, pyarrow, pandas, xxhash,
# fsspec, einops, pillow, tensorboard): each pinned, fetched with --no-deps for CPython 3.12 on x86-64 Linux
WHEELS = (
    "torchtitan==0.2.2",
    "tyro==1.0.17",
    "docstring-parser==0.18.0",
    "typeguard==4.6.1",
    "typing-extensions==4.16.0",  # typeguard needs >= 4.14; the image's version is not on record
    "torchdata==0.11.0",
    "datasets==5.2.0",
    "dill==0.4.1",
    "multiprocess==0.70.19",
)
# what the other GPU benches carry beside them (bench.grpo's TRL, float8 and QLoRA's torchao), fetched in the same
# call so one folder serves every device run
OTHER_WHEELS = ("trl==1.16.0", "torchao==0.17.0")
ALLOC_CONF = "expandable_segments:True"
FLAVOR = "loom_peer"  # the name the registered torchtitan flavor gets
FLAVOR_MODULE = "loom_peer_flavor"  # the module torchtitan imports (experimental.custom_import)
# torchtitan's model-args dict of each model it ships (torchtitan/models/<name>/__init__.py)
TITAN_ARGS_DICT = {"llama3": "llama3_args", "qwen3": "qwen3_args", "deepseek_v3": "deepseekv3_args"}
LR, BETAS, EPS, WEIGHT_DECAY, MAX_NORM, MIN_LR = 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0, 0.1


@dataclass(frozen=True)
class Workload:
    """One model shape as both frameworks build it. ``titan_base``: the torchtitan flavor it starts from, changed by
    ``titan_args`` (its model args), ``titan_moe`` (its ``moe_args``) and ``titan_rope`` (llama3's
    ``rope_scaling_args``); ``loom_flavor`` changed by ``loom_model`` (``model.*`` fields). ``local_batch``:
    sequences per GPU per step (one micro-batch); ``ep``: expert-parallel degree inside the FSDP ranks."""

    name: str
    gpus: int
    seq: int
    local_batch: int
    vocab: int
    titan_model: str
    titan_base: str
    loom_flavor: str
    titan_args: dict = field(default_factory=dict)
    titan_moe: dict = field(default_factory=dict)
    titan_rope: dict = field(default_factory=dict)
    loom_model: dict = field(default_factory=dict)
    ep: int = 1
    ac: str = "op"
    compile: bool = True
    differences: tuple[str, ...] = ()


# what differs in each MoE family's two implementations beyond DIFFERENCES
QWEN3_DIFFERENCES = (
    "torchtitan's qwen3 MoE keeps a zero expert_bias buffer that it adds to the router scores and never updates (its "
    "qwen3 spec builds plain optimizers, not the load-balancing ones); loom's Qwen3-MoE has no selection bias",
)
DEEPSEEK_DIFFERENCES = (
    "torchtitan updates its expert biases in an optimizer hook from the loads counted in every block's forward; loom "
    "counts them in the compiled graph too, except under expert parallelism (eagerly there, a graph break per MoE "
    "block), and updates after the step",
)

WORKLOADS = {
    w.name: w
    for w in [
        # the 2026-11-27 pair (anchors): torchtitan ships no 3B llama3 flavor, so its 8B's args get the 3B shape;
        # untied embeddings as torchtitan's llama3 has no tying; Llama 3.2's RoPE scaling (factor 32) as loom's 3B
        Workload(
            "llama3_3b",
            gpus=2,
            seq=8192,
            local_batch=1,
            vocab=128256,
            titan_model="llama3",
            titan_base="8B",
            titan_args=dict(
                dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=None, multiple_of=1024
            ),
            titan_rope=dict(scaling_factor=32.0),
            loom_flavor="3B",
            loom_model={"model.tie_embeddings": "false"},
        ),
        # loom's debug flavor as torchtitan's debugmodel changed: what --sides loom --device cpu smoke-runs here
        Workload(
            "llama3_debug",
            gpus=2,
            seq=256,
            local_batch=2,
            vocab=2048,
            titan_model="llama3",
            titan_base="debugmodel",
            titan_args=dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=64, rope_theta=10000.0),
            loom_flavor="debug",
            ac="none",
            compile=False,
        ),
        # needs ~89 GiB per GPU on 2 GPUs (H200); on 80 GB cards run it with --gpus 4
        Workload(
            "llama3_8b",
            gpus=2,
            seq=8192,
            local_batch=1,
            vocab=128256,
            titan_model="llama3",
            titan_base="8B",
            loom_flavor="8B",
        ),
        # Qwen3-30B-A3B's shape (128 experts, top 8, q/k norms) with 12 of its 48 blocks (as bench/recipes.py's
        # qwen3_moe_12l), experts split over 2 GPUs; no auxiliary loss on either side (torchtitan has none)
        Workload(
            "qwen3_moe_12l",
            gpus=2,
            seq=4096,
            local_batch=2,
            vocab=151936,
            titan_model="qwen3",
            titan_base="30B-A3B",
            titan_args=dict(n_layers=12),
            loom_flavor="qwen3_moe_30b_a3b",
            loom_model={"model.n_layers": 12, "model.moe_aux_loss": 0.0},
            ep=2,
            differences=QWEN3_DIFFERENCES,
        ),
        # DeepSeek-V3's shape (MLA with q compression, 1 shared + routed experts, sigmoid group-limited routing,
        # aux-loss-free bias at 1e-3 per step, 3 dense blocks first) with 4 blocks (the 4th with experts) and 64 of
        # its 256 experts, as bench/recipes.py's proxy: 6.6B parameters, about 53 GB of fp32 weights, gradients
        # and AdamW state per GPU on 2 (5 blocks: 9.7B, 78 GB; --layers 5 where the GPUs have room); no MTP
        # and no sequence-wise auxiliary loss (torchtitan has neither); SDPA causal instead of its flavor's Flex
        # block-causal attention (loom's documents are not separated either)
        Workload(
            "deepseek_v3_proxy",
            gpus=2,
            seq=4096,
            local_batch=1,
            vocab=129280,
            titan_model="deepseek_v3",
            titan_base="671B",
            titan_args=dict(n_layers=4, attn_type="sdpa", attn_mask_type="causal"),
            titan_moe=dict(num_experts=64),
            loom_flavor="deepseek_v3_671b",
            loom_model={
                "model.n_layers": 4,
                "model.moe_experts": 64,
                "model.mtp_depth": 0,
                "model.moe_aux_loss": 0.0,
            },
            ep=2,
            differences=DEEPSEEK_DIFFERENCES,
        ),
        # one GPU (the kind lent when no 2-GPU machine is): Qwen3-30B-A3B's shape with 8 of its 48 blocks, every
        # expert on the one GPU (no expert parallelism: no token exchange and no host read of the counts on either
        # side), 5.6B parameters (~91 GiB by loom plan on an H200)
        Workload(
            "qwen3_moe_8l_1gpu",
            gpus=1,
            seq=4096,
            local_batch=2,
            vocab=151936,
            titan_model="qwen3",
            titan_base="30B-A3B",
            titan_args=dict(n_layers=8),
            loom_flavor="qwen3_moe_30b_a3b",
            loom_model={"model.n_layers": 8, "model.moe_aux_loss": 0.0},
            differences=QWEN3_DIFFERENCES,
        ),
        # one GPU: DeepSeek-V3's block shapes (as deepseek_v3_proxy) with 3 blocks of which 2 hold experts, 32 of
        # its 256 experts (groups of 4, top 4 of 8 groups), so most of the step is the MoE blocks' as in the full
        # model (58 of 61), where the 2-GPU proxy is 3 dense blocks of 4: 5.7B parameters, ~92 GB of fp32 weights,
        # gradients and AdamW state (~96 GiB by loom plan, +4% on the 2-GPU proxy)
        Workload(
            "deepseek_v3_3l_1gpu",
            gpus=1,
            seq=4096,
            local_batch=1,
            vocab=129280,
            titan_model="deepseek_v3",
            titan_base="671B",
            titan_args=dict(n_layers=3, n_dense_layers=1, attn_type="sdpa", attn_mask_type="causal"),
            titan_moe=dict(num_experts=32),
            loom_flavor="deepseek_v3_671b",
            loom_model={
                "model.n_layers": 3,
                "model.first_k_dense": 1,
                "model.moe_experts": 32,
                "model.mtp_depth": 0,
                "model.moe_aux_loss": 0.0,
            },
            differences=DEEPSEEK_DIFFERENCES,
        ),
    ]
}


def with_layers(w: Workload, layers: int) -> Workload:
    """The workload with ``layers`` transformer blocks on both sides (the MoE families keep their dense first ones)."""
    return replace(
        w,
        titan_args={**w.titan_args, "n_layers": layers},
        loom_model={**w.loom_model, "model.n_layers": layers},
    )


# what stays different whatever the workload (each framework's own implementation of a matched setting)
DIFFERENCES = (
    "loss: torchtitan computes the full bf16 logits and a compiled cross-entropy (compile.components = model, loss); "
    "loom its fused linear + cross-entropy in chunks (model.fused_loss auto), outside the compiled blocks",
    "op-level AC: each framework's own policy; both save every attention output and every second matmul, torchtitan "
    "also the outputs of reduce-scatter and max",
    "weight decay 0.1: torchtitan on every parameter, loom on matrices only",
    "AdamW kernel: torchtitan PyTorch's fused one (optimizer.implementation = fused), loom its default "
    "(optimizer.implementation auto: its Triton kernel on CUDA, as in the 2026-11-27 pair; with parameters on two "
    "meshes, as under expert parallelism, loom's PyTorch fused choice falls back to a per-parameter step); "
    "--loom-set optimizer.implementation=fused runs PyTorch's on both",
    "FSDP2's gradient copy into the reduce-scatter buffer: torchtitan PyTorch's chunk_cat, loom its own kernel "
    "(parallel.fsdp_grad_copy auto, since 2026-11-30; the same bytes); --loom-set parallel.fsdp_grad_copy=torch "
    "runs PyTorch's on both",
    "documents: torchtitan adds BOS and EOS to each, loom EOS only (same file, same tokenizer)",
    "data: torchtitan tokenizes the text on the fly (in --titan-workers data-loader processes, 1 by default; 0 = in "
    "its training loop); loom reads the same text tokenized before its launch (loom data prepare, not timed)",
    "LR schedule: both warm up over the same steps to 3e-4 then decay by cosine to 0.1 of it (torchtitan's "
    "lr_scheduler, loom's optimizer.schedule); no effect on speed",
    "garbage collection: both turn Python's automatic collection off and collect the young generations every 50 "
    "steps (torchtitan's training.gc_freq, loom's training.gc_every); loom also collects every generation each "
    "500 steps",
    "peak memory: torchtitan logs rank 0's max reserved, loom the largest rank's max reserved",
    "OMP_NUM_THREADS: torchrun's 1 for torchtitan, loom's launcher the CPUs the job may use over the local ranks "
    "(environment.cpus); straggler timing: loom times every NCCL collective (metrics.straggler_fraction 0.2, "
    "TORCH_NCCL_ENABLE_TIMING), torchtitan none",
    "initialization: each framework's own (no effect on speed)",
)


# ------------------------------------------------------------------------------------------ the shared inputs
def write_text(path: str, megabytes: float) -> int:
    """A jsonl file of ``megabytes`` of this Python's standard-library sources, one document per file (sorted, so
    the same text each time): the text both sides train on. Returns the documents written."""
    root = sysconfig.get_paths()["stdlib"]
    skip = ("site-packages", "__pycache__", "test", "tests", "idlelib")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    budget, docs = int(megabytes * 2**20), 0
    with open(path, "w") as fh:
        for f in files:
            with open(f, encoding="utf-8", errors="replace") as src:
                text = src.read()
            if not text.strip():
                continue
            fh.write(json.dumps({"text": text}) + "\n")
            docs += 1
            budget -= len(text)
            if budget <= 0:
                break
    return docs


def make_tokenizer(
    folder: str, text_path: str, vocab: int, bpe_vocab: int = 8192, train_mb: float = 2.0
) -> int:
    """``folder/tokenizer.json`` of exactly ``vocab`` tokens: a byte-level BPE of ``bpe_vocab`` tokens trained on
    the first ``train_mb`` MB of ``text_path`` (BOS ``<|begin_of_text|>``, EOS ``<|end_of_text|>``), then ``<|reserved_i|>`` special tokens up to
    ``vocab`` (as Llama 3's reserved tokens); and the ``tokenizer_config.json`` torchtitan reads BOS/EOS from.
    Returns the vocabulary size written."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(bpe_vocab, vocab),
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        left = train_mb * 2**20
        with open(text_path) as fh:
            for line in fh:
                text = json.loads(line)["text"]
                yield text
                left -= len(text)
                if left <= 0:
                    return

    tok.train_from_iterator(texts(), trainer)
    missing = vocab - tok.get_vocab_size()
    if missing < 0:
        raise SystemExit(f"tokenizer: {tok.get_vocab_size()} tokens trained, more than the model's {vocab}")
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as fh:
        json.dump({"bos_token": special[0], "eos_token": special[1]}, fh)
    return tok.get_vocab_size()


# ------------------------------------------------------------------------------------------ torchtitan's side
def flavor_module(w: Workload) -> str:
    """The source of the module torchtitan imports before it builds the model: it adds flavor ``loom_peer`` to the
    model's args dict, a copy of ``titan_base`` with the workload's changes."""
    lines = [
        f'"""Written by bench.peers for workload {w.name}: torchtitan flavor {FLAVOR!r} = {w.titan_base!r} changed."""',
        "import copy",
        "import dataclasses",
        f"from torchtitan.models.{w.titan_model} import {TITAN_ARGS_DICT[w.titan_model]} as flavors",
        "",
        f"args = copy.deepcopy(flavors[{w.titan_base!r}])",
        f"args = dataclasses.replace(args, **{w.titan_args!r})",
    ]
    if w.titan_moe:
        lines.append(f"args.moe_args = dataclasses.replace(args.moe_args, **{w.titan_moe!r})")
    if w.titan_rope:
        lines.append(
            f"args.rope_scaling_args = dataclasses.replace(args.rope_scaling_args, **{w.titan_rope!r})"
        )
    lines.append(f"flavors[{FLAVOR!r}] = args")
    return "\n".join(lines) + "\n"


def ac_sections(ac: str) -> dict:
    """loom's training.activation_checkpointing as torchtitan's [activation_checkpoint]."""
    if ac == "op":
        return {"mode": "selective", "selective_ac_option": "op"}
    if ac in ("full", "none"):
        return {"mode": ac}
    raise SystemExit(f"--ac {ac}: torchtitan has no match for it (allowed: op, full, none)")


def float8_sections(float8: str, all_gather: bool) -> dict:
    """loom's training.float8 (and float8_all_gather) as torchtitan's float8 converter: the same torchao recipe on
    every block linear, the output head left in bf16 (loom never converts it). With the float8 gather, the scales
    precomputed after each step, as loom's; torchtitan 0.2.2 refuses a recipe name with the gather, and without one
    it builds torchao's default config, the tensorwise recipe."""
    if float8 == "none":
        return {}
    section = {"recipe_name": float8} if not all_gather else {}
    section.update(
        enable_fsdp_float8_all_gather=all_gather,
        precompute_float8_dynamic_scale_for_fsdp=all_gather,
        filter_fqns=["output"],
    )
    return {"quantize.linear.float8": section}


@dataclass(frozen=True)
class Matched:
    """The settings both sides run with (the command line's): steps, LR warm-up, activation checkpointing,
    compile, float8 and the gradient reduction's dtype."""

    steps: int = 30
    lr_warmup: int = 10
    ac: str = "op"
    compile: bool = True
    float8: str = "none"
    float8_all_gather: bool = False
    reduce_dtype: str = "float32"


def titan_config(w: Workload, gpus: int, paths: dict, m: Matched, workers: int = 1) -> dict:
    """torchtitan's job config (TOML sections) for the workload."""
    converters = {"converters": ["quantize.linear.float8"]} if m.float8 != "none" else {}
    return {
        "job": {"dump_folder": paths["titan_dir"], "description": f"bench.peers {w.name}"},
        "metrics": {"log_freq": 1, "disable_color_printing": True, "enable_tensorboard": False},
        "model": {
            "name": w.titan_model,
            "flavor": FLAVOR,
            "hf_assets_path": paths["tokenizer"],
            **converters,
        },
        **float8_sections(m.float8, m.float8_all_gather),
        "optimizer": {
            "name": "AdamW",
            "lr": LR,
            "beta1": BETAS[0],
            "beta2": BETAS[1],
            "eps": EPS,
            "weight_decay": WEIGHT_DECAY,
            "implementation": "fused",
        },
        "lr_scheduler": {"warmup_steps": m.lr_warmup, "decay_type": "cosine", "min_lr_factor": MIN_LR},
        "training": {
            "dataset": "c4_test",  # its loader for a local folder of jsonl files: load_dataset(path, split="train")
            "dataset_path": paths["data_dir"],
            "local_batch_size": w.local_batch,
            "global_batch_size": w.local_batch * gpus,
            "seq_len": w.seq,
            "max_norm": MAX_NORM,
            "steps": m.steps,
            "dtype": "float32",
            "mixed_precision_param": "bfloat16",
            "mixed_precision_reduce": m.reduce_dtype,
        },
        # tokenizing in a worker process, off the step's critical path (loom reads a token file made before training)
        "training.dataloader": {"num_workers": workers, "persistent_workers": workers > 0},
        "parallelism": {
            "data_parallel_replicate_degree": 1,
            "data_parallel_shard_degree": -1,
            "tensor_parallel_degree": 1,
            "pipeline_parallel_degree": 1,
            "context_parallel_degree": 1,
            "expert_parallel_degree": w.ep,
        },
        "activation_checkpoint": ac_sections(m.ac),
        "compile": {"enable": m.compile, "components": ["model", "loss"]},
        "checkpoint": {"enable": False},
        "validation": {"enable": False},
        "experimental": {"custom_import": FLAVOR_MODULE},
    }


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


def _toml_literal(text: str):
    """A ``--titan-set`` value: a number, true/false or a [list] as JSON reads it, else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def to_toml(cfg: dict) -> str:
    """Sections of scalars and lists as TOML (what torchtitan's config needs; no nested tables)."""
    out = []
    for section, values in cfg.items():
        out.append(f"[{section}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        out.append("")
    return "\n".join(out)


def titan_command(gpus: int, toml_path: str) -> list[str]:
    """torchtitan's own launch line (its run_train.sh): rank 0's output only, tee'd."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={gpus}",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        "--local-ranks-filter=0",
        "--role=rank",
        "--tee=3",
        "-m",
        "torchtitan.train",
        "--job.config_file",
        toml_path,
    ]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<grad_norm>\S+)\s+"
    r"memory:\s*(?P<mem>[\d.]+)GiB\((?P<mem_pct>[\d.]+)%\)\s+tps:\s*(?P<tps>[\d,]+)\s+"
    r"tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+)%"
)
_PEAK = re.compile(r"Peak FLOPS used for computing MFU:\s*(?P<peak>[\d.e+]+)")
_PARAMS = re.compile(r"size:\s*(?P<n>[\d,]+) total parameters")
_BUILD = re.compile(r"Building \S+ \S+?with (?P<json>\{.*)", re.S)


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def parse_titan_log(text: str) -> dict:
    """torchtitan's console output -> its step lines ({step, loss, grad_norm, mem_gib, mem_pct, tps, tflops, mfu},
    mfu as a fraction), the peak FLOP/s its MFU divides by, its parameter count and model args (the JSON of its
    'Building ...' line). Colour codes and torchrun's ``[rank0]:`` prefixes are ignored."""
    text = _ANSI.sub("", text)
    steps = []
    for m in _STEP.finditer(text):
        steps.append(
            {
                "step": int(m["step"]),
                "loss": float(m["loss"]),
                "grad_norm": float(m["grad_norm"]),
                "mem_gib": float(m["mem"]),
                "mem_pct": float(m["mem_pct"]),
                "tps": _number(m["tps"]),
                "tflops": _number(m["tflops"]),
                "mfu": float(m["mfu"]) / 100,
            }
        )
    out: dict = {"steps": steps}
    if m := _PEAK.search(text):
        out["peak_flops"] = float(m["peak"])
    if m := _PARAMS.search(text):
        out["params"] = int(_number(m["n"]))
    if m := _BUILD.search(text):
        out["model_args"] = _model_args_json(m["json"])
    return out


def _model_args_json(text: str) -> dict | None:
    """The JSON object at the start of ``text`` (torchtitan prints it over several lines; a torchrun prefix may
    start each of them)."""
    text = re.sub(r"(?m)^\[rank\d+\]:", "", text)
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except json.JSONDecodeError:
        return None


# ------------------------------------------------------------------------------------------------ loom's side
def loom_config(w: Workload, gpus: int, paths: dict, m: Matched, device: str = "cuda") -> dict:
    """``loom train`` settings (dotted name -> value) matched to ``titan_config``."""
    return {
        "parallel.reduce_dtype": m.reduce_dtype,
        "training.float8": m.float8,
        "training.float8_all_gather": str(m.float8_all_gather).lower(),
        "model.flavor": w.loom_flavor,
        "model.vocab_size": w.vocab,
        "model.tie_embeddings": "false",
        "model.attention": "sdpa",
        **w.loom_model,
        "data.source": paths["loom_tokens"],  # the text file tokenized beforehand (prepare_loom_tokens)
        "data.tokenizer": paths["tokenizer"],
        "data.cache_dir": paths["loom_cache"],
        "training.seq_len": w.seq,
        "training.global_batch_size": w.local_batch * gpus,
        "training.micro_batch_size": w.local_batch,
        "training.steps": m.steps,
        "training.dtype": "bfloat16",
        "training.compile": str(m.compile).lower(),
        "training.activation_checkpointing": m.ac,
        "training.max_norm": MAX_NORM,
        "training.eval_at_end": "false",
        "optimizer.lr": LR,
        "optimizer.eps": EPS,
        "optimizer.weight_decay": WEIGHT_DECAY,
        "optimizer.warmup_steps": m.lr_warmup,
        "optimizer.schedule": "cosine",
        "optimizer.min_lr_ratio": MIN_LR,
        "parallel.dp_shard": gpus,
        "parallel.ep": w.ep,
        "metrics.every": 1,
        "metrics.tensorboard": "false",
        "checkpoint.at_end": "false",
        "run.device": device,
        "run.dir": paths["loom_dir"],
    }


def loom_shape(cfg: dict) -> dict:
    """Parameters and training FLOPs per token of the model ``cfg`` builds (on the meta device), to set beside
    torchtitan's count of its own (the two must agree for a matched shape)."""
    import torch

    from loom.config import build_config
    from loom.data.tokenizers import build_tokenizer
    from loom.models.registry import build_model, spec_of
    from loom.resolve import resolve_model_args

    c = build_config(None, {k: str(v) for k, v in cfg.items()})
    args = resolve_model_args(c, build_tokenizer(c.data.tokenizer))
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(args).parameters())
    return {"params": params, "flops_per_token": spec_of(args).flops_per_token(args, c.training.seq_len)}


# torchtitan's SDPA setting (torchtitan/models/attention.py: ScaledDotProductAttentionWrapper) for a whole process
SDPA_SITECUSTOMIZE = '''"""Written by bench.peers: SDPA as torchtitan sets it (cuDNN, flash, math; that priority) for this process."""
from torch.nn.attention import SDPBackend, _sdpa_kernel

_sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH], set_priority=True)

# this file shadows any other sitecustomize on the path (the image's, say): run that one too
import os as _os
import sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
for _d in _sys.path:
    _p = _os.path.join(_d or ".", "sitecustomize.py")
    if _os.path.abspath(_d or ".") != _here and _os.path.isfile(_p):
        with open(_p) as _f:
            exec(compile(_f.read(), _p, "exec"), {"__name__": "sitecustomize", "__file__": _p})
        break
'''
_LOOM_STEP = re.compile(r"^step\s+\d+/\d+\b")  # loom's console line (loom.metrics.logger.format_line)


def prepare_loom_tokens(paths: dict) -> float:
    """``loom data prepare`` of the shared text file into ``loom_tokens``: loom tokenizes before its launch is timed,
    as torchtitan's tokenizing happens in its data-loader workers during the steps. Returns the seconds it took."""
    t0 = time.time()
    cmd = [sys.executable, "-c", "from loom.cli.main import entry; entry()", "data", "prepare"]
    cmd += [
        "--source",
        paths["data_file"],
        "--output",
        paths["loom_tokens"],
        "--tokenizer",
        paths["tokenizer"],
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"bench.peers: loom data prepare failed:\n{(proc.stderr or proc.stdout)[-2000:]}")
    return round(time.time() - t0, 1)


def loom_command(cfg: dict, gpus: int) -> list[str]:
    args = ["train", "--nproc-per-node", str(gpus)] + [f"--{k}={v}" for k, v in cfg.items()]
    return [sys.executable, "-c", "from loom.cli.main import entry; entry()"] + args


# ------------------------------------------------------------------------------------------------- running
def stream(cmd: list[str], env: dict, timeout: float, log_path: str, first: re.Pattern) -> dict:
    """Runs ``cmd``, its output to ``log_path`` as it comes: exit code, the output, seconds from launch to the first
    line ``first`` matches (the first step's metrics: start-up, compilation and that step), wall seconds."""
    t0 = time.time()
    first_s = None
    lines = []
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    killed = []

    def kill():  # the whole process group (torchrun's workers too), also when it has stopped printing
        killed.append(True)
        os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(timeout, kill)
    watchdog.start()
    with open(log_path, "w") as log, GpuSampler() as gpus:
        for line in proc.stdout:
            log.write(line)
            lines.append(line)
            if first_s is None and first.search(_ANSI.sub("", re.sub(r"^\[rank\d+\]:", "", line))):
                first_s = time.time() - t0
        rc = proc.wait()
    watchdog.cancel()
    if killed:
        lines.append(f"bench.peers: killed after {timeout:.0f} s\n")
    return {
        "rc": rc,
        "output": "".join(lines),
        "first_step_s": first_s,
        "wall_s": round(time.time() - t0, 1),
        "gpus": gpus.summary(),
    }


def timed(values: list, warmup: int, profiled: int = 0) -> list:
    """The values of the steps after the first ``warmup`` (all of them where there are no more), less the last
    ``profiled`` (--profile: the profiler's warm-up step and the steps it records, which it slows)."""
    values = values[:-profiled] if profiled and len(values) > profiled else values
    return values[warmup:] or values


def titan_profiling(steps: int) -> dict:
    """torchtitan's [profiling] section tracing its last step (torchtitan/tools/profiling.py: a schedule of
    profile_freq - warmup - active steps waiting, then one warm-up and one active step)."""
    return {
        "enable_profiling": True,
        "save_traces_folder": "profile_traces",
        "profile_freq": steps,
        "profiler_warmup": 1,
        "profiler_active": 1,
    }


def loom_profiling(steps: int, host: bool = True) -> dict:
    """loom's built-in profiler (loom.metrics.profile) on the last two steps, whose last is summarized: the first
    recorded step starts from a drained GPU (loom's profiler waits for it), with none of the host's lead an
    unprofiled step has, while torchtitan's profiler does not wait. ``host`` false (metrics.profile_host: a trace of
    the GPU alone, no step ranges to tell the two apart): the last step only. No memory snapshot: its history of
    allocations slows the profiled steps, and torchtitan's profile (its default) has none."""
    first = steps - 1 if host and steps > 1 else steps
    return {"metrics.profile_steps": f"{first}:{steps}", "metrics.profile_memory": "false"}


def profile_summary(trace_path: str, keep_dir: str, label: str, skip_first: bool = False) -> dict:
    """The profiled step's GPU time by kernel category, top kernels and exposed communication
    (loom.metrics.trace_summary) from rank 0's trace, and each other rank's span, busy time and communication (a
    rank that waits on a late peer shows it there, rank 0's NCCL kernels lasting longer than their bytes need); the
    traces gzipped into ``keep_dir`` when one is given, named by ``label`` (workload and side, so the calls of one
    script keep each other's) and rank. Other ranks' traces are found by the name with ``rank0`` replaced."""
    from loom.metrics.trace_summary import summarize

    if not os.path.exists(trace_path):
        return {"error": f"no trace at {trace_path}"}
    # ``skip_first``: the summary leaves out the first of the recorded steps (loom's, which starts drained)
    out: dict = {}
    rank = 0
    while os.path.exists(path := trace_path.replace("rank0", f"rank{rank}")):
        with open(path, "rb") as fh:
            raw = fh.read()
        try:
            summary = summarize(json.loads(raw), skip_first=skip_first)
        except SystemExit as e:  # no GPU kernels (a CPU smoke run)
            return {"error": str(e), "trace": path}
        if rank == 0:
            out = {"trace": path, **summary}
        else:
            out.setdefault("other_ranks", {})[str(rank)] = {
                k: summary[k]
                for k in (
                    "gpu_span_ms_per_step",
                    "gpu_busy_ms_per_step",
                    "gpu_idle_fraction",
                    "exposed_communication_ms_per_step",
                )
                if k in summary
            } | {"communication_ms_per_step": summary["by_category_ms_per_step"].get("communication", 0.0)}
            gathers = summary.get("fsdp_gathers")
            if gathers:  # which rank waits for the other's gathers, and which for its own host
                out["other_ranks"][str(rank)]["fsdp_gathers"] = {
                    k: v for k, v in gathers.items() if k != "largest_waits"
                }
        if keep_dir:
            os.makedirs(keep_dir, exist_ok=True)
            kept = os.path.join(keep_dir, f"{label}_trace_rank{rank}.json.gz")
            with gzip.open(kept, "wb", compresslevel=6) as fh:
                fh.write(raw)
            out.setdefault("kept", []).append(kept)
        if "rank0" not in trace_path:
            break
        rank += 1
    return out


def matched(a) -> Matched:
    """The command line's shared settings."""
    return Matched(a.steps, a.lr_warmup, a.ac, a.compile, a.float8, a.float8_all_gather, a.reduce_dtype)


def run_titan(w: Workload, gpus: int, a, paths: dict) -> dict:
    cfg = titan_config(w, gpus, paths, matched(a), a.titan_workers)
    for kv in a.titan_set:  # section.key=value, a deliberate difference (listed in the result)
        key, value = kv.split("=", 1)
        section, name = key.rsplit(".", 1)
        cfg.setdefault(section, {})[name] = _toml_literal(value)
    if a.profile:
        cfg["profiling"] = titan_profiling(a.steps)
    toml_path = os.path.join(paths["titan_dir"], "job.toml")
    with open(toml_path, "w") as fh:
        fh.write(to_toml(cfg))
    with open(os.path.join(paths["titan_py"], FLAVOR_MODULE + ".py"), "w") as fh:
        fh.write(flavor_module(w))
    env = {
        **os.environ,
        **JOB_ENV,
        "PYTORCH_ALLOC_CONF": ALLOC_CONF,
        "PYTHONPATH": os.pathsep.join(filter(None, [paths["titan_py"], os.environ.get("PYTHONPATH")])),
        "HF_DATASETS_CACHE": os.path.join(paths["titan_dir"], "hf_datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = titan_command(gpus, toml_path)
    run = stream(
        cmd, env, a.timeout, os.path.join(paths["titan_dir"], "log.txt"), re.compile(r"\bstep:\s*1\s")
    )
    out = {
        "command": "python " + " ".join(cmd[1:]),
        "config": cfg,
        "wall_s": run["wall_s"],
        "gpus": run["gpus"],
    }
    out["launch_to_first_step_s"] = run["first_step_s"]
    parsed = parse_titan_log(run["output"])
    steps = parsed.pop("steps")
    out.update(parsed)
    if run["rc"] or len(steps) < a.steps:
        out["error"] = (
            f"exit {run['rc']}, {len(steps)} of {a.steps} steps logged\n" + run["output"][-3000:]
        ).strip()
    if steps:
        kept = timed(steps, a.warmup, a.profile)
        out.update(
            {
                "tokens_per_s_per_gpu": statistics.median(s["tps"] for s in kept),
                "tokens_per_s_per_gpu_all": [s["tps"] for s in steps],
                "mfu": statistics.median(s["mfu"] for s in kept),
                # its FLOPs per token from its own figures (tflops = FLOPs/token x tps / 1e12)
                "flops_per_token": statistics.median(
                    1e12 * s["tflops"] / s["tps"] for s in steps if s["tps"]
                ),
                "peak_reserved_gib": max(s["mem_gib"] for s in steps),
                "losses": [s["loss"] for s in steps],
            }
        )
    out["joules_per_token"] = joules_per_token(out.get("gpus"), out.get("tokens_per_s_per_gpu"))
    if a.profile:
        traces = sorted(
            glob.glob(os.path.join(paths["titan_dir"], "profile_traces", "*", "rank0_trace.json"))
        )
        where = traces[-1] if traces else os.path.join(paths["titan_dir"], "profile_traces")
        out["profile"] = profile_summary(where, a.profile_dir, f"{w.name}_torchtitan")
    return out


def run_loom(w: Workload, gpus: int, a, paths: dict, variant: tuple[str, ...] = ()) -> dict:
    """loom's side; ``variant``: fields changed on top of --loom-set (a --loom-variant run), ``env.NAME=VALUE``
    an environment variable of that run (an NCCL setting, say) rather than a config field."""
    cfg = loom_config(w, gpus, paths, matched(a), a.device)
    fields, extra_env = split_fields((*a.loom_set, *variant))
    host = str(fields.get("metrics.profile_host", "true")).lower() != "false"
    if a.profile:
        cfg.update(loom_profiling(a.steps, host))
    cfg.update(fields)
    recorded = int(a.profile) * (2 if host and a.steps > 1 else 1)  # the steps loom's profiler records
    env = {**os.environ, **JOB_ENV, "PYTORCH_ALLOC_CONF": ALLOC_CONF, **extra_env}
    if a.loom_sdpa == "torchtitan":
        with open(os.path.join(paths["loom_py"], "sitecustomize.py"), "w") as fh:
            fh.write(SDPA_SITECUSTOMIZE)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [paths["loom_py"], os.environ.get("PYTHONPATH")]))
    cmd = loom_command(cfg, gpus)
    run = stream(cmd, env, a.timeout, os.path.join(paths["loom_dir"] + "_log.txt"), _LOOM_STEP)
    out = {"command": "loom " + " ".join(cmd[3:]), "config": cfg, "wall_s": run["wall_s"], **loom_shape(cfg)}
    if extra_env:
        out["env"] = extra_env
    out["gpus"] = run["gpus"]  # each GPU's clock, power and temperature while it ran
    out["launch_to_first_step_s"] = run["first_step_s"]
    out["log"] = [
        ln for ln in run["output"].splitlines() if ln.startswith(("loom:", "kernels:", "placement"))
    ]
    path = os.path.join(paths["loom_dir"], "metrics.jsonl")
    recs = []
    if os.path.exists(path):
        with open(path) as fh:
            recs = [json.loads(line) for line in fh if line.strip()]
    if run["rc"]:
        out["error"] = failure(subprocess.CompletedProcess(cmd, run["rc"], run["output"], run["output"]))
    if recs:
        timed_recs = timed(recs, a.warmup, recorded + 1 if recorded else 0)  # its warm-up step too
        out.update(
            {
                "tokens_per_s_per_gpu": statistics.median(r["tokens_per_s_per_device"] for r in timed_recs),
                "tokens_per_s_per_gpu_all": [r["tokens_per_s_per_device"] for r in recs],
                "mfu": statistics.median(r["mfu"] for r in timed_recs)
                if recs[0].get("mfu") is not None
                else None,
                "peak_reserved_gib": max(r.get("mem_gib_max_rank", r["mem_gib"]) for r in recs),
                "losses": [r["loss"] for r in recs],
            }
        )
    out["joules_per_token"] = joules_per_token(out.get("gpus"), out.get("tokens_per_s_per_gpu"))
    ranks = os.path.join(paths["loom_dir"], "ranks.jsonl")  # each rank's step, data wait and collective time
    if os.path.exists(ranks):
        with open(ranks) as fh:
            out["ranks"] = [json.loads(line) for line in fh if line.strip()]
    if a.profile:
        trace = os.path.join(paths["loom_dir"], "profile", "trace_rank0.json")
        out["profile"] = profile_summary(
            trace, a.profile_dir, f"{w.name}_{os.path.basename(paths['loom_dir'])}", skip_first=recorded > 1
        )
    return out


def split_fields(sets: tuple[str, ...]) -> tuple[dict, dict]:
    """``KEY=VALUE`` settings -> (loom's config fields, the environment variables named ``env.NAME``)."""
    kv = dict(x.split("=", 1) for x in sets)
    env = {k.removeprefix("env."): v for k, v in kv.items() if k.startswith("env.")}
    return {k: v for k, v in kv.items() if not k.startswith("env.")}, env


def parse_variant(spec: str) -> tuple[str, tuple[str, ...]]:
    """``NAME:KEY=VALUE[;KEY=VALUE...]`` -> (NAME, its fields); ValueError naming what is wrong."""
    name, _, fields = spec.partition(":")
    sets = tuple(kv for kv in fields.split(";") if kv)
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name) or not sets or not all("=" in kv for kv in sets):
        raise ValueError(
            f"--loom-variant {spec!r}: expected NAME:KEY=VALUE[;KEY=VALUE...] (NAME of letters, digits, _ or -)"
        )
    bad_env = [kv for kv in sets if kv.startswith("env.") and not re.fullmatch(r"env\.[A-Za-z_]\w*=.*", kv)]
    if bad_env:
        raise ValueError(
            f"--loom-variant {spec!r}: {bad_env[0]!r}: expected env.NAME=VALUE (NAME a variable name)"
        )
    return name, sets


def conventions(titan: dict, loom: dict) -> None:
    """Each side's MFU on both FLOP conventions: torchtitan's FLOPs per token from its own log (tflops x 1e12 /
    tps), loom's from its MFU / tokens/s (FLOPs per token over the peak); both divide by the same dense bf16 peak
    (989 TFLOP/s on H100 and H200)."""
    if "tokens_per_s_per_gpu" not in titan or "tokens_per_s_per_gpu" not in loom:
        return
    peak, titan_fpt = titan.get("peak_flops"), titan.get("flops_per_token")
    loom_fpt_over_peak = loom["mfu"] / loom["tokens_per_s_per_gpu"] if loom.get("mfu") else None
    titan["mfu_torchtitan_convention"] = titan.get("mfu")
    titan["mfu_loom_convention"] = (
        titan["tokens_per_s_per_gpu"] * loom_fpt_over_peak if loom_fpt_over_peak else None
    )
    loom["mfu_loom_convention"] = loom.get("mfu")
    loom["mfu_torchtitan_convention"] = (
        loom["tokens_per_s_per_gpu"] * titan_fpt / peak if titan_fpt and peak else None
    )


def download_wheels(folder: str) -> None:
    """``WHEELS`` and ``OTHER_WHEELS`` into ``folder`` (here, where the package index is reachable; the GPU machine installs them with
    ``pip install --no-index --no-deps``)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
        ]
        + [
            "--implementation",
            "cp",
            "--platform",
            "manylinux_2_28_x86_64",
            "--platform",
            "manylinux_2_17_x86_64",
        ]
        + ["-d", folder, *WHEELS, *OTHER_WHEELS],
        check=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--download-wheels",
        metavar="DIR",
        help="fetch torchtitan and what it needs (and the trl and torchao wheels of the other GPU benches) into DIR, then exit",
    )
    p.add_argument("--workload", choices=sorted(WORKLOADS))
    p.add_argument("--gpus", type=int, default=0, help="GPUs (default: the workload's); global batch follows")
    p.add_argument(
        "--layers", type=int, default=0, help="transformer blocks on both sides (default: the workload's)"
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--lr-warmup", type=int, default=10, help="LR warm-up steps, both sides")
    p.add_argument("--ac", default="", help="op, full or none (default: the workload's)")
    p.add_argument("--no-compile", dest="compile", action="store_false", default=None)
    p.add_argument(
        "--float8",
        default="none",
        choices=["none", "tensorwise", "rowwise"],
        help="float8 block linears on both sides (torchao's recipe; loom's training.float8)",
    )
    p.add_argument(
        "--reduce-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the FSDP2 gradient reduction dtype on both sides (torchtitan's mixed_precision_reduce)",
    )
    p.add_argument(
        "--float8-all-gather",
        action="store_true",
        help="with --float8 tensorwise: FSDP2 gathers their weights in float8 on both sides",
    )
    p.add_argument("--sides", default="torchtitan,loom", help="which to run, in this order")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the sides and the variants this many times over, one round after the other in the call: each "
        "round's ratio, and their median, under ratio_over_rounds (the figures at the top are round 1's); a "
        "ratio near a bar is then read against its spread within one call",
    )
    p.add_argument(
        "--loom-variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[;KEY=VALUE]",
        help="one more loom run after the sides, with these fields changed on top of --loom-set (same call, same "
        "data; its result and its ratio to torchtitan under loom_variants.NAME); env.NAME=VALUE sets an environment "
        "variable of that run instead; repeatable",
    )
    p.add_argument(
        "--loom-sdpa",
        default="torchtitan",
        choices=["torchtitan", "default"],
        help="loom's SDPA backends: torchtitan's (cuDNN, flash, math in that priority) or PyTorch's default order",
    )
    p.add_argument(
        "--loom-set", action="append", default=[], metavar="KEY=VALUE", help="a loom field changed"
    )
    p.add_argument(
        "--titan-set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a torchtitan field changed",
    )
    p.add_argument(
        "--titan-workers",
        type=int,
        default=1,
        help="torchtitan's data-loader worker processes (0: in its trainer)",
    )
    p.add_argument(
        "--device",
        default="cuda",
        help="loom's run.device; cpu (gloo, with --sides loom): a smoke run of this tool",
    )
    p.add_argument("--data-mb", type=float, default=4.0, help="MB of text in the shared data file")
    p.add_argument(
        "--timeout", type=int, default=270, help="seconds each side may run (both inside a 10-minute call)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile each side's last step (torchtitan's [profiling]; loom's metrics.profile_steps over its last "
        "two, summarizing the second: the first starts from a drained GPU) and store rank 0's GPU time by kernel "
        "category, top kernels, exposed communication and the compute stream's gaps; the medians leave out the "
        "profiled steps and each profiler's warm-up step",
    )
    p.add_argument("--profile-dir", default="", help="with --profile: keep both gzipped traces here")
    p.add_argument("--run-dir", default="/tmp/loom_peers")
    p.add_argument("--out", default="")
    p.add_argument("--commit", default=default_commit())
    a = p.parse_args()
    if a.download_wheels:
        return download_wheels(a.download_wheels)
    if not a.workload:
        p.error("--workload is required")
    w = with_layers(WORKLOADS[a.workload], a.layers) if a.layers else WORKLOADS[a.workload]
    gpus = a.gpus or w.gpus
    a.ac = a.ac or w.ac
    if a.float8_all_gather and a.float8 != "tensorwise":
        p.error(f"--float8-all-gather needs --float8 tensorwise (got {a.float8})")
    a.compile = w.compile if a.compile is None else a.compile
    sides = a.sides.split(",")
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: at least 1")
    if a.rounds > 1 and a.profile:
        p.error(
            "--rounds with --profile: profile one round (a profiled run is slower; its medians are not comparable)"
        )
    if not set(sides) <= {"torchtitan", "loom"}:
        raise SystemExit(f"--sides {a.sides}: expected torchtitan and/or loom")
    try:
        variants = dict(parse_variant(spec) for spec in a.loom_variant)
    except ValueError as e:
        p.error(str(e))
    if "torchtitan" in sides:  # before any GPU time is spent: the wheels are installed and import
        try:
            import torchtitan.train  # noqa: F401
        except ImportError as e:
            raise SystemExit(
                f"bench.peers: torchtitan does not import ({e}); install bench/wheels first"
            ) from e
    out_path = a.out or f"bench/results/peers_{w.name}_{gpus}gpu.json"

    root = os.path.join(a.run_dir, w.name)
    shutil.rmtree(root, ignore_errors=True)
    paths = {
        "data_dir": os.path.join(root, "data"),
        "data_file": os.path.join(root, "data", "data.jsonl"),
        "tokenizer": os.path.join(root, "tokenizer"),
        "titan_dir": os.path.join(root, "torchtitan"),
        "titan_py": os.path.join(root, "torchtitan_py"),
        "loom_dir": os.path.join(root, "loom"),
        "loom_py": os.path.join(root, "loom_py"),
        "loom_cache": os.path.join(root, "loom_cache"),
        "loom_tokens": os.path.join(root, "loom_cache", "data.bin"),
    }
    for k in ("titan_dir", "titan_py", "loom_py"):
        os.makedirs(paths[k], exist_ok=True)
    t0 = time.time()
    docs = write_text(paths["data_file"], a.data_mb)
    vocab = make_tokenizer(paths["tokenizer"], paths["data_file"], w.vocab)
    inputs_s = round(time.time() - t0, 1)
    print(f"bench.peers: {docs} documents, tokenizer of {vocab} tokens ({inputs_s} s)", flush=True)
    prepare_s = prepare_loom_tokens(paths) if "loom" in sides or variants else None

    doc = {
        "benchmark": "peers",
        "environment": environment(
            a.commit, command(), modules=("torchtitan", "tyro", "torchdata", "datasets", "tokenizers")
        ),
        "workload": {
            **asdict(w),
            "gpus": gpus,
            "ac": a.ac,
            "compile": a.compile,
            "float8": a.float8,
            "float8_all_gather": a.float8_all_gather,
            "reduce_dtype": a.reduce_dtype,
        },
        "settings": {
            "steps": a.steps,
            "warmup": a.warmup,
            "lr_warmup": a.lr_warmup,
            "global_batch": w.local_batch * gpus,
            "tokens_per_step": w.local_batch * gpus * w.seq,
            "loom_sdpa": a.loom_sdpa,
            "data": {
                "documents": docs,
                "megabytes": a.data_mb,
                "tokenizer_vocab": vocab,
                "seconds": inputs_s,
                "loom_prepare_s": prepare_s,
            },
            "allocator": f"PYTORCH_ALLOC_CONF={ALLOC_CONF}",
            "profiled": "torchtitan's last step, loom's last two (the first starts from a drained GPU and is left out "
            "of its summary; one with metrics.profile_host false), each after its profiler's warm-up step; all left "
            "out of the medians"
            if a.profile
            else None,
        },
        "differences": list(DIFFERENCES)
        + list(w.differences)
        + ([] if a.loom_sdpa == "torchtitan" else ["SDPA: loom with PyTorch's default backend order"])
        + [f"loom {kv} (--loom-set)" for kv in a.loom_set]
        + [f"torchtitan {kv} (--titan-set)" for kv in a.titan_set],
    }
    each = round_runs(w, gpus, a, paths, root, sides, variants, 1)
    for side in sides:
        doc[side] = next(each)[2]
        write_result(out_path, doc)
    titan, loom = doc.get("torchtitan", {}), doc.get("loom", {})
    conventions(titan, loom)
    if titan.get("params") and loom.get("params") and titan["params"] != loom["params"]:
        doc["differences"].append(f"parameters: torchtitan {titan['params']:,}, loom {loom['params']:,}")
    if "tokens_per_s_per_gpu" in titan and "tokens_per_s_per_gpu" in loom:
        doc["ratio"] = loom["tokens_per_s_per_gpu"] / titan["tokens_per_s_per_gpu"]
    write_result(out_path, doc)
    for _, name, run in each:
        fields = variants[name]
        run["fields"] = list(fields)
        conventions(dict(titan), run)
        if "tokens_per_s_per_gpu" in titan and "tokens_per_s_per_gpu" in run:
            run["ratio"] = run["tokens_per_s_per_gpu"] / titan["tokens_per_s_per_gpu"]
        doc.setdefault("loom_variants", {})[name] = run
        write_result(out_path, doc)
    if a.rounds > 1:
        rounds = [round_figures(doc)]
        for k in range(2, a.rounds + 1):
            again: dict = {}
            for kind, name, run in round_runs(w, gpus, a, paths, root, sides, variants, k):
                (again if kind == "side" else again.setdefault("loom_variants", {}))[name] = run
            rounds.append(round_figures(again))
            doc["rounds"] = rounds
            over_rounds(doc, rounds)
            write_result(out_path, doc)
    print(summary(doc), flush=True)


def round_runs(w: Workload, gpus: int, a, paths: dict, root: str, sides: list, variants: dict, k: int):
    """Round ``k``'s runs, one after the other: ("side", side, result) for each side, then ("variant", name, result)
    for each loom variant; round 1 in the run folders' own names, later rounds in folders suffixed ``_r<k>``."""
    tag, suffix = ("", "") if k == 1 else (f"round {k}: ", f"_r{k}")
    where = {
        **paths,
        "titan_dir": paths["titan_dir"] if k == 1 else os.path.join(root, f"torchtitan{suffix}"),
        "loom_dir": paths["loom_dir"] if k == 1 else os.path.join(root, f"loom{suffix}"),
    }
    os.makedirs(where["titan_dir"], exist_ok=True)
    for side in sides:
        print(f"bench.peers: {tag}{side} ...", flush=True)
        yield (
            "side",
            side,
            run_titan(w, gpus, a, where) if side == "torchtitan" else run_loom(w, gpus, a, where),
        )
    for name, fields in variants.items():
        print(f"bench.peers: {tag}loom variant {name} ({'; '.join(fields)}) ...", flush=True)
        place = {**paths, "loom_dir": os.path.join(root, f"loom_{name}{suffix}")}
        yield "variant", name, run_loom(w, gpus, a, place, fields)


def round_figures(doc: dict) -> dict:
    """One round's tokens/s per GPU (and peak memory) of each side and variant, with its ratios to that round's
    torchtitan run."""

    def figures(run: dict) -> dict:
        return {k: run[k] for k in ("tokens_per_s_per_gpu", "peak_reserved_gib", "error") if k in run}

    out = {side: figures(doc[side]) for side in ("torchtitan", "loom") if side in doc}
    titan = out.get("torchtitan", {}).get("tokens_per_s_per_gpu")
    runs = {
        "loom": out.get("loom"),
        **{f"variant {n}": figures(r) for n, r in doc.get("loom_variants", {}).items()},
    }
    for name, run in runs.items():
        if name != "loom":
            out[name] = run
        if titan and run and run.get("tokens_per_s_per_gpu"):
            run["ratio"] = run["tokens_per_s_per_gpu"] / titan
    return out


def over_rounds(doc: dict, rounds: list[dict]) -> None:
    """Each ratio's values over the rounds and their median: ``ratio_over_rounds`` for loom, and in each variant."""

    def spread(key: str) -> dict | None:
        values = [r[key]["ratio"] for r in rounds if "ratio" in r.get(key, {})]
        return {"per_round": values, "median": statistics.median(values)} if values else None

    if (loom := spread("loom")) is not None:
        doc["ratio_over_rounds"] = loom
    for name, run in doc.get("loom_variants", {}).items():
        if (ratios := spread(f"variant {name}")) is not None:
            run["ratio_over_rounds"] = ratios


def summary(doc: dict) -> str:
    """One line per side and the ratio."""
    lines = []
    for side in ("torchtitan", "loom"):
        r = doc.get(side)
        if r is None:
            continue
        if "tokens_per_s_per_gpu" not in r:
            lines.append(f"{side}: ERROR {r.get('error', '')[-400:]}")
            continue
        mfu = r.get("mfu")
        lines.append(
            f"{side}: {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, MFU {100 * mfu:.1f}%"
            if mfu is not None
            else f"{side}: {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU"
        )
        lines[-1] += f", {r['peak_reserved_gib']:.1f} GiB, first step at {r['launch_to_first_step_s']} s"
        lines[-1] += power_line(r)
        if r.get("error"):
            lines[-1] += " (with an error: see the JSON)"
    if "ratio" in doc:
        lines.append(f"loom / torchtitan: {doc['ratio']:.3f}")
    if "ratio_over_rounds" in doc:
        lines.append(f"loom / torchtitan over {rounds_line(doc['ratio_over_rounds'])}")
    for name, r in doc.get("loom_variants", {}).items():
        got = f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU" if "tokens_per_s_per_gpu" in r else "ERROR"
        ratio = f", {r['ratio']:.3f}x torchtitan" if "ratio" in r else ""
        if "ratio_over_rounds" in r:
            ratio += f" (over {rounds_line(r['ratio_over_rounds'])})"
        lines.append(f"loom variant {name} ({'; '.join(r['fields'])}): {got}{ratio}{power_line(r)}")
    return "\n".join(lines)


def power_line(run: dict) -> str:
    """The first GPU's steady figures (the GPU sampler's samples over the steps) as "; GPU 0 in its steps 679 W,
    1,590 MHz, power-capped 100%, 66.6 mJ/token" (the energy over all GPUs), or nothing where none were taken."""
    steady = (run.get("gpus") or {}).get("0", {}).get("steady")
    if not steady:
        return ""
    line = (
        f"; GPU 0 in its steps {steady['power_w_median']:.0f} W, {steady['sm_clock_mhz_median']:,.0f} MHz, "
        f"power-capped {100 * steady['power_capped_share']:.0f}%"
    )
    energy = run.get("joules_per_token")
    return line + (f", {1000 * energy:.1f} mJ/token" if energy else "")


def rounds_line(spread: dict) -> str:
    values = ", ".join(f"{v:.3f}" for v in spread["per_round"])
    return f"{len(spread['per_round'])} rounds: {values}; median {spread['median']:.3f}"


if __name__ == "__main__":
    main()

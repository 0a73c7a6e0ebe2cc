"""Typed configuration sections.

Each component receives only its own section. Allowed values live next to the
field (``choices`` / ``min`` metadata) so that validation and the README's
config reference come from one place; so does what a resumed run may do with a
changed value (``resume``: loom.train.resume_changes, docs/resume.md).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field, fields

from loom.config.errors import ConfigError
from loom.config.methods import METHODS

# what a resumed run may do with a changed field (``opt(resume=(kind, why))``; loom.train.resume_changes compares)
MUST_MATCH, APPLIED, FREE = "must match", "applied", "free"
# reasons several fields share
SCHEDULE = "the LR schedule from the next step: that step's LR is the new schedule's at that step"
GROUPS = "into the optimizer's parameter groups (the checkpoint's value is replaced)"
KERNEL = "kernel choice: the same math"
LAYOUT = "layout: a checkpoint loads into any layout (resharded)"
OUTPUT = "what this run writes and where"


# what turns a feature on, by the name a field's ``opt(needs=...)`` gives: (is it on for this config, how to say so)
ACTIVATIONS = {
    "lora.rank": (lambda c: c.lora.rank > 0, "lora.rank > 0 (LoRA)"),
    "parallel.diloco_inner_steps": (
        lambda c: c.parallel.diloco_inner_steps > 0,
        "parallel.diloco_inner_steps > 0 (DiLoCo)",
    ),
    "training.eval_tasks": (
        lambda c: bool(c.training.eval_tasks.strip()),
        "training.eval_tasks (lm-eval tasks)",
    ),
    "grpo.reward_model": (lambda c: bool(c.grpo.reward_model), "grpo.reward_model (a reward model)"),
    "grpo.judge": (lambda c: bool(c.grpo.judge), "grpo.judge (a judge model's path)"),
    "grpo.max_staleness": (
        lambda c: c.grpo.max_staleness > 0,
        "grpo.max_staleness > 0 (asynchronous GRPO)",
    ),
    "embedded task": (lambda c: not c.grpo.prompts, "the embedded arithmetic task (grpo.prompts empty)"),
    "optimizer.offload nvme": (
        lambda c: c.optimizer.offload == "nvme",
        "optimizer.offload nvme (the moments in files)",
    ),
    "parallel.ep": (lambda c: c.parallel.ep > 1, "parallel.ep > 1 (expert parallelism)"),
    "metrics.profile_steps": (
        lambda c: bool(c.metrics.profile_steps.strip()),
        "metrics.profile_steps (a profiled window)",
    ),
    "float16": (lambda c: c.training.dtype == "float16", "training.dtype float16 (its loss scaling)"),
    "nonfinite skip or rollback": (
        lambda c: c.training.nonfinite != "stop",
        "training.nonfinite skip or rollback (stop stops at the first)",
    ),
    "resume none or a path": (
        lambda c: c.checkpoint.resume != "auto",
        "checkpoint.resume none (start fresh, moving the old checkpoints aside) or an older checkpoint's "
        "path (branch)",
    ),
}


def inactive_fields(cfg) -> list[tuple[str, object, str]]:
    """(section.field, value, what activates it) of every field set away from its default while the feature it
    belongs to is off (``opt(needs=...)``)."""
    out = []
    for section, values in vars(cfg).items():  # a method's section never read holds its defaults (Config)
        cls = type(values)
        default = cls()
        for f in fields(cls):
            needs = f.metadata.get("needs")
            if (
                needs
                and getattr(values, f.name) != getattr(default, f.name)
                and not ACTIVATIONS[needs][0](cfg)
            ):
                out.append((f"{section}.{f.name}", getattr(values, f.name), ACTIVATIONS[needs][1]))
    return out


def check_inactive_fields(cfg) -> None:
    """One line (ConfigError) for the first field of a feature that is off: it would do nothing."""
    for name, value, what in inactive_fields(cfg):
        raise ConfigError(name, value, f"does nothing without {what}: set that too, or leave {name} out")


SELECTIVE_AC = ("op", "matmuls")  # training.activation_checkpointing's op-level modes: a policy per op


def opt(
    default,
    help: str,
    *,
    choices=None,
    min=None,
    max=None,
    min_exclusive=False,
    needs: str | None = None,
    resume: tuple[str, str] | None = None,
):
    """A dataclass field with the metadata validation and docs read. ``needs``: the name (in ``ACTIVATIONS``) of
    what makes the field do something; set (not its default) while that is off, it is an error
    (``check_inactive_fields``), so a field of a feature that is off is never silently ignored. ``resume``: (kind,
    why) of a change on resume (``MUST_MATCH``, ``APPLIED`` or ``FREE``; docs/resume.md)."""
    meta = {"help": help}
    if resume is not None:
        assert resume[0] in (MUST_MATCH, APPLIED, FREE) and resume[1], resume
        meta["resume"] = resume
    if needs is not None:
        assert needs in ACTIVATIONS, needs
        meta["needs"] = needs
    if choices is not None:  # a registry (a dict) is kept as is: what it names when a value is checked
        meta["choices"] = choices if isinstance(choices, dict) else tuple(choices)
    if min is not None:
        meta["min"] = min
        meta["min_exclusive"] = min_exclusive
    if max is not None:
        meta["max"] = max
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


SEED_MAX = 2**32 - 1  # run.seed and `loom generate --seed`: a negative seed is refused (torch would wrap it)


@dataclass
class RunConfig:
    dir: str = opt(
        "runs/lm",
        "run directory: resolved config, metrics, checkpoints; unset = runs/<training.objective> "
        "(runs/lm, runs/sft, runs/dpo, ...), so runs of different objectives never share one",
        resume=(FREE, OUTPUT),
    )
    seed: int = opt(
        0,
        "seed for weights, data order and dropout-free RNG streams (32 bits: the seeds derived from it, "
        "such as GRPO's per-step sampling seeds, must fit torch's 64)",
        min=0,
        max=SEED_MAX,
        resume=(MUST_MATCH, "draws the data order that the loader's position counts in"),
    )
    deterministic: bool = opt(
        False,
        "deterministic algorithms (bitwise-reproducible on CPU)",
        resume=(FREE, "algorithm choice: the same math"),
    )
    device: str = opt("auto", "device type", choices=("auto", "cpu", "cuda"), resume=(FREE, LAYOUT))


@dataclass
class ModelConfig:
    # the names of every family's flavors (loom.models.registry.all_flavors; a test keeps both in step): listed here
    # so that a wrong name is reported before torch is imported
    flavor: str = opt(
        "debug",
        "model size preset of any family (loom.models.registry; docs/models.md)",
        choices=(
            "debug",
            "debug_moe",
            "debug_mla",
            "125M",
            "1B",
            "3B",
            "8B",
            "70B",
            "405B",
            "deepseek_v2_lite",
            "qwen3_moe_debug",
            "qwen3_moe_30b_a3b",
            "deepseek_v3_debug",
            "deepseek_v3_671b",
        ),
        resume=(MUST_MATCH, "the model's shapes"),
    )
    init_from: str = opt(
        "",
        "Hugging Face Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE or DeepSeek-V3 folder "
        "(config.json + safetensors), or a checkpoint of `loom convert --from-hf`, to start from",
        resume=(MUST_MATCH, "the model's shapes (the folder's config.json)"),
    )
    vocab_size: int = opt(
        0,
        "embedding rows; 0 = the flavor's (or model.init_from's), else the tokenizer's rounded "
        "up to a multiple of 128",
        min=0,
        resume=(MUST_MATCH, "embedding and output rows"),
    )
    n_layers: int = opt(
        0,
        "transformer blocks; 0 = the flavor's (a deeper `debug` model for pipeline tests)",
        min=0,
        resume=(MUST_MATCH, "the blocks"),
    )
    tie_embeddings: str = opt(
        "flavor",
        "tie input/output embeddings",
        choices=("flavor", "true", "false"),
        resume=(MUST_MATCH, "one embedding weight or two"),
    )
    residual_init: str = opt(
        "flat",
        "init std of the residual projections (attention wo, MLP w2): 'flat' = 0.02 "
        "like every other matrix (transformers' Llama), 'depth' = 0.02/sqrt(2·layers) "
        "(GPT-2, Megatron); flat measured better (docs/benchmarks.md: Initialization)",
        choices=("flat", "depth"),
        resume=(APPLIED, "initialisation only: no effect on the resumed weights"),
    )
    attention: str = opt(
        "auto",
        "attention: 'sdpa' (PyTorch's SDPA, its own backend choice), 'sdpa_cudnn' / "
        "'sdpa_flash' (SDPA pinned to cuDNN / FlashAttention-2: CUDA, bf16/fp16, no packed "
        "documents or sliding window; cuDNN not with run.deterministic), 'fa4' "
        "(FlashAttention-4's kernels, the flash-attn-4 package: Hopper / Blackwell, the same "
        "limits as sdpa_cudnn), 'flash' (loom's "
        "Triton FlashAttention-2), 'flex' (PyTorch's FlexAttention, compiled; CUDA only; not "
        "with training.compile under op-level checkpointing), 'auto' = on CUDA the fastest "
        "one timed on this run's shape at start-up (once per shape in a process): flash vs "
        "flex for packed documents, flash vs sdpa_cudnn vs sdpa_flash vs fa4 otherwise (those "
        "that can run, fa4 where installed; sdpa on CPU; flash for documents, sdpa otherwise, "
        "with run.deterministic or where flex is refused)",
        choices=("auto", "sdpa", "sdpa_cudnn", "sdpa_flash", "fa4", "flash", "flex"),
        resume=(FREE, KERNEL),
    )
    fused_norm: str = opt(
        "auto",
        "fused Triton RMSNorm; auto = on for CUDA without compile, and under compile with tensorwise float8",
        choices=("auto", "true", "false"),
        resume=(FREE, KERNEL),
    )
    fused_rope: str = opt(
        "auto",
        "fused Triton RoPE; auto = on for CUDA without compile",
        choices=("auto", "true", "false"),
        resume=(FREE, KERNEL),
    )
    fused_swiglu: str = opt(
        "auto",
        "fused Triton SwiGLU gate; auto = on for CUDA without compile",
        choices=("auto", "true", "false"),
        resume=(FREE, KERNEL),
    )
    fused_loss: str = opt(
        "auto",
        "linear + cross-entropy fused, chunked over tokens (no full logits); auto = on "
        "for CUDA; not with parallel.tp/pp > 1",
        choices=("auto", "true", "false"),
        resume=(FREE, KERNEL),
    )
    moe_experts: int = opt(
        0,
        "mixture of experts: routed SwiGLU experts per block in place of its feed-forward; "
        "0 = the flavor's (dense except debug_moe)",
        min=0,
        resume=(MUST_MATCH, "the expert weights"),
    )
    moe_top_k: int = opt(
        0,
        "experts each token is routed to (<= moe_experts); 0 = the flavor's (2) or the "
        "model.init_from folder's",
        min=0,
        resume=(APPLIED, "routing only (no weights): from the next step"),
    )
    moe_ffn_dim: int = opt(
        0,
        "hidden width of each expert; 0 = the flavor's (its ffn_dim)",
        min=0,
        resume=(MUST_MATCH, "the expert weights"),
    )
    moe_aux_loss: float = opt(
        0.01,
        "weight of the sequence-wise load-balancing loss (its gradient joins the "
        "backward; the logged loss stays the language-model loss); 0 = off",
        min=0.0,
        resume=(APPLIED, "the balance loss weight from the next step"),
    )
    moe_bias_speed: float = opt(
        -1.0,
        "aux-loss-free balancing (DeepSeek-V3): each step every expert's selection "
        "bias moves by this much towards balance (the sign of its load error, loads "
        "summed over all ranks); -1 = the flavor's (0.001 for the DeepSeek-V3 "
        "flavors, off otherwise) or model.init_from's (0.001 for DeepSeek-V3); 0 = "
        "off (the bias stays as loaded)",
        min=-1.0,
        resume=(APPLIED, "the selection bias's step size from the next step"),
    )
    mtp_depth: int = opt(
        -1,
        "multi-token prediction modules (DeepSeek-V3 family: each predicts one token further, "
        "sharing the embedding and output head; not run at inference); -1 = the flavor's or "
        "model.init_from's; 0 = none",
        min=-1,
        resume=(MUST_MATCH, "the multi-token prediction modules are weights of the model"),
    )
    first_k_dense: int = opt(
        -1,
        "DeepSeek-V3 family: the first blocks that keep a dense feed-forward, the rest with experts "
        "(first_k_dense_replace); -1 = the flavor's (3 for deepseek_v3_671b) or model.init_from's",
        min=-1,
        resume=(MUST_MATCH, "which blocks hold experts is the model's weights"),
    )
    mtp_weight: float = opt(
        0.3,
        "weight (lambda) of the multi-token prediction loss, the mean over its modules, "
        "added to the token loss",
        min=0.0,
        resume=(APPLIED, "the multi-token prediction loss weight from the next step"),
    )
    sliding_window: int = opt(
        0,
        "sliding-window attention (Mistral): each token attends to itself and the "
        "sliding_window - 1 tokens before it; 0 = the model.init_from folder's (none for "
        "the flavors); not with parallel.cp > 1",
        min=0,
        resume=(MUST_MATCH, "what each token attends to, which the weights were trained for"),
    )


@dataclass
class DataConfig:
    source: str = opt(
        "",
        "text/jsonl/parquet files or globs, an HF dataset folder, a .bin token file, "
        "or a mixture 'a.jsonl:0.7,b.bin:0.3'; unset = the embedded default",
        resume=(MUST_MATCH, "the token stream that the loader's position counts in"),
    )
    tokenizer: str = opt(
        "byte",
        "'byte' (built in) or a Hugging Face tokenizer.json or its folder; copied into <run.dir>/tokenizer/",
        resume=(
            MUST_MATCH,
            "what the token ids mean (another path to a file with the same bytes is the same)",
        ),
    )
    text_field: str = opt(
        "text",
        "field holding the text in jsonl / parquet / HF datasets",
        resume=(MUST_MATCH, "the token stream"),
    )
    val_fraction: float = opt(
        0.01,
        "fraction of packed windows held out for validation",
        min=0.0,
        max=0.5,
        resume=(MUST_MATCH, "which windows are training data"),
    )
    cache_dir: str = opt(
        "",
        "where tokenized sources are cached; empty = <run.dir>/cache",
        resume=(FREE, "where tokenized sources are cached"),
    )
    document_positions: bool = opt(
        False,
        "packed documents: restart position ids after every EOS and keep attention "
        "within each document (default true under training.objective sft, which needs it)",
        resume=(APPLIED, "position ids and attention masks from the next batch"),
    )
    encoding_errors: str = opt(
        "strict",
        "text that is not valid UTF-8: 'strict' = stop naming the file and byte "
        "offset, 'replace' = decode it with U+FFFD replacement characters",
        choices=("strict", "replace"),
        resume=(FREE, "the tokens are the same, or preparing the data stops naming the bytes"),
    )
    chat_template: str = opt(
        "",
        "training.objective sft / dpo: a Jinja chat template file; '' = the tokenizer folder's "
        "(chat_template.jinja or tokenizer_config.json), the built-in one for the byte "
        "tokenizer (docs/finetuning.md)",
        resume=(MUST_MATCH, "the token stream (conversations rendered into other tokens)"),
    )
    loss_tokens: str = opt(
        "assistant",
        "training.objective sft: the tokens that take loss: 'assistant' = every "
        "assistant turn with its end-of-turn token (a prompt-completion pair: its "
        "completion), 'all' = the whole conversation",
        choices=("assistant", "all"),
        resume=(
            MUST_MATCH,
            "the token stream: which tokens take loss, and which conversations it "
            "holds (one without an assistant turn has nothing to train under "
            "'assistant')",
        ),
    )
    embedded_rejected: str = opt(
        "auto",
        "the rejected answers of the embedded preference pairs (training.objective dpo "
        "/ reward without data.source): 'docstring' = another function's docstring, "
        "'code' = the function's code echoed back, 'auto' = 'docstring' for dpo, "
        "'code' for reward (docs/finetuning.md)",
        choices=("auto", "docstring", "code"),
        resume=(MUST_MATCH, "the embedded preference pairs (their rejected answers)"),
    )


@dataclass
class TrainingConfig:
    objective: str = opt(
        "lm",
        "what a step minimizes, one of the methods registered in loom/config/methods.py: 'lm' = next-token loss "
        "on packed text; 'sft' = supervised fine-tuning on conversations (loss on the assistant's tokens, "
        "conversations packed with per-document attention); the preference, reward, distillation and "
        "reinforcement learning methods, each with its own section, are in docs/finetuning.md's method table "
        "and docs/rl.md",
        choices=METHODS,  # the registry (loom.config.methods), read when a value is checked
        resume=(
            MUST_MATCH,
            "what the data stream is and what a step minimizes (to fine-tune a "
            "pretrained run, start a new one from its weights: model.init_from)",
        ),
    )
    steps: int = opt(
        200,
        "optimizer steps",
        min=1,
        resume=(
            APPLIED,
            "where the run ends and the LR schedule's length (the next step's LR is the new "
            "schedule's); at least the checkpoint's step",
        ),
    )
    seq_len: int = opt(
        256,
        "tokens per sequence",
        min=8,
        resume=(
            APPLIED,
            "not exact: windows are cut at the new length, and each source goes on from "
            "the same fraction of the same epoch, in a new order (other windows: no exact "
            "continuation exists)",
        ),
    )
    global_batch_size: int = opt(
        16,
        "sequences per optimizer step (all data-parallel ranks)",
        min=1,
        resume=(
            APPLIED,
            "the data goes on from the same sample in the same order, in "
            "batches of the new size; the LR schedule counts optimizer steps",
        ),
    )
    micro_batch_size: int = opt(
        8,
        "sequences per forward/backward on one rank",
        min=1,
        resume=(FREE, "how the global batch is split into forward passes: the same math"),
    )
    dtype: str = opt(
        "float32",
        "compute dtype; weights and optimizer state stay float32",
        choices=("float32", "bfloat16", "float16"),
        resume=(
            APPLIED,
            "compute dtype from the next step (weights and optimizer state stay float32); "
            "into float16: the loss scale starts at training.loss_scale_init",
        ),
    )
    compile: bool = opt(
        False, "torch.compile each transformer block", resume=(FREE, "how the same math runs")
    )
    cuda_graphs: bool = opt(
        False,
        "replay each compiled block's forward and backward as CUDA graphs (torch.compile's "
        "reduce-overhead mode): less host time per step where kernels are small; one "
        "process on CUDA, training.compile true, activation checkpointing none, op or matmuls, "
        "dense models; not with objectives rloo or online_dpo; grpo and ppo pad their rollout "
        "rows to a few fixed widths (the step's shapes) and generate through compiles of "
        "the blocks without graphs",
        resume=(FREE, "the same kernels, replayed"),
    )
    float8: str = opt(
        "none",
        "float8 matmuls in the block linears via torchao (CUDA, sm89+; bf16 dtype): "
        "'tensorwise' or 'rowwise' scaling; not with parallel.tp > 1",
        choices=("none", "tensorwise", "rowwise"),
        resume=(APPLIED, "float8 matmuls from the next step"),
    )
    float8_all_gather: bool = opt(
        False,
        "FSDP2 all-gathers the float8 block linears' weights in float8, half of bf16's bytes "
        "(torchao's enable_fsdp_float8_all_gather; each weight's scale from its global amax, computed for "
        "all weights after each update in one pass and one all-reduce): training.float8 tensorwise under "
        "FSDP (dp_shard x cp > 1), no CPU offload",
        resume=(FREE, "the same float8 weights, gathered in float8"),
    )
    activation_checkpointing: str = opt(
        "none",
        "activation checkpointing mode: none; full (each block reruns its forward); every_k (full, every "
        "ac_every-th block); op (op-level, torchtitan's policy: every other matmul's output and the attention's "
        "kept, the rest rerun); matmuls (op-level: every matmul's, grouped matmul's and the attention's output "
        "kept, only the elementwise ops rerun (norms, RoPE, SwiGLU, residual sums): about no recomputation's "
        "speed at 56% of its block memory, 3B at seq 8192 on an H200, docs/parallelism.md)",
        choices=("none", "full", "every_k", "op", "matmuls"),
        resume=(FREE, "recomputation: the same math"),
    )
    ac_every: int = opt(
        2,
        "with activation_checkpointing=every_k: checkpoint every k-th block",
        min=1,
        resume=(FREE, "recomputation: the same math"),
    )
    activation_offload: str = opt(
        "none",
        "blocks whose saved activations wait for backward in host memory (pinned, copied on a side CUDA stream, "
        "the next block's prefetched during backward): 'none', 'all', or a comma list of block indices "
        "('0,1,2'); a recomputed block (activation_checkpointing) offloads its input only (docs/operations.md)",
        resume=(FREE, "where saved activations wait: the same math"),
    )
    gc_every: int = opt(
        50,
        "Python's garbage collection while training: automatic collection off, the young generations "
        "collected every this many steps and after the first step, which compiles, on every rank at once (all "
        "generations every 10 x this), so no rank "
        "pauses alone mid-step while the others wait for it in the next collective (torchtitan's gc_freq, "
        "Megatron's manual GC); 0 = Python's automatic collection",
        min=0,
        resume=(FREE, "when Python collects garbage: the same math"),
    )
    max_norm: float = opt(
        1.0,
        "gradient clipping by global norm; 0 = off",
        min=0.0,
        resume=(APPLIED, "gradient clipping from the next step"),
    )
    grad_norm_kernel: str = opt(
        "torch",
        "how the global gradient norm sums sharded (DTensor) gradients on CUDA: torch = PyTorch's foreach norm (about "
        "a launch per few tensors); triton = loom::sum_squares on each rank's shards, two launches per dtype, then "
        "one all-reduce per placement (docs/kernels.md; no gain measured at 8B on 2 H200s); elsewhere, and for "
        "gradients with a pending sum, torch",
        choices=("torch", "triton"),
        resume=(FREE, "kernel choice: the same norm, summed in another order"),
    )
    eval_every: int = opt(
        0,
        "validation every N steps; 0 = only at the end (training.eval_at_end)",
        min=0,
        resume=(APPLIED, "validation from the next step"),
    )
    eval_at_end: bool = opt(
        True,
        "a validation pass at the last step too, so every run ends with a val_loss "
        "(skipped without held-out data)",
        resume=(APPLIED, "validation at the last step"),
    )
    eval_batches: int = opt(
        2,
        "global batches (training.global_batch_size held-out windows each) per validation pass, split over the "
        "ranks and micro-batches as a training step: the same windows, so the same val_loss, in every layout",
        min=1,
        resume=(APPLIED, "validation from the next step"),
    )
    eval_hook: str = opt(
        "",
        "'module:function' also run at every validation point: called with a "
        "loom.eval.hook.EvalContext (the live model, tokenizer, step), it returns {name: number}, "
        "logged in metrics.jsonl as eval/<name> (docs/eval.md)",
        resume=(APPLIED, "evaluations from the next step"),
    )
    eval_tasks: str = opt(
        "",
        "comma list of lm-evaluation-harness tasks also run at every validation point on the "
        "live model (needs lm-eval: pip install 'loom-train[eval]'); logged as "
        "eval/<task>/<metric>",
        resume=(APPLIED, "evaluations from the next step"),
    )
    eval_tasks_include: str = opt(
        "",
        "training.eval_tasks: a folder of task YAML files (your own tasks)",
        needs="training.eval_tasks",
        resume=(APPLIED, "evaluations from the next step"),
    )
    eval_tasks_limit: int = opt(
        0,
        "training.eval_tasks: examples per task; 0 = every one",
        min=0,
        needs="training.eval_tasks",
        resume=(APPLIED, "evaluations from the next step"),
    )
    eval_tasks_fewshot: int = opt(
        -1,
        "training.eval_tasks: examples in each prompt; -1 = the task's own",
        min=-1,
        needs="training.eval_tasks",
        resume=(APPLIED, "evaluations from the next step"),
    )
    loss_scale_init: float = opt(
        2.0**16,
        "float16: initial dynamic loss scale",
        min=1.0,
        needs="float16",
        resume=(APPLIED, "float16: the dynamic loss scale restarts from it"),
    )
    loss_scale_window: int = opt(
        1000,
        "float16: overflow-free steps before the scale doubles",
        min=1,
        needs="float16",
        resume=(APPLIED, "float16: from the next step"),
    )
    nonfinite: str = opt(
        "skip",
        "a non-finite loss or gradient norm (agreed over all ranks, checked before the "
        "optimizer step): 'skip' = drop the update and count it (stop after nonfinite_limit "
        "in a row), 'stop' = exit 1 at once, 'rollback' = reload the newest complete "
        "checkpoint and skip the offending batches",
        choices=("skip", "stop", "rollback"),
        resume=(APPLIED, "from the next step"),
    )
    nonfinite_limit: int = opt(
        10,
        "consecutive non-finite steps (or rollbacks to one checkpoint) before the run stops with exit 1",
        min=1,
        needs="nonfinite skip or rollback",
        resume=(APPLIED, "from the next step"),
    )


@dataclass
class OptimizerConfig:
    name: str = opt(
        "adamw",
        "optimizer: adamw, or the large-batch lamb / lars (layer-wise trust ratio, "
        "loom.train.large_batch; docs/algorithms.md)",
        choices=("adamw", "lamb", "lars"),
        resume=(MUST_MATCH, "the optimizer state's layout"),
    )
    lr: float = opt(1e-3, "peak learning rate", min=0.0, resume=(APPLIED, SCHEDULE))
    min_lr_ratio: float = opt(
        0.1, "final LR as a fraction of the peak", min=0.0, max=1.0, resume=(APPLIED, SCHEDULE)
    )
    betas: list = opt([0.9, 0.95], "AdamW betas", resume=(APPLIED, GROUPS))
    eps: float = opt(1e-8, "AdamW epsilon", min=0.0, min_exclusive=True, resume=(APPLIED, GROUPS))
    weight_decay: float = opt(
        0.1, "decoupled weight decay (matrices only)", min=0.0, resume=(APPLIED, GROUPS)
    )
    schedule: str = opt(
        "cosine",
        "LR schedule after warmup",
        choices=("cosine", "linear", "wsd", "constant"),
        resume=(APPLIED, SCHEDULE),
    )
    warmup_steps: int = opt(
        10,
        "linear warmup steps (unset: 10, at most a tenth of training.steps)",
        min=0,
        resume=(APPLIED, SCHEDULE),
    )
    decay_fraction: float = opt(
        0.2, "wsd: fraction of steps spent decaying", min=0.0, max=1.0, resume=(APPLIED, SCHEDULE)
    )
    implementation: str = opt(
        "auto",
        "AdamW kernel: loom's Triton kernel, or PyTorch's fused / foreach / for_loop",
        choices=("auto", "triton", "fused", "foreach", "for_loop"),
        resume=(FREE, KERNEL + " (the same optimizer state)"),
    )
    momentum: float = opt(0.9, "lars: momentum", min=0.0, max=1.0, resume=(APPLIED, GROUPS))
    trust_coefficient: float = opt(
        1e-3,
        "lars: trust coefficient eta of the local LR eta x norm(w) / (norm(g) + weight_decay x norm(w))",
        min=0.0,
        min_exclusive=True,
        resume=(APPLIED, GROUPS),
    )
    exclude_1d: bool = opt(
        True,
        "lamb / lars: biases and norm weights (1-D parameters) take neither weight decay "
        "nor the trust ratio, as the papers do",
        resume=(MUST_MATCH, "the optimizer's parameter groups"),
    )
    offload: str = opt(
        "none",
        "'nvme': the AdamW moments live in memory-mapped files (optimizer.offload_path), stepped chunk by chunk "
        "through pinned staging buffers while a thread reads and writes the files (ZeRO-Infinity's optimizer "
        "offload; checkpoints hold the values as usual; docs/operations.md)",
        choices=("none", "nvme"),
        resume=(FREE, "where the AdamW moments live: the same values (the checkpoint's)"),
    )
    offload_path: str = opt(
        "",
        "optimizer.offload nvme: the folder (a fast local disk) in which loom makes its own temporary "
        "folder for the moments' files, removed at the end; empty = the run directory",
        needs="optimizer.offload nvme",
        resume=(FREE, "where the AdamW moments' files live"),
    )
    offload_chunk_mb: float = opt(
        64.0,
        "optimizer.offload nvme: MiB of each moment read, stepped and written back at a time (each of the two "
        "staging buffers holds a chunk of both moments)",
        min=0.0,
        min_exclusive=True,
        needs="optimizer.offload nvme",
        resume=(FREE, "the same math in other chunks"),
    )


@dataclass
class ParallelConfig:
    dp_replicate: int = opt(
        1, "data-parallel replicas (DDP, or the replicate axis of HSDP)", min=1, resume=(FREE, LAYOUT)
    )
    dp_shard: int = opt(
        -1, "FSDP shard degree; -1 = whatever the other degrees leave", min=-1, resume=(FREE, LAYOUT)
    )
    fault_tolerance: bool = opt(
        False,
        "torchft replica groups (pip install 'loom-train[ft]'): this job is one of "
        "ft_replica_groups jobs that replicate the model and split each global batch; "
        "the others go on while one restarts, and it recovers from a live one "
        "(docs/operations.md)",
        resume=(FREE, LAYOUT + "; the replica groups split the same global batch"),
    )
    ft_replica_id: int = opt(
        0,
        "fault tolerance: this job's replica group, 0 .. ft_replica_groups - 1",
        min=0,
        resume=(FREE, LAYOUT + "; the replica groups split the same global batch"),
    )
    ft_replica_groups: int = opt(
        1,
        "fault tolerance: replica groups sharing each global batch",
        min=1,
        resume=(FREE, LAYOUT + "; the replica groups split the same global batch"),
    )
    ft_lighthouse: str = opt(
        "",
        "fault tolerance: the torchft lighthouse's address (http://host:port); empty = $TORCHFT_LIGHTHOUSE",
        resume=(FREE, "where the replica groups meet"),
    )
    ft_min_replicas: int = opt(
        1,
        "fault tolerance: replica groups a step needs to be committed",
        min=1,
        resume=(FREE, "when a step of the replica groups commits"),
    )
    ft_timeout_s: float = opt(
        60.0,
        "fault tolerance: quorum, collective and recovery timeout across replica groups",
        min=0.0,
        min_exclusive=True,
        resume=(FREE, "how long the replica groups wait for each other"),
    )
    tp: int = opt(1, "tensor-parallel degree", min=1, resume=(FREE, LAYOUT))
    pp: int = opt(1, "pipeline-parallel degree", min=1, resume=(FREE, LAYOUT))
    cp: int = opt(
        1,
        "context-parallel degree: each sequence split over cp ranks (2·cp load-balanced chunks, "
        "K/V all-gathered or passed round a ring in attention: parallel.cp_method); training.seq_len "
        "must divide by 2·cp",
        min=1,
        resume=(FREE, LAYOUT),
    )
    cp_method: str = opt(
        "allgather",
        "how context-parallel attention sees the other ranks' K/V: 'allgather' = one "
        "all-gather per layer (every rank holds the whole sequence's K/V), 'ring' = "
        "K/V blocks passed round the cp ranks point to point, overlapped with each "
        "block's attention (two ranks' K/V held at a time, not all cp; "
        "docs/parallelism.md)",
        choices=("allgather", "ring"),
        resume=(FREE, LAYOUT + "; all-gather and ring attention compute the same attention"),
    )
    placement: str = opt(
        "off",
        "which GPU each local rank uses: 'off' = local rank i on CUDA device i; 'auto' = read this host's "
        "topology (nvidia-smi topo -m) and order the local ranks so tp, then cp, then dp groups get the "
        "fastest links (NVLink) and pipeline sends the slowest, and bind each rank to its GPU's NUMA CPUs "
        "(docs/parallelism.md)",
        choices=("off", "auto"),
        resume=(FREE, "which GPU a rank runs on; the ranks and their work stay the same"),
    )
    ep: int = opt(
        1,
        "expert-parallel degree: MoE experts split over this many dp_shard x cp ranks (divides "
        "dp_shard x cp and the number of experts); under tp with etp = 1 the tp ranks count in: tp x a "
        "divisor of dp_shard x cp",
        min=1,
        resume=(FREE, LAYOUT),
    )
    ep_exchange: str = opt(
        "uneven",
        "how expert parallelism sends token-slots to their experts' ranks: 'uneven' = each rank's rows exactly "
        "(one host wait per MoE block for the split sizes); 'padded' = a fixed block of every slot of the rank "
        "to each ep rank, real rows first (no host wait, compilable; about ep times the exchanged bytes: for "
        "small ep; docs/parallelism.md)",
        choices=("uneven", "padded"),
        needs="parallel.ep",
        resume=(FREE, "how tokens travel to their experts: the same math"),
    )
    etp: int = opt(
        1,
        "expert tensor-parallel degree: 1 = experts replicated over tp, each tp rank routing its own "
        "tokens (under ep the tp ranks count in); parallel.tp = experts' hidden width sharded over tp, "
        "tokens gathered over tp (ep then divides dp_shard x cp)",
        min=1,
        resume=(FREE, LAYOUT),
    )
    pp_schedule: str = opt(
        "1f1b",
        "pipeline schedule (docs/parallelism.md: bubble and memory of each); pipedream_2bw = PipeDream-2BW, no "
        "flush between steps on two weight versions: each step computes with the weights one update behind "
        "(1-step-delayed updates, a different rule from the others; with pp = 1 the same rule on one rank)",
        choices=(
            "gpipe",
            "1f1b",
            "interleaved_1f1b",
            "looped_bfs",
            "interleaved_zb",
            "zbv",
            "dualpipev",
            "pipedream_2bw",
        ),
        resume=(FREE, LAYOUT),
    )
    pp_virtual_stages: int = opt(
        0,
        "pipeline stages per pp rank; 0 = the schedule's own (1 for gpipe/1f1b/pipedream_2bw, "
        "2 otherwise; V-shaped zbv/dualpipev need exactly 2)",
        min=0,
        resume=(FREE, LAYOUT),
    )
    pp_layers_per_stage: list = opt(
        [],
        "transformer layers of each pipeline stage, e.g. [5, 6, 5] "
        "(uneven allowed); empty = balanced by compute",
        resume=(FREE, LAYOUT),
    )
    loss_parallel: bool = opt(
        True, "TP: cross-entropy on vocab-sharded logits (full logits never gathered)", resume=(FREE, LAYOUT)
    )
    async_tp: bool = opt(
        False,
        "TP: micro-pipelined (asynchronous) TP matmuls; needs CUDA and training.compile",
        resume=(FREE, LAYOUT),
    )
    reshard_after_forward: bool = opt(
        True,
        "FSDP: true = ZeRO-3, false = keep params gathered until backward "
        "(ZeRO-2-like); read with parallel.zero = -1",
        resume=(FREE, LAYOUT),
    )
    zero: int = opt(
        -1,
        "ZeRO stage over the data-parallel ranks: 0 = DDP, 1 = DDP + optimizer state sharded, 2 = FSDP2 "
        "keeping parameters gathered from forward to backward, 3 = FSDP2 (docs/parallelism.md); sets "
        "dp_shard / dp_replicate / reshard_after_forward; -1 = those fields decide",
        min=-1,
        max=3,
        resume=(FREE, LAYOUT + "; the optimizer state reshards between stages (DCP)"),
    )
    ddp_bucket_mb: float = opt(
        25.0, "DDP gradient bucket size in MiB", min=0.0, min_exclusive=True, resume=(FREE, LAYOUT)
    )
    fsdp_prefetch: str = opt(
        "auto",
        "how FSDP2 issues each unit's all-gather: explicit = when the previous unit's forward (in backward the "
        "next unit's) starts, so it hides behind that unit's compute even where the host is not ahead of the GPU; "
        "implicit = when the host reaches the unit (FSDP2's default; its backward prefetches one unit); auto = "
        "explicit under expert parallelism (each MoE block waits on the host), implicit otherwise",
        choices=("auto", "explicit", "implicit"),
        resume=(FREE, "the same computation, its gathers issued at other points"),
    )
    fsdp_symm_mem: bool = opt(
        False,
        "allocate FSDP2's all-gather and reduce-scatter buffers in NCCL symmetric memory, "
        "with NCCL's zero-CTA policy: within a node the all-gathers run on the GPU's copy engines, not on SMs "
        "the matmuls they overlap would use (CUDA, NCCL >= 2.28, PyTorch >= 2.11)",
        resume=(FREE, "the same computation, its collectives' buffers elsewhere"),
    )
    fsdp_embedding: str = opt(
        "auto",
        "how FSDP2's ranks share the token embedding: gather = an FSDP2 unit of its own (the whole table "
        "all-gathered each step, its whole gradient reduce-scattered at the end of the backward); vocab = each "
        "rank keeps its rows and looks them up for every rank's tokens (tokens x dim move each way, not vocab x "
        "dim; the gradient summed in fp32; loom.parallel.vocab_embedding); auto = vocab where it applies (FSDP2 "
        "sharding on a 1-D mesh, no tensor parallelism or CPU offload, an embedding not tied to the head or read "
        "by multi-token prediction, micro-batches of one width on every rank, which rollout methods lack) and the "
        "shard ranks' gathered tokens of a micro-batch are at most a quarter of the table's rows; gather elsewhere",
        choices=("auto", "gather", "vocab"),
        resume=(FREE, "the same shards (Shard(0) of the table), reduced another way"),
    )
    fsdp_gather_copy: str = opt(
        "fused",
        "how each FSDP2 unit's shards reach its all-gather buffer under mixed precision: torch = FSDP2's own (cast "
        "into a temporary, then copied into the buffer); fused = cast straight into the buffer (the same values, "
        "one pass: loom.parallel.gather_copy)",
        choices=("fused", "torch"),
        resume=(FREE, KERNEL),
    )
    fsdp_grad_copy: str = opt(
        "auto",
        "the kernel that casts each FSDP2 unit's gradients into its reduce-scatter buffer: torch = FSDP2's own "
        "(PyTorch's chunk_cat); triton = loom's copy kernel (loom.kernels.chunk_copy) where the unit's "
        "gradients fit it (first dims divisible by the shard count), FSDP2's own otherwise; auto = triton on "
        "CUDA with Triton (the same bytes, +1.2-1.6% tokens/s at 8B on 2 H200s), torch elsewhere",
        choices=("auto", "torch", "triton"),
        resume=(FREE, KERNEL),
    )
    reduce_dtype: str = opt(
        "float32",
        "dtype FSDP2 reduces gradients in (its MixedPrecisionPolicy.reduce_dtype; torchtitan's "
        "mixed_precision_reduce): bfloat16 halves the reduce-scatter's bytes and rounds each summed "
        "gradient to bf16; training.dtype bfloat16 under FSDP2 / HSDP, not with cpu_offload",
        choices=("float32", "bfloat16"),
        resume=(FREE, "the same gradients, summed in another dtype"),
    )
    cpu_offload: bool = opt(
        False,
        "keep parameters, gradients and AdamW state in host memory (FSDP2's offload, on one "
        "GPU too); the GPU holds the blocks being computed (docs/operations.md)",
        resume=(FREE, LAYOUT),
    )
    backend: str = opt(
        "auto",
        "process-group backend: auto (NCCL on GPUs, gloo on the CPU); mpi where PyTorch was built with MPI, for "
        "data-parallel replicas (DDP) whose ranks mpirun starts (docs/operations.md#mpirun)",
        choices=("auto", "nccl", "gloo", "mpi"),
        resume=(FREE, LAYOUT),
    )
    timeout_s: float = opt(
        600.0,
        "seconds a collective waits for the other ranks before the run stops with a "
        "hang report naming the stuck ranks (<run.dir>/hang_report.txt); start-up waits at "
        "least 1800 (docs/operations.md)",
        min=0.0,
        min_exclusive=True,
        resume=(FREE, "how long a collective waits before the run stops with a hang report"),
    )
    distributed_debug: str = opt(
        "OFF",
        "TORCH_DISTRIBUTED_DEBUG for this run: INFO / DETAIL check every collective's "
        "arguments across ranks (slower); OFF = the environment's",
        choices=("OFF", "INFO", "DETAIL"),
        resume=(FREE, "PyTorch's collective checks: the same math"),
    )
    diloco_inner_steps: int = opt(
        0,
        "DiLoCo: the dp_replicate groups train apart for this many optimizer steps H "
        "(no gradient all-reduce across groups), then average their pseudo-gradients "
        "and take an outer step; 0 = off (docs/algorithms.md)",
        min=0,
        resume=(
            MUST_MATCH,
            "the checkpoint holds each replica group's weights and inner "
            "optimizer state beside the outer state (or one model without "
            "DiLoCo)",
        ),
    )
    diloco_outer_lr: float = opt(
        0.7,
        "DiLoCo: outer (Nesterov SGD) learning rate",
        min=0.0,
        min_exclusive=True,
        needs="parallel.diloco_inner_steps",
        resume=(APPLIED, "the outer step from the next synchronization"),
    )
    diloco_outer_momentum: float = opt(
        0.9,
        "DiLoCo: outer Nesterov momentum (0 = plain SGD)",
        min=0.0,
        max=1.0,
        needs="parallel.diloco_inner_steps",
        resume=(APPLIED, "the outer step from the next synchronization (the momentum buffers are kept)"),
    )
    diloco_bf16: bool = opt(
        False,
        "DiLoCo: all-reduce the pseudo-gradients in bfloat16 (half the bytes)",
        needs="parallel.diloco_inner_steps",
        resume=(APPLIED, "the pseudo-gradients' precision on the wire from the next synchronization"),
    )
    diloco_fragments: int = opt(
        1,
        "DiLoCo: > 1 = streaming DiLoCo: the model split into this many fragments, "
        "each synchronized every H steps at staggered steps (H / fragments apart)",
        min=1,
        needs="parallel.diloco_inner_steps",
        resume=(MUST_MATCH, "which parameters the outer weights of a round were taken for, and when"),
    )
    diloco_overlap_steps: int = opt(
        0,
        "DiLoCo: > 0 = a fragment's outer all-reduce overlaps this many inner steps "
        "tau (Streaming DiLoCo): launched at its synchronization step, applied tau "
        "steps later; 0 = the all-reduce blocks its step",
        min=0,
        resume=(
            MUST_MATCH,
            "which reductions are in flight at a step, and when each is "
            "applied (the checkpoint holds their averaged "
            "pseudo-gradients)",
        ),
    )
    diloco_overlap_alpha: float = opt(
        0.5,
        "DiLoCo with diloco_overlap_steps > 0: the weights after an applied outer "
        "step are alpha x local + (1 - alpha) x outer (the local progress of the "
        "overlapped steps mixed in; 0 = the outer weights)",
        min=0.0,
        max=1.0,
        needs="parallel.diloco_inner_steps",
        resume=(APPLIED, "the mixing of the next applied outer steps"),
    )


@dataclass
class CheckpointConfig:
    every: int = opt(0, "save every N steps (0 = no periodic saves)", min=0, resume=(FREE, OUTPUT))
    keep: int = opt(3, "complete checkpoints to keep (0 = all)", min=0, resume=(FREE, OUTPUT))
    resume: str = opt(
        "auto",
        "'auto' = the newest complete checkpoint of this run's checkpoint folder (a fresh "
        "start when it holds none), 'none' = a fresh start (refused where the folder holds "
        "checkpoints, unless checkpoint.overwrite), or a checkpoint path",
        resume=(FREE, "which checkpoint to start from"),
    )
    async_save: bool = opt(False, "write checkpoints in the background", resume=(FREE, OUTPUT))
    at_end: bool = opt(True, "save when training ends", resume=(FREE, OUTPUT))
    dir: str = opt("", "checkpoint folder; empty = <run.dir>/checkpoints", resume=(FREE, OUTPUT))
    overwrite: bool = opt(
        False,
        "with resume = none in a checkpoint folder that holds checkpoints: move them into "
        "<checkpoint folder>/superseded/<time>/ (never deleted) and start fresh; with "
        "resume = an older checkpoint's path: move the newer ones there and branch",
        needs="resume none or a path",
        resume=(FREE, OUTPUT),
    )
    preempt_grace_s: float = opt(
        25.0,
        "SIGTERM/SIGINT: the ranks agree at the end of the current step, save and exit "
        "0; a rank still running this many seconds after the signal exits 1 (the last "
        "complete checkpoint stays)",
        min=0.0,
        min_exclusive=True,
        resume=(FREE, OUTPUT),
    )


@dataclass
class MetricsConfig:
    every: int = opt(10, "log every N steps", min=1, resume=(FREE, OUTPUT))
    tensorboard: bool = opt(
        True,
        "also write TensorBoard events to <run.dir>/tensorboard; without the tensorboard "
        "package the run says so in one line at start and goes on without them",
        resume=(FREE, OUTPUT),
    )
    wandb: bool = opt(
        False,
        "also log to Weights & Biases (pip install 'loom-train[wandb]'): the scalars of "
        "metrics.jsonl and the config; WANDB_MODE=offline keeps the run in <run.dir>/wandb",
        resume=(FREE, OUTPUT),
    )
    wandb_project: str = opt("loom", "W&B project", resume=(FREE, OUTPUT))
    wandb_entity: str = opt(
        "", "W&B team or user; empty = W&B's default (WANDB_ENTITY or your login's)", resume=(FREE, OUTPUT)
    )
    mlflow: bool = opt(
        False,
        "also log to MLflow (pip install 'loom-train[mlflow]'): the scalars of metrics.jsonl "
        "and the config as run parameters",
        resume=(FREE, OUTPUT),
    )
    mlflow_experiment: str = opt("loom", "MLflow experiment (created when missing)", resume=(FREE, OUTPUT))
    mlflow_tracking_uri: str = opt(
        "",
        "MLflow tracking URI (http://host:5000, sqlite:///mlflow.db, file:/path); empty "
        "= MLFLOW_TRACKING_URI when set, else the file store <run.dir>/mlruns",
        resume=(FREE, OUTPUT),
    )
    run_name: str = opt(
        "", "the run's name in W&B and MLflow; empty = the last folder name of run.dir", resume=(FREE, OUTPUT)
    )
    progress: bool = opt(True, "progress bar on rank 0 when stderr is a terminal", resume=(FREE, OUTPUT))
    profile_steps: str = opt(
        "",
        "'A:B' = profile optimizer steps A..B (1 <= A <= B <= training.steps): trace "
        "per rank (+ CUDA memory snapshot) in <run.dir>/profile; empty = off",
        resume=(FREE, OUTPUT),
    )
    profile_memory: bool = opt(
        True,
        "with metrics.profile_steps on CUDA: also record the allocator's history (the memory snapshot); its "
        "Python stack per allocation slows the profiled steps, so false to time them as they run unprofiled",
        resume=(FREE, OUTPUT),
    )
    profile_host: bool = opt(
        True,
        "with metrics.profile_steps: also record the host's ops (CPU activity, the ProfilerStep ranges); false "
        "records the GPU alone (kernels, copies and their launch calls: CUDA only), so the profiled steps' host "
        "runs as it does unprofiled and the GPU's idle gaps are the run's own, not the profiler's",
        needs="metrics.profile_steps",
        resume=(FREE, OUTPUT),
    )
    straggler_fraction: float = opt(
        0.2,
        "at every logged step, name the ranks whose own time per step (the step less "
        "its wait in collectives on GPUs; data wait + CPU time on the CPU) "
        "exceeds the ranks' median by more than this fraction (console, metrics.jsonl "
        "straggler_ranks; docs/operations.md); 0 = off",
        min=0.0,
        resume=(FREE, OUTPUT),
    )
    nvtx: bool = opt(
        False,
        "NVTX ranges for Nsight Systems (step, data wait, micro-batch, forward, backward, "
        "each block's forward and backward, optimizer, validation, checkpoint save, the loss "
        "all-reduce, context parallelism's "
        "K/V exchange and expert parallelism's token all-to-alls): run under `nsys profile` "
        "(docs/metrics.md); has effect only with a PyTorch built with CUDA (elsewhere the banner says so)",
        resume=(FREE, OUTPUT + ": NVTX ranges for a profiler's timeline"),
    )
    noise_scale: bool = opt(
        False,
        "log the gradient noise scale B_simple (McCandlish et al. 2018) as noise_scale: "
        "the first micro-batch's gradient against the step's, smoothed; costs one more "
        "gradient norm per step; needs accumulation >= 2 (docs/algorithms.md)",
        resume=(FREE, "a logged estimate (its smoothing restarts)"),
    )


@dataclass
class LoraConfig:
    """LoRA / QLoRA fine-tuning (loom.models.common.lora; docs/lora.md)."""

    rank: int = opt(
        0,
        "LoRA rank r: low-rank adapters on lora.targets, every other weight frozen; 0 = off (all "
        "weights train)",
        min=0,
        resume=(MUST_MATCH, "the adapters' shapes (and which weights train)"),
    )
    alpha: float = opt(
        16.0,
        "the adapters' update B·A is scaled by alpha / rank (alpha / sqrt(rank) with lora.rslora)",
        min=0.0,
        min_exclusive=True,
        needs="lora.rank",
        resume=(APPLIED, "the adapters' scaling from the next step"),
    )
    dropout: float = opt(
        0.0,
        "dropout on the adapters' input in training steps (validation runs without it)",
        min=0.0,
        max=1.0,
        needs="lora.rank",
        resume=(APPLIED, "from the next step"),
    )
    targets: str = opt(
        "q,k,v,o,gate,up,down",
        "comma list of the linears that get adapters: q, k, v, o "
        "(attention), gate, up, down (SwiGLU), or all of those; multi-head latent attention: q_a, q_b "
        "(or q), kv_a, kv_b, o; a mixture of experts' shared experts: shared_gate, shared_up, shared_down "
        "(routed experts get none)",
        needs="lora.rank",
        resume=(MUST_MATCH, "which linears have adapters"),
    )
    rslora: bool = opt(
        False,
        "rank-stabilized LoRA: scale by alpha / sqrt(rank) (PEFT's use_rslora)",
        needs="lora.rank",
        resume=(APPLIED, "the adapters' scaling from the next step"),
    )
    base_dtype: str = opt(
        "float32",
        "the frozen weights: float32 (as loaded), bfloat16 (every frozen weight in "
        "bf16: half the memory, no per-step casts; the usual LoRA setup; needs "
        "training.dtype bfloat16), or nf4 = QLoRA "
        "(the adapted linears in 4-bit NormalFloat with double-quantized scales, the "
        "other frozen weights in bf16 when training.dtype is bfloat16; torchao: pip "
        "install 'loom-train[qlora]')",
        choices=("float32", "bfloat16", "nf4"),
        resume=(MUST_MATCH, "the frozen base's values (an NF4 base is rebuilt at start, not loaded)"),
    )
    init_from: str = opt(
        "",
        "a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) to start "
        "the adapters from; its r, lora_alpha, target_modules and use_rslora must equal "
        "this section's",
        needs="lora.rank",
        resume=(APPLIED, "initialisation only: the checkpoint's adapters are resumed"),
    )
    fused: str = opt(
        "auto",
        "a plain frozen base and its adapter as one op (loom::lora_linear: the linears of one input "
        "in one call, the rank-r product accumulated onto the base GEMM's output, forward and input "
        "gradient) or as two linears and an add; auto = docs/lora.md's rule",
        choices=("auto", "true", "false"),
        resume=(FREE, "the same product computed another way"),
    )


@dataclass
class DpoConfig:
    """Direct preference optimization (training.objective dpo; docs/finetuning.md)."""

    beta: float = opt(
        0.1,
        "the strength of the pull towards the reference: rewards are beta x (policy - reference) "
        "log-probabilities of a completion",
        min=0.0,
        min_exclusive=True,
        resume=(APPLIED, "the loss and rewards from the next step"),
    )
    loss: str = opt(
        "sigmoid",
        "'sigmoid' = DPO's -log sigmoid(beta x margin); 'ipo' = IPO's squared loss on the "
        "per-token log-ratio margin, (margin - 1 / (2 beta))^2, as TRL defines it",
        choices=("sigmoid", "ipo"),
        resume=(APPLIED, "the loss from the next step"),
    )
    reference: str = opt(
        "cached",
        "the reference model's log-probabilities: 'cached' = one pass of the initial model "
        "over every pair before the first step, kept in the run dir; 'adapters_off' = the "
        "policy with its LoRA adapters off, every step (needs lora.rank > 0); 'copy' = a "
        "frozen copy of the initial policy in its layout, one no-grad forward per "
        "micro-batch (not with LoRA)",
        choices=("cached", "adapters_off", "copy"),
        resume=(MUST_MATCH, "what the policy is compared against"),
    )


@dataclass
class RewardConfig:
    """Reward model (training.objective reward; docs/finetuning.md)."""

    center_coefficient: float = opt(
        0.0,
        "TRL's center_rewards_coefficient: adds coefficient x (r_chosen + "
        "r_rejected)^2 per pair, keeping rewards centred on 0; 0 = off",
        min=0.0,
        resume=(APPLIED, "the loss from the next step"),
    )


@dataclass
class PpoConfig:
    """Proximal policy optimization with a value head (training.objective ppo; docs/rl.md). Rollouts, rewards and the
    warm-up come from the [grpo] section's sampling fields; each batch of rollouts is mini_batches x
    training.global_batch_size completions, trained for epochs x mini_batches optimizer steps."""

    critic: str = opt(
        "head",
        "the value function: 'head' = a dim -> 1 head on the policy's final hidden states "
        "(shares its trunk); 'model' = a separate model of the policy's shape with that head "
        "(trained in full, also under LoRA), a copy of the policy as PPO starts",
        choices=("head", "model"),
        resume=(MUST_MATCH, "the value function's parameters in the checkpoint"),
    )
    kl_coef: float = opt(
        0.05,
        "weight of the KL to the reference (the base with its adapters off under LoRA, else a "
        "frozen copy of the policy as PPO starts); 0 = no reference",
        min=0.0,
        resume=(APPLIED, "the rewards or loss of the next batch of rollouts"),
    )
    kl_penalty: str = opt(
        "reward",
        "where the KL goes: 'reward' = -kl_coef x KL per token in the rewards (TRL's); "
        "'loss' = kl_coef x k3 KL per token added to the loss (as GRPO's beta)",
        choices=("reward", "loss"),
        resume=(APPLIED, "the rewards or loss of the next batch of rollouts"),
    )
    kl_estimator: str = opt(
        "k1",
        "the KL penalty in the rewards: 'k1' = logp - ref_logp, 'k3' = exp(ref - logp) - (ref - logp) - 1",
        choices=("k1", "k3"),
        resume=(APPLIED, "the rewards of the next batch of rollouts"),
    )
    gamma: float = opt(
        1.0,
        "GAE discount per token",
        min=0.0,
        max=1.0,
        resume=(APPLIED, "the advantages of the next batch of rollouts"),
    )
    lam: float = opt(
        0.95, "GAE lambda", min=0.0, max=1.0, resume=(APPLIED, "the advantages of the next batch of rollouts")
    )
    cliprange: float = opt(
        0.2,
        "the policy ratio is clipped to [1 - cliprange, 1 + cliprange]",
        min=0.0,
        resume=(APPLIED, "the loss from the next step"),
    )
    cliprange_value: float = opt(
        0.2,
        "new values are clipped to the rollout-time values +- cliprange_value",
        min=0.0,
        resume=(APPLIED, "the loss from the next step"),
    )
    vf_coef: float = opt(
        0.1,
        "weight of the value loss beside the policy loss",
        min=0.0,
        resume=(APPLIED, "the loss from the next step"),
    )
    whiten_advantages: bool = opt(
        True,
        "advantages whitened over the batch of rollouts' completion tokens (TRL's)",
        resume=(APPLIED, "the advantages of the next batch of rollouts"),
    )
    whiten_rewards: bool = opt(
        False,
        "per-token rewards scaled to unit variance (mean kept) before GAE",
        resume=(APPLIED, "the rewards of the next batch of rollouts"),
    )
    epochs: int = opt(
        4,
        "passes over each batch of rollouts (TRL's num_ppo_epochs), reshuffled each pass",
        min=1,
        resume=(APPLIED, "the steps on the next batch of rollouts"),
    )
    mini_batches: int = opt(
        1,
        "optimizer steps per pass: a batch of rollouts is mini_batches x "
        "training.global_batch_size completions (TRL's num_mini_batches)",
        min=1,
        resume=(APPLIED, "the size of the next batch of rollouts"),
    )


@dataclass
class GrpoConfig:
    """Group relative policy optimization (training.objective grpo; docs/rl.md). A step's rows are
    training.global_batch_size completions: global_batch_size / group_size prompts, group_size completions each."""

    group_size: int = opt(
        4,
        "completions sampled per prompt (G); their rewards are normalized within the group",
        min=2,
        resume=(APPLIED, "the rollouts from the next step"),
    )
    max_new_tokens: int = opt(
        8,
        "the longest completion, in tokens (prompt + completion must fit training.seq_len)",
        min=1,
        resume=(APPLIED, "the rollouts from the next step"),
    )
    temperature: float = opt(
        1.0,
        "sampling temperature of the rollouts (the log-probabilities are of the logits "
        "divided by it, as TRL's)",
        min=0.0,
        min_exclusive=True,
        resume=(APPLIED, "the rollouts from the next step"),
    )
    top_p: float = opt(
        1.0,
        "nucleus sampling of the rollouts; 1 = off",
        min=0.0,
        min_exclusive=True,
        max=1.0,
        resume=(APPLIED, "the rollouts from the next step"),
    )
    epsilon: float = opt(
        0.2,
        "the clipped ratio's lower bound is 1 - epsilon",
        min=0.0,
        resume=(APPLIED, "the loss from the next step"),
    )
    epsilon_high: float = opt(
        0.0,
        "the upper bound is 1 + epsilon_high; 0 = epsilon (DAPO: 0.28)",
        min=0.0,
        resume=(APPLIED, "the loss from the next step"),
    )
    beta: float = opt(
        0.0,
        "weight of the k3 KL to the reference per token; 0 = no reference (nothing computed). "
        "The reference: the base with its adapters off under LoRA, else a frozen copy of the "
        "initial policy",
        min=0.0,
        resume=(APPLIED, "the loss from the next step"),
    )
    iterations: int = opt(
        1,
        "optimizer steps on each batch of rollouts (TRL's num_iterations): the first step's "
        "ratio is 1; later ones clip against the rollout-time log-probabilities",
        min=1,
        resume=(APPLIED, "the updates per batch of rollouts from the next step"),
    )
    max_staleness: int = opt(
        0,
        "asynchronous GRPO: the next steps' rollouts are sampled on a thread (or a process: grpo.sampler_process) "
        "from a snapshot of the policy while this step trains, each from the weights at most this many optimizer "
        "steps old (the batches in flight); "
        "0 = synchronous (sampled on the current weights, as without it)",
        min=0,
        resume=(APPLIED, "from the next step (a run resumed past its first GRPO step continues with 0)"),
    )
    is_cap: float = opt(
        3.0,
        "asynchronous GRPO: each token's truncated importance weight min(pi_old / pi_sampler, is_cap) on its "
        "surrogate loss (TRL's vllm_importance_sampling_clip_max, token_truncate): pi_sampler the stale "
        "snapshot's probability of the token, pi_old the policy's at the step",
        min=0.0,
        min_exclusive=True,
        needs="grpo.max_staleness",
        resume=(APPLIED, "the loss from the next step"),
    )
    sampler_device: str = opt(
        "",
        "asynchronous GRPO: the device the snapshot samples on, e.g. 'cuda:1' (a GPU of its own beside the "
        "trainer's, one process); '' = the rank's own device",
        needs="grpo.max_staleness",
        resume=(
            FREE,
            "where the rollouts are sampled (a resumed run past its first GRPO step continues with 0)",
        ),
    )
    sampler_process: bool = opt(
        False,
        "asynchronous GRPO: the sampler in a process of its own (its own Python: generation never takes the "
        "trainer's GIL; its snapshot shared with the trainer, refreshed in place) instead of a thread; one process",
        needs="grpo.max_staleness",
        resume=(FREE, "how the same rollouts are sampled"),
    )
    loss_type: str = opt(
        "dapo",
        "normalization: 'grpo' = per completion, then over completions; 'bnpo' / 'dapo' = "
        "per completion token of the global batch; 'dr_grpo' = over completions x "
        "max_new_tokens (docs/rl.md)",
        choices=("grpo", "bnpo", "dapo", "dr_grpo"),
        resume=(APPLIED, "the loss from the next step"),
    )
    scale_rewards: str = opt(
        "group",
        "advantages divided by the std of the group's rewards, of the global batch's, or not at all",
        choices=("group", "batch", "none"),
        resume=(APPLIED, "the advantages from the next step"),
    )
    mask_truncated: bool = opt(
        False,
        "completions cut at max_new_tokens (no EOS) take no loss",
        resume=(APPLIED, "the loss from the next step"),
    )
    keep_cache: bool = opt(
        True,
        "the rollout engine keeps its KV cache and CUDA graphs between steps (no "
        "re-allocation or re-capture; the cache's memory stays held during training); "
        "false = freed after each generation",
        resume=(APPLIED, "the next generation"),
    )
    prompts: str = opt(
        "",
        "'' = the embedded arithmetic task; else a .jsonl / .parquet file or a saved Hugging Face "
        "dataset of rows with a 'prompt': a string, or chat messages rendered with the chat "
        "template (or a 'messages' column); every other field goes to the reward functions",
        resume=(MUST_MATCH, "the prompt stream that the step counts in"),
    )
    rewards: str = opt(
        "",
        "comma list of reward functions 'module:function' (docs/rl.md); '' = the embedded "
        "task's loom.rl.arithmetic:exact_answer,loom.rl.arithmetic:digit_match",
        resume=(APPLIED, "the rewards from the next step"),
    )
    reward_weights: str = opt(
        "",
        "comma list of weights, one per reward function; '' = the embedded task's 1,0.5, else 1 each",
        resume=(APPLIED, "the rewards from the next step"),
    )
    reward_model: str = opt(
        "",
        "a reward model (a training.objective reward run or its checkpoint, or an HF "
        "*ForSequenceClassification folder; the policy's tokenizer) scoring prompt + "
        "completion, added to grpo.rewards (none by default when set); GRPO and PPO",
        resume=(APPLIED, "the rewards from the next step"),
    )
    reward_model_weight: float = opt(
        1.0,
        "the reward model's weight in the summed reward",
        needs="grpo.reward_model",
        resume=(APPLIED, "the rewards from the next step"),
    )
    digits: int = opt(
        1,
        "embedded task: operands of 1..digits digits",
        min=1,
        max=6,
        needs="embedded task",
        resume=(MUST_MATCH, "the embedded task's prompt stream"),
    )
    ops: str = opt(
        "+",
        "embedded task: operators drawn from '+' and '*'",
        needs="embedded task",
        resume=(MUST_MATCH, "the embedded task's prompt stream"),
    )
    lr_ratio: float = opt(
        0.1,
        "GRPO steps train at this fraction of the LR schedule's value (the warm-up at all "
        "of it): policy gradients on a model's own samples need smaller steps than supervised "
        "ones",
        min=0.0,
        min_exclusive=True,
        max=1.0,
        resume=(APPLIED, "the learning rate of the next GRPO step"),
    )
    warmup_steps: int = opt(
        -1,
        "steps of supervised warm-up on the embedded task's worked examples before GRPO; "
        "-1 = half of training.steps with the embedded task, 0 with grpo.prompts",
        min=-1,
        resume=(MUST_MATCH, "when the supervised warm-up ends, GRPO starts and its reference is taken"),
    )
    judge: str = opt(
        "",
        "a judge model (RLAIF: a loom checkpoint or run dir, or a Hugging Face folder) scoring each "
        "completion as a reward beside grpo.rewards; '' = none (docs/rl.md)",
        resume=(APPLIED, "the rewards from the next batch of rollouts"),
    )
    judge_template: str = opt(
        "",
        "the judge's prompt, or a file holding it: str.format or Jinja2 with {prompt}, "
        "{completion} and the prompt rows' other fields",
        needs="grpo.judge",
        resume=(APPLIED, "the rewards from the next batch of rollouts"),
    )
    judge_score: str = opt(
        "number",
        "'number' = the first match of judge_pattern in the judge's greedy output; "
        "'yes_no' = P(yes) / (P(yes) + P(no)) of its next token",
        choices=("number", "yes_no"),
        needs="grpo.judge",
        resume=(APPLIED, "the rewards from the next batch of rollouts"),
    )
    judge_pattern: str = opt(
        r"(-?\d+(?:\.\d+)?)",
        "judge_score number: a regex whose one group is the score "
        "(no match: the range's low end, counted as judge/unparsed)",
        needs="grpo.judge",
        resume=(APPLIED, "the rewards from the next batch of rollouts"),
    )
    judge_range: str = opt(
        "0,10",
        "'low,high': a number is clipped to it; P(yes) is scaled onto it",
        needs="grpo.judge",
        resume=(APPLIED, "the rewards from the next batch of rollouts"),
    )
    judge_tokens: str = opt(
        "Yes,No",
        "judge_score yes_no: the two words (each one token of the judge's tokenizer)",
        needs="grpo.judge",
        resume=(APPLIED, "the rewards from the next batch of rollouts"),
    )
    judge_weight: float = opt(
        1.0,
        "the judge's weight in the summed reward",
        needs="grpo.judge",
        resume=(APPLIED, "the rewards from the next batch of rollouts"),
    )
    judge_max_new_tokens: int = opt(
        8,
        "judge_score number: the judge's output length",
        min=1,
        needs="grpo.judge",
        resume=(APPLIED, "the rewards from the next batch of rollouts"),
    )


SECTIONS = {
    "run": RunConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "lora": LoraConfig,
    "dpo": DpoConfig,
    "grpo": GrpoConfig,
    "ppo": PpoConfig,
    "reward": RewardConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
}


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    ppo: PpoConfig = field(default_factory=PpoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __getattr__(self, name: str):
        """A section a registered method declares in its module, made at its defaults when first read (so a config
        imports a method's module only when that method's section is used)."""
        cls = section_class(name) if not name.startswith("__") else None
        if cls is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self.__dict__[name] = value = cls()
        return value

    def __eq__(self, other) -> bool:
        return isinstance(other, Config) and config_dict(self) == config_dict(other)


def section_names() -> list[str]:
    """Every section's name, in ``all_sections``' order, from the registry alone (no method module imported)."""
    out = list(SECTIONS)
    for _, names in METHODS.values():
        out += [name for name in names if name not in out]
    return out


def section_class(name: str) -> type | None:
    """The dataclass of section ``name``: one above, or one a registered method declares in its module (``SECTIONS``
    there, read from the module its line in ``METHODS`` names, imported only then); None for no section."""
    if name in SECTIONS:
        return SECTIONS[name]
    for module, names in METHODS.values():
        if name in names:
            declared = getattr(importlib.import_module(module), "SECTIONS", {})
            if name not in declared:
                raise ImportError(
                    f"{module} declares no config section {name!r} (its line in METHODS names it)"
                )
            return declared[name]
    return None


def all_sections() -> dict[str, type]:
    """Every section: the ones above, then those the registered methods declare (importing their modules)."""
    return {name: section_class(name) for name in section_names()}


def config_dict(cfg: Config) -> dict[str, dict]:
    """``{section: {field: value}}`` for every section, methods' own included (``dataclasses.asdict`` sees only
    the fields above)."""
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in all_sections()}

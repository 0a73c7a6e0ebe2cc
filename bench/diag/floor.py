"""How fast a one-GPU training step could be on this GPU at its precision, from parts measured here: the step's
GEMMs alone (every linear's forward, input-gradient and, where it trains, weight-gradient product at the step's
shapes, LoRA's rank-r products included, back to back in bf16), its attention alone (forward + backward on the backend ``auto`` chose),
both together (the GPU's power cap binds the GEMMs hardest when nothing else runs), the AdamW kernel alone, and the
bytes the rest of the step must move at least (RMSNorm, residual adds, RoPE, SwiGLU, the loss's softmax, the
gradient norm) at the bandwidth and the energy a byte of a copy costs here; each part's time, power and joules.
Against ``--peer`` (the same call's bench.train_1b or bench.lora result with the peer) it sets the step a ratio of
``--bar`` needs beside the floor: the parts one after another, and their energy at the power limit. Workloads: the
1B step of bench.train_1b (loom compiled) and the LoRA 8B step of bench.lora (``loom_lora``).
docs/benchmarks.md, "One GPU: where the time goes", reads it.

    python -m bench.train_1b --variants loom_compile,hf_compile --out /tmp/t1b.json
    python -m bench.diag.floor --peer /tmp/t1b.json --out bench/results/floor_1b_h200.json
    python -m bench.lora --flavor 8B --variants loom_lora_graphs,hf_peft_compile --micro-batch 2 --out /tmp/l8.json
    python -m bench.diag.floor --workload lora_8b --peer /tmp/l8.json --out bench/results/floor_lora_8b_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

import torch
from torch import nn
from torch.nn import functional as F

# name -> (the loom trainer the floor measures, the peer's and loom's variants in the --peer file, micro-batch)
WORKLOADS = {
    "1b": ("bench.train_1b", {"training.compile": "true"}, "hf_compile", "loom_compile", 4),
    "lora_8b": ("bench.lora", "loom_lora", "hf_peft_compile", "loom_lora_graphs", 2),
}


def workload_trainer(name: str, micro_batch: int, seq: int):
    """The loom trainer of workload ``name``, as its bench script builds it."""
    module, overrides, *_ = WORKLOADS[name]
    run_dir = tempfile.mkdtemp()
    if module == "bench.lora":
        from bench.lora import VARIANTS, loom_trainer

        return loom_trainer("8B", micro_batch, VARIANTS[overrides], run_dir, seq)
    from bench.train_1b import loom_trainer

    return loom_trainer(micro_batch, overrides, run_dir, seq)


ADAPTERS = (".lora_A", ".lora_B")
SHARED_INPUT = ("wk", "wv", "w3")  # read the input of wq / w1


def linear_shapes(model: nn.Module) -> list[tuple[int, int, bool, bool]]:
    """(in, out, trains, is a LoRA adapter) of every linear the model runs: the output head (tied or not), a LoRA
    linear's frozen base and its two adapters."""
    return [
        (m.in_features, m.out_features, m.weight.requires_grad, name.endswith(ADAPTERS))
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]


def adapter_reread_bytes(model: nn.Module, tokens: int) -> int:
    """What LoRA's adapters must read beyond the frozen base's GEMMs with their rank-r products fused into those
    GEMMs (x A in the forward's prologue, its product in the epilogue, dy B in the input gradient's): each distinct
    adapted input once more in the backward, for A's gradient (bf16; q/k/v and gate/up read one input). Counts as
    bench.lora adapts them, every linear (``lora.targets = all``): wq / w1 stand for their groups."""
    return sum(
        2 * tokens * m.in_features
        for name, m in model.named_modules()
        if name.endswith(".lora_A") and name.split(".")[-2] not in SHARED_INPUT
    )


def rest_bytes(args, tokens: int, n_trained: int, stream: int) -> dict[str, float]:
    """The fewest bytes the step's work outside GEMMs, attention and the optimizer can move at loom's precision
    (a residual stream of ``stream`` bytes an element: fp32 under autocast, bf16 over a frozen bf16 base; bf16
    activations kept for the backward; the gradients of ``n_trained`` fp32 parameters), with each elementwise chain
    fused into one pass and nothing recomputed: what no kernel outside a GEMM's prologue or epilogue can avoid."""
    d, f, heads = args.dim, args.ffn_dim, (args.n_heads + args.n_kv_heads) * args.head_dim
    per_block = {
        # residual add + RMSNorm, twice a block: read the stream and the branch (bf16), write both outputs
        "norm_add_fwd": 2 * (stream + 2 + stream + 2) * d,
        # its backward, twice: the saved input, the normed output's gradient (bf16), the stream's gradient read and
        # written
        "norm_add_bwd": 2 * (stream + 2 + stream + stream) * d,
        "rope_fwd_bwd": 2 * (2 + 2) * heads,  # q and k read and written, forward and backward
        "swiglu_fwd": (2 + 2 + 2) * f,  # gate and up read, their product written
        "swiglu_bwd": (2 + 2 + 2 + 2 + 2)
        * f,  # gate, up and the product's gradient read; two gradients written
    }
    out = {k: v * tokens * args.n_layers for k, v in per_block.items()}
    out["final_norm_fwd_bwd"] = (stream + 2 + stream + 2 + stream) * d * tokens
    out["loss_softmax"] = (2 + 2) * args.vocab_size * tokens  # the logits read, their gradient written (bf16)
    out["grad_norm"] = 4 * n_trained  # every fp32 gradient read once
    return out


def copy_pass(gib: float = 2.0):
    """A device-to-device copy of ``gib`` GiB (fp32) and the bytes it moves (read + write): the bandwidth, and the
    energy a byte costs, of a plain memory-bound pass here."""
    src = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * src.numel() * 4


def gemm_pass(shapes: list[tuple[int, int, bool, bool]], tokens: int, device: str = "cuda"):
    """One step's linear GEMMs in bf16 as autograd runs them: y = x W^T, dx = dy W and, for a weight that trains,
    dW = dy^T x; a weight for each linear, activations shared by linears of one width (the wide ones larger than
    L2)."""
    dev, bf = device, torch.bfloat16
    weights = [torch.randn(o, i, device=dev, dtype=bf) * 0.02 for i, o, *_ in shapes]
    acts = {
        w: torch.randn(tokens, w, device=dev, dtype=bf) for w in {s for i, o, *_ in shapes for s in (i, o)}
    }

    def run():
        for (i, o, trains, _), w in zip(shapes, weights):
            F.linear(acts[i], w)
            acts[o] @ w
            if trains:
                acts[o].t() @ acts[i]

    flops = sum((6 if trains else 4) * tokens * i * o for i, o, trains, _ in shapes)
    return run, flops


def attention_pass(args, micro_batch: int, seq: int, backend: str):
    """Forward + backward of every block's attention on ``backend``, at the step's shape."""
    from loom.models.common.layers import attend

    def qkv(heads):
        return torch.randn(micro_batch, heads, seq, args.head_dim, device="cuda", dtype=torch.bfloat16)

    q, k, v = (qkv(h).requires_grad_() for h in (args.n_heads, args.n_kv_heads, args.n_kv_heads))
    grad = qkv(args.n_heads)

    def run():
        for _ in range(args.n_layers):
            attend(q, k, v, backend, None).backward(grad)
            q.grad = k.grad = v.grad = None

    return run


def timed(fn, seconds: float = 2.0, warm: int = 3) -> dict:
    """Median ms of ``fn`` over about ``seconds`` of back-to-back calls, with the GPU's median power over them (W,
    NVML, the samples at >= 90% utilization) and so the joules one call costs."""
    from bench.common import GpuSampler, event_ms

    first = statistics.median(event_ms(fn, 3, warm))
    with GpuSampler(every_s=0.05) as sampler:
        ms = statistics.median(event_ms(fn, max(5, int(seconds * 1e3 / first)), 0))
    steady = ((sampler.summary() or {}).get("0") or {}).get("steady") or {}
    watts = steady.get("power_w_median")
    return {
        "ms": ms,
        "w": watts,
        "j": None if watts is None else watts * ms / 1e3,
        "mhz": steady.get("sm_clock_mhz_median"),
    }


def bytes_part(n: float, copy: dict) -> dict:
    """``n`` bytes moved at the copy's measured bandwidth and energy a byte."""
    return {
        "ms": 1e3 * n / copy["bytes_per_s"],
        "j": None if copy["j"] is None else n / copy["bytes"] * copy["j"],
    }


def measure(workload: str, micro_batch: int, seq: int) -> dict:
    from bench.common import time_steps

    trainer = workload_trainer(workload, micro_batch, seq)
    engine, args = trainer.engine, trainer.model_args
    tokens = micro_batch * seq
    backend = (engine.attention_times or {}).get("chosen", engine.kernels.attention)
    n_trained = sum(p.numel() for p in engine.params if p.requires_grad)
    # the embedding's dtype is the residual stream's
    stream = engine.module.tok_embeddings.weight.element_size()
    out = {
        "workload": workload,
        "tokens": tokens,
        "attention": backend,
        "attention_start_up_ms": engine.attention_times,
        "residual_stream_bytes": stream,
    }

    batches = [trainer.loader.next_step().micro_batches for _ in range(24)]
    times, _, _, gpus = time_steps(trainer.train_step, batches, 4)
    steady = gpus["0"]["steady"] if gpus and gpus["0"].get("steady") else {}
    ms = 1e3 * statistics.median(times)
    watts = steady.get("power_w_median")
    out["step"] = {"ms": ms, "w": watts, "j": None if watts is None else watts * ms / 1e3}
    out["power_limit_w"] = (gpus or {}).get("0", {}).get("power_limit_w")
    mbs = [engine.local_tokens(mb) for mb in batches[0]]
    engine.steps.step(mbs, torch.tensor(1.0 / tokens, device="cuda"))  # gradients for the optimizer alone
    out["optimizer"] = timed(engine.optimizer.step)
    shapes = linear_shapes(engine.module)
    reread = adapter_reread_bytes(engine.module, tokens)
    del trainer, engine, batches, mbs
    torch.cuda.empty_cache()

    gemms, flops = gemm_pass(shapes, tokens)
    attention = attention_pass(args, micro_batch, seq, backend)
    out["gemm_tflop"] = flops / 1e12
    out["gemms"] = timed(gemms)
    out["gemm_tflops_per_s"] = flops / (out["gemms"]["ms"] / 1e3) / 1e12
    out["attention_alone"] = timed(attention)
    out["gemms_attention"] = timed(lambda: (gemms(), attention()))
    if any(adapter for *_, adapter in shapes):  # LoRA: the frozen base's GEMMs alone, with attention
        base, base_flops = gemm_pass([s for s in shapes if not s[3]], tokens)
        out["base_gemm_tflop"] = base_flops / 1e12
        out["base_gemms_attention"] = timed(lambda: (base(), attention()))
    copy, copy_bytes = copy_pass()
    out["copy"] = {**timed(copy), "bytes": copy_bytes}
    out["copy"]["bytes_per_s"] = copy_bytes / (out["copy"]["ms"] / 1e3)
    rest = rest_bytes(args, tokens, n_trained, stream)
    total = sum(rest.values())
    out["rest_bytes"] = rest
    out["rest_floor"] = bytes_part(total, out["copy"])
    if "base_gemms_attention" in out:
        out["adapter_reread_bytes"] = reread
        out["rest_floor_fused_adapters"] = bytes_part(total + reread, out["copy"])
    out["peak_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


# the floor's parts, one after another or by their energy: as measured, and (LoRA) with the adapters fused into the
# frozen base's GEMMs, leaving only their byte floor
FLOORS = {
    "floor": ("gemms_attention", "optimizer", "rest_floor"),
    "floor_fused_adapters": (
        "base_gemms_attention",
        "adapter_flops",
        "optimizer",
        "rest_floor_fused_adapters",
    ),
}


def adapter_flops_part(out: dict) -> dict | None:
    """The adapters' rank-r FLOPs inside fused GEMMs, at the GEMM pass's measured time and energy a FLOP."""
    if "base_gemm_tflop" not in out:
        return None
    share = (out["gemm_tflop"] - out["base_gemm_tflop"]) / out["gemm_tflop"]
    j = out["gemms"]["j"]
    return {"ms": share * out["gemms"]["ms"], "j": None if j is None else share * j}


def against_peer(out: dict, peer_file: str, bar: float, power_limit_w: float) -> dict:
    """The step ``bar`` times the peer's speed needs (its median step in ``peer_file`` over ``bar``) against each
    floor: in time (the parts one after another, each as measured) and in energy (a step held at the power limit
    spends at most limit x time; a part whose power was not read, a launch-bound optimizer's, counts 0 J, so that
    floor is a lower bound)."""
    with open(peer_file) as fh:
        by = {r["variant"]: r for r in json.load(fh)["results"] if "error" not in r}
    _, _, peer, loom, _ = WORKLOADS[out.get("workload", "1b")]
    peer_ms = 1e3 * by[peer]["step_s_median"]
    need = peer_ms / bar
    keep = (
        "step_s_median",
        "tokens_per_s",
        "mfu",
        "peak_reserved_gib",
        "gpus",
        "joules_per_token",
        "profile",
    )
    res = {
        "runs": {v: {k: r.get(k) for k in keep} for v, r in by.items()},  # the peer file's figures, kept here
        "peer_step_ms": peer_ms,
        "loom_step_ms_in_that_run": 1e3 * by[loom]["step_s_median"] if loom in by else None,
        "bar": bar,
        "step_needed_ms": need,
        "joules_allowed": need / 1e3 * power_limit_w,
    }
    out = {**out, "adapter_flops": adapter_flops_part(out)}
    for name, parts in FLOORS.items():
        if not all(out.get(p) is not None for p in parts):
            continue
        ms, j = sum(out[p]["ms"] for p in parts), sum(out[p]["j"] or 0.0 for p in parts)
        res[name] = {
            "ms_in_sequence": ms,
            "ratio_in_sequence": peer_ms / ms,
            "j": j,
            "j_leaves_out": [p for p in parts if out[p]["j"] is None],
            "ms_at_the_limit": j / power_limit_w * 1e3,
            "ratio_at_the_limit": peer_ms / (j / power_limit_w * 1e3),
        }
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", choices=WORKLOADS, default="1b")
    p.add_argument("--micro-batch", type=int, default=None, help="default: the workload's bench's")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--peer", default="", help="the workload's bench result with the peer, from the same call")
    p.add_argument("--bar", type=float, default=1.3)
    p.add_argument("--power-limit-w", type=float, default=None, help="default: the limit NVML reported")
    p.add_argument(
        "--reread",
        default="",
        help="a result of this script: set it against --peer again (no GPU needed), rewritten in place",
    )
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.reread:
        with open(a.reread) as fh:
            doc = json.load(fh)
        out = doc["floor"]
        out["against_peer"] = against_peer(
            out, a.peer, a.bar, a.power_limit_w or out["power_limit_w"] or 700.0
        )
        with open(a.reread, "w") as fh:
            json.dump(doc, fh, indent=1)
        print(json.dumps({k: v for k, v in out["against_peer"].items() if k != "runs"}, indent=1))
        return
    if not torch.cuda.is_available():
        print("bench/diag/floor.py: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    out = measure(a.workload, a.micro_batch or WORKLOADS[a.workload][4], a.seq)
    if a.peer:
        out["against_peer"] = against_peer(
            out, a.peer, a.bar, a.power_limit_w or out["power_limit_w"] or 700.0
        )
    print(json.dumps(out, indent=1), flush=True)
    if a.out:
        from bench.common import command, default_commit, environment, write_result

        write_result(a.out, {"environment": environment(default_commit(), command()), "floor": out})


if __name__ == "__main__":
    main()

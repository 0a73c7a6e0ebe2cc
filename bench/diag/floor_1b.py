"""How fast the 1B one-GPU step (bench.train_1b's loom side, compiled) could be on this GPU at its precision, from
parts measured here: the step's GEMMs alone (every linear's forward, input-gradient and weight-gradient product at
the step's shapes, back to back in bf16), its attention alone (forward + backward on the backend ``auto`` chose),
both together (the GPU's power cap binds the GEMMs hardest when nothing else runs), the AdamW kernel alone, and the
bytes the rest of the step must move at least (RMSNorm, residual adds, RoPE, SwiGLU, the loss's softmax, the
gradient norm) over the bandwidth a copy reaches here. Against ``--peer`` (a bench.train_1b result of the same call
with ``hf_compile``) it prints the step a ratio of ``--bar`` needs and what is left of it for that rest.
docs/benchmarks.md, "One GPU: where the time goes", reads it.

    python -m bench.train_1b --variants loom_compile,hf_compile --out /tmp/t1b.json
    python -m bench.diag.floor_1b --peer /tmp/t1b.json --out bench/results/floor_1b_h200.json
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


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """(in, out) of every linear the model runs, the output head included (tied or not)."""
    return [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)]


def rest_bytes(args, tokens: int, n_params: int) -> dict[str, float]:
    """The fewest bytes the step's work outside GEMMs, attention and the optimizer can move at loom's precision
    (fp32 residual stream, bf16 activations kept for the backward, fp32 gradients), with each elementwise chain
    fused into one pass and nothing recomputed: what no kernel outside a GEMM's prologue or epilogue can avoid."""
    d, f, heads = args.dim, args.ffn_dim, (args.n_heads + args.n_kv_heads) * args.head_dim
    per_block = {
        # residual add + RMSNorm, twice a block: read the stream (fp32) and the branch (bf16), write both outputs
        "norm_add_fwd": 2 * (4 + 2 + 4 + 2) * d,
        # its backward, twice: the saved input (fp32), the normed output's gradient (bf16), the stream's gradient
        # read and written (fp32)
        "norm_add_bwd": 2 * (4 + 2 + 4 + 4) * d,
        "rope_fwd_bwd": 2 * (2 + 2) * heads,  # q and k read and written, forward and backward
        "swiglu_fwd": (2 + 2 + 2) * f,  # gate and up read, their product written
        "swiglu_bwd": (2 + 2 + 2 + 2 + 2)
        * f,  # gate, up and the product's gradient read; two gradients written
    }
    out = {k: v * tokens * args.n_layers for k, v in per_block.items()}
    out["final_norm_fwd_bwd"] = (4 + 2 + 4 + 2 + 4) * d * tokens
    out["loss_softmax"] = (2 + 2) * args.vocab_size * tokens  # the logits read, their gradient written (bf16)
    out["grad_norm"] = 4 * n_params  # every fp32 gradient read once
    return out


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes/s a device-to-device copy moves here (read + write), the best of 10."""
    from bench.common import event_ms

    src = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    best = min(event_ms(lambda: dst.copy_(src), 10, 3))
    return 2 * src.numel() * 4 / (best / 1e3)


def gemm_pass(shapes: list[tuple[int, int]], tokens: int):
    """One step's linear GEMMs in bf16 as autograd runs them: y = x W^T, dx = dy W, dW = dy^T x; a weight for each
    linear, activations shared by linears of one width (each is larger than L2)."""
    dev, bf = "cuda", torch.bfloat16
    weights = [torch.randn(o, i, device=dev, dtype=bf) * 0.02 for i, o in shapes]
    acts = {w: torch.randn(tokens, w, device=dev, dtype=bf) for w in {s for sh in shapes for s in sh}}

    def run():
        for (i, o), w in zip(shapes, weights):
            F.linear(acts[i], w)
            acts[o] @ w
            acts[o].t() @ acts[i]

    flops = sum(6 * tokens * i * o for i, o in shapes)
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


def measure(micro_batch: int, seq: int) -> dict:
    from bench.common import GpuSampler, event_ms, time_steps
    from bench.train_1b import loom_trainer

    def timed(fn, n=20, warm=3):
        with GpuSampler(every_s=0.05) as gpus:
            ms = statistics.median(event_ms(fn, n, warm))
        return ms, gpus.summary()

    trainer = loom_trainer(micro_batch, {"training.compile": "true"}, tempfile.mkdtemp(), seq)
    engine, args = trainer.engine, trainer.model_args
    tokens = micro_batch * seq
    backend = (engine.attention_times or {}).get("chosen", engine.kernels.attention)
    n_params = sum(p.numel() for p in engine.params)
    out = {"tokens": tokens, "attention": backend, "attention_start_up_ms": engine.attention_times}

    batches = [trainer.loader.next_step().micro_batches for _ in range(16)]
    times, _, _, gpus = time_steps(trainer.train_step, batches, 4)
    out["step_ms"] = 1e3 * statistics.median(times)
    out["step_gpus"] = gpus
    mbs = [engine.local_tokens(mb) for mb in batches[0]]
    engine.steps.step(mbs, torch.tensor(1.0 / tokens, device="cuda"))  # gradients for the optimizer alone
    out["optimizer_ms"] = statistics.median(event_ms(engine.optimizer.step, 8, 2))
    shapes = linear_shapes(engine.module)
    del trainer, engine, batches, mbs
    torch.cuda.empty_cache()

    gemms, flops = gemm_pass(shapes, tokens)
    attention = attention_pass(args, micro_batch, seq, backend)
    out["gemm_tflop"] = flops / 1e12
    out["gemms_ms"], out["gemms_gpus"] = timed(gemms)
    out["gemm_tflops_per_s"] = flops / (out["gemms_ms"] / 1e3) / 1e12
    out["attention_ms"], _ = timed(attention)
    out["gemms_attention_ms"], out["gemms_attention_gpus"] = timed(lambda: (gemms(), attention()))
    out["copy_bytes_per_s"] = copy_bandwidth()
    rest = rest_bytes(args, tokens, n_params)
    out["rest_bytes"] = rest
    out["rest_floor_ms"] = 1e3 * sum(rest.values()) / out["copy_bytes_per_s"]
    out["floor_ms"] = out["gemms_attention_ms"] + out["optimizer_ms"] + out["rest_floor_ms"]
    out["peak_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def against_peer(out: dict, peer_file: str, bar: float) -> dict:
    """The step ``bar`` times the peer's speed needs (its median step in ``peer_file`` over ``bar``), and what is
    left of it beyond the GEMMs, attention and optimizer measured here, against the rest's floor."""
    with open(peer_file) as fh:
        by = {r["variant"]: r for r in json.load(fh)["results"] if "error" not in r}
    peer_ms = 1e3 * by["hf_compile"]["step_s_median"]
    need = peer_ms / bar
    left = need - out["gemms_attention_ms"] - out["optimizer_ms"]
    return {
        "peer_step_ms": peer_ms,
        "loom_step_ms_in_that_run": 1e3 * by["loom_compile"]["step_s_median"]
        if "loom_compile" in by
        else None,
        "bar": bar,
        "step_needed_ms": need,
        "left_for_the_rest_ms": left,
        "rest_floor_ms": out["rest_floor_ms"],
        "rest_now_ms": out["step_ms"] - out["gemms_attention_ms"] - out["optimizer_ms"],
        "floor_ratio": peer_ms / out["floor_ms"],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--peer", default="", help="a bench.train_1b result with hf_compile, from the same call")
    p.add_argument("--bar", type=float, default=1.3)
    p.add_argument("--out", default="")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/diag/floor_1b.py: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    out = measure(a.micro_batch, a.seq)
    if a.peer:
        out["against_peer"] = against_peer(out, a.peer, a.bar)
    print(json.dumps(out, indent=1), flush=True)
    if a.out:
        from bench.common import command, default_commit, environment, write_result

        write_result(a.out, {"environment": environment(default_commit(), command()), "floor": out})


if __name__ == "__main__":
    main()

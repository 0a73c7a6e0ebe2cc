"""Where bf16 autocast's precision costs time in the 1B one-GPU step (bench.train_1b's loom side, compiled): the
forward + backward with fp32 weights under autocast (as loom and transformers + compile train there), with the
residual stream in bf16 instead of fp32 (the embedding's output cast, as FSDP2's bf16 parameters give it), and with
every weight in bf16 and no autocast (no weight casts, bf16 gradients), each the median of 12 timed passes on the same
micro-batches; and the whole step and the optimizer's alone. Each later variant changes the numerics: it prices the
lever, it is not a way loom trains. docs/benchmarks.md, "One GPU: where the time goes", reads it.

    python -m bench.diag.casts_1b --out bench/results/casts_1b_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile

import torch


def timed(fn, n: int = 12, warm: int = 4) -> float:
    from bench.common import event_ms

    return statistics.median(event_ms(fn, n, warm))


def measure() -> dict:
    from bench.train_1b import loom_trainer

    out = {}
    trainer = loom_trainer(4, {"training.compile": "true"}, tempfile.mkdtemp(), 2048)
    engine = trainer.engine
    mbs = [engine.local_tokens(mb) for mb in trainer.loader.next_step().micro_batches]
    scale = torch.tensor(1.0 / (4 * 2048), device="cuda")
    params = engine.params

    def forward_backward():
        engine.steps.step(mbs, scale)
        for p in params:
            p.grad = None

    out["full_step_ms"] = timed(lambda: trainer.train_step(trainer.loader.next_step().micro_batches))
    out["fwd_bwd_fp32_autocast_ms"] = timed(forward_backward)
    engine.steps.step(mbs, scale)
    out["optimizer_ms"] = timed(lambda: engine.optimizer.step(), n=8, warm=2)
    for p in params:
        p.grad = None
    hook = engine.module.tok_embeddings.register_forward_hook(lambda m, i, o: o.to(torch.bfloat16))
    out["fwd_bwd_fp32_weights_bf16_residual_ms"] = timed(forward_backward)
    hook.remove()
    out["fwd_bwd_fp32_autocast_again_ms"] = timed(forward_backward)
    for p in params:
        p.data = p.data.to(torch.bfloat16)
    engine.steps.ctx.autocast = contextlib.nullcontext
    out["fwd_bwd_bf16_weights_ms"] = timed(forward_backward)
    out["peak_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/diag/casts_1b.py: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    out = measure()
    print(json.dumps(out), flush=True)
    if a.out:
        from bench.common import command, default_commit, environment, write_result

        write_result(a.out, {"environment": environment(default_commit(), command()), "times": out})


if __name__ == "__main__":
    main()

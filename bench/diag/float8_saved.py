"""What one compiled block keeps from its forward to its backward, bf16 against float8, on one GPU: the allocator's
bytes before each block of a few-block model of a flavor's shape (bf16 weights, as FSDP2 gathers them; per-block
torch.compile, no activation checkpointing), at 1 and 2 sequences, beside the planner's traced figure. The
planner's float8 activations (docs/planner.md) rest on it.

    python -m bench.diag.float8_saved --flavor 8B --float8 none,tensorwise,rowwise --out saved.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from bench.common import event_ms


def config(flavor: str, seq: int, float8: str, ac: str = "none"):
    from loom.config import build_config

    return build_config(
        None,
        {
            "model.flavor": flavor,
            "model.vocab_size": "128256",
            "model.tie_embeddings": "false",
            "model.attention": "sdpa",
            "training.seq_len": str(seq),
            "training.micro_batch_size": "1",
            "training.global_batch_size": "1",
            "training.dtype": "bfloat16",
            "training.compile": "true",
            "training.activation_checkpointing": ac,
            "training.float8": float8,
        },
    )


def held_per_block(
    flavor: str,
    seq: int,
    float8: str,
    layers: int,
    batch: int,
    autocast: bool = False,
    ac: str = "none",
    attention: str = "sdpa",
    timed: int = 0,
) -> dict:
    """Allocated bytes each block adds to what the forward holds (median over the blocks after the first), and the
    step's peak above the forward's start, at ``batch`` sequences; ``autocast``: fp32 weights under bf16 autocast,
    as one GPU trains (else bf16 weights, as FSDP2 gathers them); ``ac``: the blocks' activation checkpointing,
    applied as the trainer applies it (before compiling); ``timed``: also the median forward + backward time (ms)
    over that many steps."""
    from loom.kernels.linear_ce import linear_cross_entropy
    from loom.models.common.float8 import apply_float8
    from loom.models.registry import build_model
    from loom.parallel.activation_checkpoint import apply_activation_checkpointing
    from loom.parallel.compile import apply_compile
    from loom.plan.planner import model_args

    torch._dynamo.config.automatic_dynamic_shapes = False  # each batch its own static graph, as a run has
    args = model_args(config(flavor, seq, float8, ac)).with_(n_layers=layers, attention=attention)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = p.data.to(torch.float32 if autocast else torch.bfloat16)
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.02)
    if float8 != "none":
        apply_float8(model, float8)
    apply_activation_checkpointing(model.layers, ac, 2)
    apply_compile(model.layers)
    tokens = torch.randint(0, args.vocab_size, (batch, seq), device="cuda")

    def step(record: list | None) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = forward(record)
        loss.backward()
        model.zero_grad(set_to_none=True)

    def forward(record: list | None) -> torch.Tensor:
        h = model.tok_embeddings(tokens)
        for block in model.layers.values():
            if record is not None:
                torch.cuda.synchronize()
                record.append(torch.cuda.memory_allocated())
            h = block(h, model.rope, None)
        if record is not None:
            torch.cuda.synchronize()
            record.append(torch.cuda.memory_allocated())
        return linear_cross_entropy(model.norm(h), model.output.weight, tokens)

    step(None)  # compiles
    step(None)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    record: list[int] = []
    step(record)
    torch.cuda.synchronize()
    deltas = [b - a for a, b in zip(record[1:-1], record[2:])]
    peak = torch.cuda.max_memory_allocated() - start
    times = event_ms(lambda: step(None), timed)
    return {
        "flavor": flavor,
        "seq": seq,
        "float8": float8,
        "kernels": f"fused_norm={args.fused_norm} fused_rope={args.fused_rope} fused_swiglu={args.fused_swiglu}",
        "autocast": autocast,
        "ac": ac,
        "layers": layers,
        "batch": batch,
        "block_deltas_mib": [d / 2**20 for d in deltas],
        "held_per_block_mib": statistics.median(deltas) / 2**20,
        "step_peak_above_start_mib": peak / 2**20,
        **({"ms": statistics.median(times)} if times else {}),
    }


def planner_figure(flavor: str, seq: int, float8: str, autocast: bool = False, ac: str = "none") -> dict:
    """The planner's eager trace of the same run (bf16 weights as FSDP2 gathers them, or autocast's), before its
    compiled-block terms (``float8_compiled``, ``compiled_under_autocast``)."""
    from loom.plan.planner import model_args, profile_activations, traced_args

    cfg = config(flavor, seq, float8, ac)
    prof = profile_activations(traced_args(model_args(cfg), True), seq, 1, "bfloat16", not autocast, ac)
    return {"layer_per_seq_mib": prof.layer_per_seq / 2**20, "layer_fixed_mib": prof.layer_fixed / 2**20}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--flavor", default="8B")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--float8", default="none,tensorwise")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--autocast", action="store_true", help="fp32 weights under bf16 autocast (one GPU's precision)"
    )
    p.add_argument("--ac", default="none", choices=("none", "op", "full"), help="activation checkpointing")
    p.add_argument("--out", default="")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/diag/float8_saved.py: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    rows = []
    for f8 in a.float8.split(","):
        for batch in (1, 2):
            row = held_per_block(a.flavor, a.seq, f8, a.layers, batch, a.autocast, a.ac)
            rows.append(row)
            print(json.dumps(row), flush=True)
        plan = planner_figure(a.flavor, a.seq, f8, a.autocast, a.ac)
        print(json.dumps({"float8": f8, "planner": plan}), flush=True)
        rows.append({"float8": f8, "planner": plan})
    if a.out:
        from bench.common import command, default_commit, environment, write_result

        write_result(a.out, {"environment": environment(default_commit(), command()), "rows": rows})


if __name__ == "__main__":
    main()

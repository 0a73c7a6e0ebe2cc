"""Where one attention forward+backward's time goes at the end-to-end shapes, per backend:

- ``wall_ms``: back-to-back calls timed by CUDA events (how ``model.attention = auto`` timed the candidates
  until it timed the GPU alone); when the CPU issues a call more slowly than the GPU runs it, this is CPU time;
- ``gpu_ms``: the same calls queued behind a GPU sleep long enough that the CPU has issued all of them before the
  GPU reaches the first (``cpu_ahead`` says whether it had), so only the GPU's execution is timed (what ``auto``
  times now: ``loom.kernels.select.time_fwd_bwd``);
- ``cpu_issue_ms``: the CPU time to issue one call.

In a training step the CPU usually runs ahead of the GPU (other layers' matmuls queue up), so ``gpu_ms`` is what
a call costs there; where ``wall_ms`` is much larger, back-to-back timing measures the launch path rather than
the kernels. Backends: SDPA (PyTorch's choice, as the model calls it), loom's kernel (``flash``), and on Hopper
loom's kernel with the Triton forward in place of the Gluon one (``flash_triton_fwd``).

    python bench/attention_overhead.py --out bench/results/attention_overhead_h100.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.train_1b import environment  # noqa: E402

# (batch, query heads, kv heads, seq, head dim): the 1B flavor's attention at micro batch 4 and 16 (seq 2048), the
# 8B flavor's at seq 8192, micro batch 1 and 2
SHAPES = [(4, 32, 8, 2048, 64), (16, 32, 8, 2048, 64), (1, 32, 8, 8192, 128), (2, 32, 8, 8192, 128)]
ITERS = 20


def back_to_back_ms(step, iters: int = ITERS) -> float:
    """ms per call of ``step`` issued back to back, timed by CUDA events (how ``auto`` timed the candidates
    until it timed the GPU alone)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def backends() -> dict:
    """name -> fn(q, k, v) of each backend, and the names needing the Triton forward patched in."""
    from loom.models.common.layers import attend

    fns = {name: (lambda q, k, v, name=name: attend(q, k, v, name, None)) for name in ("sdpa", "flash")}
    if torch.cuda.get_device_capability() == (9, 0):
        fns["flash_triton_fwd"] = fns["flash"]
    return fns


def triton_forward_instead():
    """Swap the Gluon forward for the Triton one (loom.kernels.attention.triton dispatches to ``hopper.forward``);
    returns the undo."""
    from loom.kernels.attention import hopper
    from loom.kernels.attention import triton as T

    gluon = hopper.forward

    def forward(q, k, v, out, lse, causal, bounds, scale, seq_key):
        T.triton_forward(q, k, v, out, lse, causal, bounds, 0, scale)
    hopper.forward = forward
    return lambda: setattr(hopper, "forward", gluon)


def measure_shape(shape: tuple) -> dict:
    from loom.kernels.select import AttentionShape, attention_inputs, fwd_bwd_step, queued_timing

    b, hq, hkv, s, d = shape
    inputs = attention_inputs(AttentionShape(b, hq, hkv, s, d, torch.bfloat16), torch.device("cuda"))
    row = {"batch": b, "heads": hq, "kv_heads": hkv, "seq": s, "head_dim": d, "backends": {}}
    for name, fn in backends().items():
        undo = triton_forward_instead() if name == "flash_triton_fwd" else (lambda: None)
        try:
            step = fwd_bwd_step(fn, inputs)
            for _ in range(5):
                step()
            wall = min(back_to_back_ms(step) for _ in range(2))
            queued = min((queued_timing(step, ITERS, 2 * ITERS * wall) for _ in range(2)), key=lambda r: r.gpu_ms)
            row["backends"][name] = {"wall_ms": wall, **dataclasses.asdict(queued)}
        finally:
            undo()
        for t in inputs:
            t.grad = None
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="", help="'b,hq,hkv,seq,d;...' instead of SHAPES")
    p.add_argument("--out", default="")
    p.add_argument("--commit", default=os.environ.get("LOOM_COMMIT", "unknown"))
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    shapes = [tuple(int(v) for v in item.split(",")) for item in a.shapes.split(";") if item] or SHAPES
    result = {"env": environment(a.commit, "python " + " ".join(sys.argv)), "iters": ITERS,
              "rows": []}
    for shape in shapes:
        row = measure_shape(shape)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        if a.out:  # after every shape: a run cut short keeps what it measured
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

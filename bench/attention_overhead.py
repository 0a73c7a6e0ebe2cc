"""Where one attention forward+backward's time goes at the end-to-end shapes, per backend:

- ``wall_ms``: back-to-back calls timed by CUDA events, as ``model.attention = auto`` times the candidates at
  start-up (``loom.kernels.select.time_fwd_bwd``); when the CPU issues a call more slowly than the GPU runs it,
  this is CPU time;
- ``gpu_ms``: the same calls queued behind a GPU sleep long enough that the CPU has issued all of them before the
  GPU reaches the first (``cpu_ahead`` says whether it had), so only the GPU's execution is timed;
- ``cpu_issue_ms``: the CPU time to issue one call.

In a training step the CPU usually runs ahead of the GPU (other layers' matmuls queue up), so ``gpu_ms`` is what
a call costs there; where ``wall_ms`` is much larger, ``auto``'s start-up timing measures the launch path rather
than the kernels. Backends: SDPA (cuDNN first, as the model calls it), loom's kernel (``flash``), and on Hopper
loom's kernel with the Triton forward in place of the Gluon one (``flash_triton_fwd``).

    python bench/attention_overhead.py --out bench/results/attention_overhead_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.train_1b import environment  # noqa: E402

# (batch, query heads, kv heads, seq, head dim): the 1B flavor's attention at micro batch 4 and 16 (seq 2048), the
# 8B flavor's at seq 8192, micro batch 1 and 2
SHAPES = [(4, 32, 8, 2048, 64), (16, 32, 8, 2048, 64), (1, 32, 8, 8192, 128), (2, 32, 8, 8192, 128)]
ITERS = 20


def sleep_cycles_per_ms() -> float:
    """GPU cycles of ``torch.cuda._sleep`` per millisecond on this device (one calibration)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    torch.cuda.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def stepper(fn, inputs: list[torch.Tensor]):
    """One forward + backward of ``fn(*inputs)``, gradients reset first (as ``time_fwd_bwd`` runs them)."""
    grad = torch.ones_like(fn(*inputs))

    def step():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(grad)
    return step


def queued_ms(step, wall_ms: float, cycles_per_ms: float) -> dict:
    """GPU ms per call of ``step`` issued behind a sleep of twice the calls' wall time, the CPU ms to issue one,
    and whether the CPU had issued them all before the GPU woke."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2 * ITERS * wall_ms * cycles_per_ms) + 1000)
    start.record()
    t0 = time.perf_counter()
    for _ in range(ITERS):
        step()
    issue_ms = (time.perf_counter() - t0) * 1e3 / ITERS
    ahead = not start.query()  # the start event still pending: the GPU had not reached the first call yet
    end.record()
    torch.cuda.synchronize()
    return {"gpu_ms": start.elapsed_time(end) / ITERS, "cpu_issue_ms": issue_ms, "cpu_ahead": ahead}


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


def measure_shape(shape: tuple, cycles_per_ms: float) -> dict:
    from loom.kernels.select import AttentionShape, attention_inputs, time_fwd_bwd

    b, hq, hkv, s, d = shape
    inputs = attention_inputs(AttentionShape(b, hq, hkv, s, d, torch.bfloat16), torch.device("cuda"))
    row = {"batch": b, "heads": hq, "kv_heads": hkv, "seq": s, "head_dim": d, "backends": {}}
    for name, fn in backends().items():
        undo = triton_forward_instead() if name == "flash_triton_fwd" else (lambda: None)
        try:
            wall = min(time_fwd_bwd(fn, inputs, warmup=5, iters=ITERS) for _ in range(2))
            step = stepper(fn, inputs)
            queued = min((queued_ms(step, wall, cycles_per_ms) for _ in range(2)), key=lambda r: r["gpu_ms"])
            row["backends"][name] = {"wall_ms": wall, **queued}
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
    cycles = sleep_cycles_per_ms()
    result = {"env": environment(a.commit, "python " + " ".join(sys.argv)), "iters": ITERS,
              "sleep_cycles_per_ms": cycles, "rows": []}
    for shape in shapes:
        row = measure_shape(shape, cycles)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        if a.out:  # after every shape: a run cut short keeps what it measured
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""Registers, spills and shared memory of loom's attention kernels compiled for Hopper (sm_90a) without a
GPU: Triton compiles ahead of time for a named target and its bundled cuobjdump reads the cubin.

    pip install --target /tmp/t36 triton==3.6.0      # the GPU image's Triton
    PYTHONPATH=/tmp/t36:. python bench/registers.py --kind dkdv --head-dim 128 [--dump DIR]

Integer arguments are specialized as on the GPU (divisible by 16; GROUP as a constant, as Triton does
for a value of 1), so the figures match what the GPU's autotuner compiles (checked against `bench/kernels.py
--configs` on the H100: 255 registers and no spills for the chosen d128 dK/dV config).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loom.kernels.attention import triton as attn  # noqa: E402

POINTERS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "LSE", "LSE2", "DELTA", "DLSE", "BOUNDS", "KBOUNDS"}
FLOAT32_POINTERS = {"LSE", "LSE2", "DELTA", "DLSE"}
KERNELS = {"fwd": (attn._attn_fwd, attn._FWD_CONFIGS), "dkdv": (attn._attn_bwd_dkdv, attn._DKDV_CONFIGS),
           "dq": (attn._attn_bwd_dq, attn._DQ_CONFIGS)}


def signature(fn, constants: dict, dtype: str) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = "*fp32" if name in FLOAT32_POINTERS else ("*i32" if name in ("BOUNDS", "KBOUNDS") else f"*{dtype}")
        elif name in ("qk_scale", "sm_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_for_hopper(fn, constants: dict, warps: int, stages: int, dtype: str = "bf16", maxnreg: int | None = None):
    sig = signature(fn, constants, dtype)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] not in ("constexpr", "fp32") and n not in ("H", "B")}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, attrs=attrs,
                                    constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages, "maxnreg": maxnreg})


def resources(kernel, workdir: str) -> dict:
    path = os.path.join(workdir, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", out)
    if not m:
        return {"raw": out}
    regs, smem, threads = int(m.group(1)), kernel.metadata.shared, kernel.metadata.num_warps * 32
    # Hopper SM: 64K registers (allocated per warp in units of 256), 228 KiB shared memory (1 KiB per block reserved)
    by_regs = 65536 // (((regs * 32 + 255) // 256) * 256 * (threads // 32))
    by_smem = (228 * 1024) // (smem + 1024)
    return {"registers": regs, "stack_bytes": int(m.group(2)), "shared_bytes": smem,
            "blocks_per_sm": min(by_regs, by_smem)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", choices=sorted(KERNELS), default="dkdv")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=1)
    p.add_argument("--docs", action="store_true")
    p.add_argument("--full", action="store_true", help="no causal mask")
    p.add_argument("--dump", default="", help="write each config's TTGIR and PTX here")
    p.add_argument("--configs", default="", help="'M,N,warps,stages[,maxnreg];...' instead of the kernel's candidates")
    a = p.parse_args()
    fn, configs = KERNELS[a.kind]
    workdir = a.dump or "/tmp"
    os.makedirs(workdir, exist_ok=True)
    base = dict(GROUP=a.group, CAUSAL=not a.full, HAS_DOCS=a.docs, WINDOW=0, HEAD_DIM=a.head_dim)
    if a.configs:
        configs = [tuple(int(x) for x in c.split(",")) for c in a.configs.split(";")]
    for m, n, w, s, *reg in configs:
        kernel = compile_for_hopper(fn, dict(base, BLOCK_M=m, BLOCK_N=n), w, s, maxnreg=reg[0] if reg else None)
        if a.dump:
            for ext in ("ttgir", "ptx"):
                with open(os.path.join(a.dump, f"{a.kind}_{m}_{n}_{w}_{s}.{ext}"), "w") as f:
                    f.write(kernel.asm[ext])
        cap = f" maxnreg {reg[0]}" if reg else ""
        print(f"{a.kind} BLOCK_M {m} BLOCK_N {n} warps {w} stages {s}{cap}: {resources(kernel, workdir)}", flush=True)


if __name__ == "__main__":
    main()

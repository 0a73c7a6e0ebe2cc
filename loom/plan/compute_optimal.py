"""Compute-optimal model size and tokens (Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models"):
training takes C ≈ 6·N·D FLOPs for N parameters and D tokens, and the loss-optimal split of a budget is about
20 tokens per parameter, D ≈ 20·N. So N = sqrt(C / 120) and D = 20·N; any one of C, N, D gives the other two.
The nearest loom flavor and, on a cluster, the GPU-hours from the planner's throughput follow."""

from __future__ import annotations

import math
from dataclasses import dataclass

from loom.config.errors import ConfigError

FLOPS_PER_PARAM_TOKEN = 6.0  # forward 2, backward 4 multiply-adds per parameter per token
TOKENS_PER_PARAM = 20.0  # Chinchilla's compute-optimal ratio
SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


@dataclass(frozen=True)
class Budget:
    flops: float
    params: float
    tokens: float


def compute_optimal(
    flops: float | None = None, params: float | None = None, tokens: float | None = None
) -> Budget:
    """The compute-optimal budget from exactly one of FLOPs, parameters or tokens (the others None)."""
    given = {
        k: v for k, v in (("--flops", flops), ("--params", params), ("--tokens", tokens)) if v is not None
    }
    if len(given) != 1:
        raise ConfigError(
            " / ".join(given) or "--flops",
            None,
            "give exactly one of --flops, --params, --tokens",
            show_value=False,
        )
    ((flag, value),) = given.items()
    if not value > 0 or not math.isfinite(value):
        raise ConfigError(flag, value, "expected a positive number")
    if flops is not None:
        params = math.sqrt(flops / (FLOPS_PER_PARAM_TOKEN * TOKENS_PER_PARAM))
    elif tokens is not None:
        params = tokens / TOKENS_PER_PARAM
    tokens = TOKENS_PER_PARAM * params
    return Budget(FLOPS_PER_PARAM_TOKEN * params * tokens, params, tokens)


def parse_count(flag: str, text: str) -> float:
    """A positive count from '5.76e23', '70B', '1.4T' (K, M, B or G, T suffixes)."""
    raw = text.strip()
    scale = SUFFIXES.get(raw[-1:].upper(), 1.0) if raw else 1.0
    try:
        value = float(raw[:-1] if scale != 1.0 else raw) * scale
    except ValueError:
        raise ConfigError(flag, text, "expected a positive number, e.g. 5.76e23, 70B or 1.4T") from None
    if not value > 0 or not math.isfinite(value):
        raise ConfigError(flag, text, "expected a positive number, e.g. 5.76e23, 70B or 1.4T")
    return value


def dense_flavors(vocab_size: int) -> dict[str, int]:
    """Parameter counts of loom's dense Llama flavors (not the debug ones, nor MoE: Chinchilla's N is dense);
    ``vocab_size`` for the flavors whose vocabulary is the tokenizer's."""
    import torch

    from loom.models.llama.flavors import FLAVORS
    from loom.models.registry import build_model

    out = {}
    for name, args in FLAVORS.items():
        if name.startswith("debug") or args.moe_experts:
            continue
        with torch.device("meta"):
            model = build_model(args if args.vocab_size else args.with_(vocab_size=vocab_size))
        out[name] = sum(p.numel() for p in model.parameters())
    return out


def nearest_flavor(params: float, flavors: dict[str, int]) -> tuple[str, int]:
    """The flavor whose parameter count is nearest ``params`` by ratio (the size that matters is relative)."""
    name = min(flavors, key=lambda n: abs(math.log(flavors[n] / params)))
    return name, flavors[name]


def recommended_batch(noise_scale: float, seq_len: int) -> int:
    """Sequences per step for a measured noise scale in tokens: McCandlish et al. 2018's critical batch is about
    the noise scale (B_simple estimates it): smaller batches take more steps, larger ones more tokens."""
    return max(1, round(noise_scale / seq_len))


def gpu_hours(tokens: float, tokens_per_s_per_gpu: float) -> float:
    """GPU-hours to train on ``tokens`` at the planner's throughput per GPU."""
    return tokens / tokens_per_s_per_gpu / 3600.0


def si(x: float) -> str:
    """1.4T, 69.3B, 125.1M: three significant digits with a suffix."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"

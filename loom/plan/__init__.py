"""The planner: memory, step time and fit of a training run, and memory and time per token of generation, before a
GPU is rented. ``from loom.plan import decode_time_per_token`` (loom.plan.generate) is loaded on first use, so that
importing a light module of the package (hardware) does not import the model code."""

_GENERATE = ("decode_time_per_token", "decode_step", "kv_cache_bytes", "plan_generation")


def __getattr__(name: str):
    if name in _GENERATE:
        from loom.plan import generate

        return getattr(generate, name)
    raise AttributeError(f"module 'loom.plan' has no attribute {name!r}")

"""The rules of LoRA and QLoRA (``lora.rank`` > 0, loom.models.common.lora), handed to the resolver (loom.resolve);
apart from loom.models.common.lora so that checking a config imports no torch."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.rules import RuleSet
from loom.config.sections import Config


def check_lora(cfg: Config) -> None:
    """LoRA / QLoRA (docs/lora.md) against the fields it does not combine with."""
    from loom.models.common.lora import parse_targets  # (imports torch: only when LoRA is on)

    lora, p = cfg.lora, cfg.parallel
    if not lora.rank:
        for key, value, off in (
            ("init_from", lora.init_from, ""),
            ("base_dtype", lora.base_dtype, "float32"),
        ):
            if value != off:
                raise ConfigError(f"lora.{key}", value, "needs lora.rank > 0 (LoRA is off)")
        return
    targets = parse_targets(lora.targets)
    if cfg.training.float8 != "none":
        raise ConfigError(
            "training.float8",
            cfg.training.float8,
            "not with LoRA (float8 would replace the adapted linears): allowed none with lora.rank > 0",
        )
    ffn = [t for t in targets if t in ("gate", "up", "down")]
    if ffn and (cfg.model.moe_experts or cfg.model.flavor == "debug_moe"):
        raise ConfigError(
            "lora.targets",
            lora.targets,
            f"{', '.join(ffn)}: a mixture-of-experts model has no dense "
            "feed-forward linears; allowed q, k, v, o",
        )
    if lora.base_dtype == "bfloat16" and cfg.training.dtype != "bfloat16":
        raise ConfigError(
            "lora.base_dtype",
            "bfloat16",
            f"needs training.dtype bfloat16 (it is {cfg.training.dtype}: "
            "bf16 frozen weights would make the activations bf16): allowed float32 or nf4",
        )
    if lora.base_dtype == "nf4":
        for key, value, bad in (
            ("parallel.tp", p.tp, p.tp > 1),
            ("parallel.cpu_offload", p.cpu_offload, p.cpu_offload),
        ):
            if bad:
                raise ConfigError(
                    key, value, "not with lora.base_dtype nf4 (the NF4 base shards by rows under FSDP only)"
                )


RULES = RuleSet("LoRA", config=check_lora)

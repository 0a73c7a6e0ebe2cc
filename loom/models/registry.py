"""The model families loom builds, each registered once (``FAMILIES``): its args type, flavors, how to build it,
its Hugging Face adapter, parallelize plan and FLOPs per token. Everything that builds a model or names a flavor
goes through here, so a new family is one folder plus one line in ``FAMILIES`` (or one ``register`` call)."""

from __future__ import annotations

from torch import nn

from loom.models.deepseek_v3 import SPEC as DEEPSEEK_V3
from loom.models.deepseek_v3 import SPEC_V2 as DEEPSEEK_V2
from loom.models.llama import FLAVORS as LLAMA_FLAVORS
from loom.models.llama import Llama, LlamaArgs
from loom.models.llama.hf import LlamaHF, causal_architecture
from loom.models.qwen3_moe import SPEC as QWEN3_MOE
from loom.models.spec import ModelSpec

# one line per family
FAMILIES: list[ModelSpec] = [
    ModelSpec("llama", LlamaArgs, Llama, dict(LLAMA_FLAVORS), LlamaHF()),
    QWEN3_MOE,
    DEEPSEEK_V3,
    DEEPSEEK_V2,  # DeepSeek-V3's folder, DeepSeek-V2's Hugging Face layout
]


def register(spec: ModelSpec) -> None:
    """Add a family at run time (a test's toy family); its flavor names must be new."""
    clash = set(all_flavors()) & set(spec.flavors)
    if any(s.name == spec.name for s in FAMILIES) or clash:
        raise ValueError(f"model family {spec.name!r} or its flavors {sorted(clash)} are registered already")
    FAMILIES.append(spec)


def unregister(name: str) -> None:
    """Remove a family added by ``register``."""
    FAMILIES[:] = [s for s in FAMILIES if s.name != name]


def all_flavors() -> dict[str, LlamaArgs]:
    """Every family's flavors by name."""
    out: dict[str, LlamaArgs] = {}
    for spec in FAMILIES:
        clash = set(out) & set(spec.flavors)
        assert not clash, f"flavor names {sorted(clash)} in two families"
        out.update(spec.flavors)
    return out


def spec_of(args: LlamaArgs) -> ModelSpec:
    """The family of a model's args (the most derived registered args type)."""
    for klass in type(args).__mro__:
        for spec in FAMILIES:
            if spec.args_type is klass:
                return spec
    raise KeyError(f"no model family for {type(args).__name__}")


def build_model(args: LlamaArgs) -> nn.Module:
    """The plain model of ``args``' family (on the current default device: meta for a sharded build)."""
    return spec_of(args).build(args)


def hf_adapter(args: LlamaArgs) -> LlamaHF:
    return spec_of(args).hf


def hf_architectures() -> dict[str, str]:
    """Every Hugging Face architecture some family reads and writes -> that family's name (the Llama families'
    names first; one source for `loom convert --help` and the docs)."""
    from loom.models.llama.hf import ARCHITECTURES

    out = dict(ARCHITECTURES)
    for spec in FAMILIES:
        arch = getattr(spec.hf, "architecture", "")
        if arch and arch not in out:
            out[arch] = spec.name
    return out


def spec_for_hf(cfg: dict) -> ModelSpec:
    """The family whose adapter claims a parsed config.json (its architecture or model_type); the Llama families'
    claim the rest (and name an architecture none of them holds)."""
    archs = [causal_architecture(a) for a in cfg.get("architectures") or []]
    for spec in sorted(
        FAMILIES, key=lambda s: s.hf.fallback
    ):  # stable: registration order, the fallback last
        if spec.hf.claims(cfg, archs):
            return spec
    raise AssertionError("the Llama families' adapter claims every config")

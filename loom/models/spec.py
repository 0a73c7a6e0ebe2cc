"""What a model family registers (loom.models.registry): a ``ModelSpec`` and, where its Hugging Face layout is not
the Llama families', an ``HFAdapter``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from loom.models.llama import LlamaArgs


class HFAdapter:
    """A family's Hugging Face names and config beyond the Llama families' (loom.checkpoint.hf keeps those):
    ``architecture`` / ``model_type`` of its config.json, per-block leaf names that differ (``layer_names``), the
    per-expert name templates of stacked expert weights (``expert_names``, ``{j}`` = expert)."""

    architecture = ""
    model_type = ""
    layer_names: dict[str, str] = {}
    expert_names: dict[str, str] = {}

    def claims(self, cfg: dict, archs: list[str]) -> bool:
        """Whether this family reads a parsed config.json (``archs``: its causal-LM architectures)."""
        return self.architecture in archs or (not archs and cfg.get("model_type") == self.model_type)

    def args(self, cfg: dict, base: LlamaArgs, field: str, where: str) -> LlamaArgs:
        """The family's args from a parsed config.json, ``base`` holding what every family's config gives."""
        raise NotImplementedError

    def config(self, args: LlamaArgs) -> dict:
        """config.json keys beyond (or replacing) the common ones."""
        raise NotImplementedError

    def fit(self, args: LlamaArgs, holds: Callable[[str], bool]) -> LlamaArgs:
        """``args`` as a folder holds them: ``holds(loom_name)`` whether it stores that tensor (a config may
        promise optional modules its weights lack: transformers saves DeepSeek's MTP count without the layer)."""
        return args

    def hf_name(self, name: str) -> str | None:
        """The Hugging Face name of a loom tensor that is not a block's (None: none)."""
        return None

    def derived(self, tensors: dict, args: LlamaArgs) -> dict:
        """Tensors an export writes besides the model's own (copies the published layout repeats)."""
        return {}

    def ignored(self, name: str, args: LlamaArgs) -> bool:
        """Stored tensors an import skips (derived copies)."""
        return False


@dataclass(frozen=True)
class ModelSpec:
    """One family: ``args_type`` (a LlamaArgs subclass: the fields every layer of loom reads), ``build`` (args ->
    plain single-device module), ``flavors`` (named shapes, unique across families), ``hf`` (None: the Llama
    families' own mapping in loom.checkpoint.hf)."""

    name: str
    args_type: type
    build: Callable[[LlamaArgs], nn.Module]
    flavors: dict[str, LlamaArgs] = field(default_factory=dict)
    hf: HFAdapter | None = None

    def flops_per_token(self, args: LlamaArgs, seq_len: int, adapter_params: int | None = None) -> float:
        from loom.metrics.flops import flops_per_token

        return flops_per_token(args, seq_len, adapter_params)

"""What a model family registers (loom.models.registry): a ``ModelSpec`` and its Hugging Face adapter, the Llama
families' (``loom.models.llama.hf.LlamaHF``) or a Llama-like family's own (``HFAdapter``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from loom.config.errors import ConfigError
from loom.models.llama.flavors import LlamaArgs
from loom.models.llama.hf import CONFIG, LlamaHF, common_args


class HFAdapter(LlamaHF):
    """A Llama-like family's Hugging Face names and config beyond the Llama families': ``architecture`` /
    ``model_type`` of its config.json, per-block leaf names that differ (``layer_names``), the per-expert name
    templates of stacked expert weights (``expert_names``, ``{j}`` = expert)."""

    architecture = ""
    model_type = ""
    fallback = False
    optional_modules = True

    def claims(self, cfg: dict, archs: list[str]) -> bool:
        """Whether this family reads a parsed config.json (``archs``: its causal-LM architectures)."""
        return self.architecture in archs or (not archs and cfg.get("model_type") == self.model_type)

    def from_config(self, cfg: dict, field: str, where: str) -> LlamaArgs:
        try:
            args = self.args(cfg, common_args(cfg, field, where), field, where)
        except KeyError as err:
            raise ConfigError(field, where, f"{CONFIG} lacks {err.args[0]!r}") from None
        if args.n_kv_heads != args.n_heads and args.n_heads % args.n_kv_heads:
            raise ConfigError(
                field,
                where,
                f"num_key_value_heads = {args.n_kv_heads} does not divide "
                f"num_attention_heads = {args.n_heads}",
            )
        return args

    def args(self, cfg: dict, base: LlamaArgs, field: str, where: str) -> LlamaArgs:
        """The family's args from a parsed config.json, ``base`` holding what every family's config gives."""
        raise NotImplementedError

    def config(self, args: LlamaArgs) -> dict:
        raise NotImplementedError

    def architecture_of(self, args: LlamaArgs) -> str:
        return self.architecture

    def model_type_of(self, args: LlamaArgs) -> str:
        return self.model_type

    def shape_config(self, args: LlamaArgs) -> dict:
        return {}

    def window_config(self, args: LlamaArgs) -> dict:
        return {}

    def imported_config(self, cfg: dict, args: LlamaArgs) -> dict | None:
        """The family's keys as the import holds them (optional modules its weights lack dropped: ``fit``)."""
        return {**cfg, **self.config(args)}

    def state_names(self, args: LlamaArgs) -> None:
        """None: the model's own state names (persistent buffers included) in its order."""
        return None


@dataclass(frozen=True)
class ModelSpec:
    """One family: ``args_type`` (a LlamaArgs subclass: the fields every layer of loom reads), ``build`` (args ->
    plain single-device module), ``flavors`` (named shapes, unique across families), ``hf`` (its Hugging Face
    adapter), ``parallelize`` (parallelize_llama's signature; None: loom.parallel.parallelize.parallelize_llama,
    the composition order every Llama-like family shares)."""

    name: str
    args_type: type
    build: Callable[[LlamaArgs], nn.Module]
    flavors: dict[str, LlamaArgs] = field(default_factory=dict)
    hf: LlamaHF = field(default_factory=LlamaHF)
    parallelize: Callable | None = None

    def flops_per_token(self, args: LlamaArgs, seq_len: int, adapter_params: int | None = None) -> float:
        from loom.metrics.flops import flops_per_token

        return flops_per_token(args, seq_len, adapter_params)

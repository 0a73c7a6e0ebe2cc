"""The toy family's Hugging Face layout: Llama's names (no post-attention norm) under its own architecture."""

from __future__ import annotations

from loom.models.llama import LlamaArgs
from loom.models.spec import HFAdapter
from tests.unit.toy_family.model import ToyArgs


class ToyHF(HFAdapter):
    architecture = "ToyForCausalLM"
    model_type = "toy"
    layer_names = {"attention_norm.weight": "ln.weight"}  # one norm per block, named its own way

    def args(self, cfg: dict, base: LlamaArgs, field: str, where: str) -> ToyArgs:
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        return ToyArgs(
            **{
                **fields,
                "n_kv_heads": int(cfg["num_key_value_heads"]),
                "parallel_residual": bool(cfg.get("parallel_residual", True)),
            }
        )

    def config(self, args: ToyArgs) -> dict:
        return {"parallel_residual": args.parallel_residual}

"""DeepSeek-V3 (and V2 / V2-Lite / Moonlight-style shapes): multi-head latent attention (loom.models.common.mla) in
every block; DeepSeekMoE (shared experts plus routed ones, sigmoid or softmax scores, group-limited top-k, the
weights renormalized and scaled by ``routed_scaling_factor``, a per-expert selection bias for aux-loss-free
balancing) in every block after the first ``first_k_dense`` dense ones; optional multi-token prediction
(``model.MTP``). Hugging Face adapter: ``hf.DeepSeekV3HF`` (``DeepseekV3ForCausalLM``)."""

from loom.models.deepseek_v3.args import FLAVORS, DeepSeekV2Args, DeepSeekV3Args
from loom.models.deepseek_v3.hf import DeepSeekV2HF, DeepSeekV3HF
from loom.models.deepseek_v3.model import MTP, DeepSeekV3
from loom.models.spec import ModelSpec

SPEC = ModelSpec("deepseek_v3", DeepSeekV3Args, DeepSeekV3, FLAVORS, DeepSeekV3HF())
# DeepSeek-V2's Hugging Face layout: the same model and folder, its own architecture (no flavors of its own)
SPEC_V2 = ModelSpec("deepseek_v2", DeepSeekV2Args, DeepSeekV3, {}, DeepSeekV2HF())

__all__ = ["FLAVORS", "MTP", "SPEC", "SPEC_V2", "DeepSeekV2Args", "DeepSeekV3", "DeepSeekV3Args"]

"""Fused linear + cross-entropy: the summed token loss of ``h @ weight.T`` without the full logits."""

from loom.kernels.linear_ce.op import linear_cross_entropy
from loom.kernels.linear_ce.reference import default_chunk_tokens, linear_cross_entropy_unfused

__all__ = ["default_chunk_tokens", "linear_cross_entropy", "linear_cross_entropy_unfused"]

"""LoRA-adapted frozen linears of one input, y_i = x W_i^T + s (x A_i^T) B_i^T, as one op (``op.lora_linear``)."""

from loom.kernels.lora.op import lora_linear

__all__ = ["lora_linear"]

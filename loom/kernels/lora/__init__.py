"""A LoRA-adapted frozen linear, y = x W^T + s (x A^T) B^T, as one op (``op.lora_linear``)."""

from loom.kernels.lora.op import lora_linear

__all__ = ["lora_linear"]

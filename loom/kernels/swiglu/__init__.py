"""Fused SwiGLU gate: silu(a) * b forward, both input gradients in one pass backward."""

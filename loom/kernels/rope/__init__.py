"""Fused rotary position embedding (rotate-half convention), optional per-token positions."""

"""Fused RMSNorm: one pass over each row forward; dx and dweight in one pass backward."""

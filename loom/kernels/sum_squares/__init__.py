"""The sum of squares of many tensors (a gradient norm's local part): ``loom::sum_squares``."""

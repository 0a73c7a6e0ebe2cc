"""Kernels, one folder per op, each in the same four layers:

- ``reference.py``: pure PyTorch; the definition tests compare against, and what CPU runs execute;
- ``triton.py``: the Triton kernel(s) and a launcher that checks shapes, dtypes and devices;
- ``op.py``: a ``torch.library`` custom op (CUDA -> Triton launcher, CPU -> reference) with a fake
  implementation, so ``torch.compile`` traces it, and its autograd formula; the public function;
- ``dispatch.py`` (here): which backend a model uses on which device, ``auto`` resolved from measurements.

Triton is imported lazily (``loom.kernels.triton_support``): a CPU-only install never needs it.
"""

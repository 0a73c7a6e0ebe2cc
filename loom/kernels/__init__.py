"""Kernels, one folder per op, each in the same layers:

- ``reference.py``: pure PyTorch; the model's unfused path, what CPU runs execute, and the definition the
  kernels are tested against;
- ``triton.py``: the Triton kernel(s) and a launcher that checks shapes, dtypes and devices (attention also has
  Gluon kernels for Hopper, ``attention/hopper/``);
- ``op.py``: a ``torch.library`` custom op with a fake implementation, so ``torch.compile`` traces it, and its
  autograd formula; the public function;
- ``dispatch.py`` (here): every backend choice: which backend a model uses on which device (``auto`` resolved,
  attention timed at start-up), and which kernels run an attention call.

Triton is imported lazily (``loom.kernels.triton_support``): a CPU-only install never needs it.
"""

"""Whether Triton kernels can run: Triton importable and a CUDA device, or Triton's CPU interpreter; whether
its Gluon Hopper language is there."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def has_gluon_hopper() -> bool:
    """Whether this Triton has the Gluon language and the Hopper (sm_90) primitives loom's Gluon kernels use."""
    try:
        importlib.import_module("triton.experimental.gluon")
        hopper = importlib.import_module("triton.experimental.gluon.language.nvidia.hopper")
    except ImportError:
        return False
    return all(
        hasattr(hopper, name)
        for name in ("fence_async_shared", "mbarrier", "tma", "warpgroup_mma", "warpgroup_mma_wait")
    )


def interpreting() -> bool:
    """TRITON_INTERPRET=1 runs kernels on CPU tensors (slow; exact for small fp32 cases only)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(device: torch.device) -> bool:
    if not has_triton():
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def check_tensor(name: str, t: torch.Tensor, *, dtypes=None, ndim: int | None = None, device=None) -> None:
    """Launcher argument check: a ValueError naming the argument, what it is and what is allowed."""
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype} not supported (allowed: {', '.join(map(str, dtypes))})")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device}")
    if is_traceable_wrapper_subclass(t):
        raise ValueError(
            f"{name}: a {type(t).__name__}, a tensor subclass with no storage of its own (a kernel reads raw "
            "addresses, its own is 0): pass its inner tensor"
        )

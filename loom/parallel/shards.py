"""The arithmetic of a sharded parameter (a DTensor): a full value into this rank's shard, the number of shards, the
plain tensor holding this rank's values, and QLoRA's NF4 quantization of a sharded base. The models stay plain: their
init draws full values and hands them to ``keep_shard``."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from loom.config.errors import ConfigError, require
from loom.models.common.lora import NF4_BLOCK, NF4_SCALER_BLOCK, check_nf4_shape, is_nf4, lora_modules


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding this rank's values: a DTensor's local shard (a view: writes reach the parameter),
    and inside it the storage a weight wrapper holds (torchao's float8 all-gather wraps each linear weight in a
    subclass with no address of its own, which kernels and pointer comparisons cannot use); any other tensor as it
    is (a quantized one, NF4, keeps its own layout)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    if is_traceable_wrapper_subclass(t):
        # torchao's float8 weight holds it as ``_tensor``; its ``__tensor_flatten__`` tests the truth of its scale,
        # a device sync per call (one per float8 weight in every optimizer step, which stalled the host for the
        # whole backward: docs/benchmarks.md)
        inner = t.__dict__.get("_tensor")
        inner = inner if isinstance(inner, torch.Tensor) else getattr(t, t.__tensor_flatten__()[0][0])
        if inner.shape == t.shape and inner.dtype == t.dtype and not is_traceable_wrapper_subclass(inner):
            return inner
    return t


def keep_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full value into ``param``, or into this rank's shard of a DTensor ``param``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param = param.to_local()
    param.copy_(full)


def shard_count(w: torch.Tensor) -> int:
    """Into how many shards a DTensor's placements split it (1 for a plain tensor)."""
    if not hasattr(w, "placements"):
        return 1
    return math.prod(w.device_mesh.size(i) for i, p in enumerate(w.placements) if p.is_shard())


@torch.no_grad()
def quantize_base(model: nn.Module) -> int:
    """QLoRA: store every adapted linear's frozen base weight as torchao's NF4 (4-bit NormalFloat, 64 weights per
    scale, the scales double-quantized 256 at a time) of its bfloat16 value; returns how many. Call once the base
    holds its final values (init / model.init_from loaded) and before the first forward.

    Under FSDP2 the whole weight is gathered and quantized, then each rank keeps its rows: the scales' mean is
    the whole tensor's on every rank, so FSDP2's all-gather of the NF4 shards (torchao's FSDP extension) rebuilds
    exactly the single-process NF4 weight. FSDP2 picks the new parameter up at its lazy init (it allows parameters
    swapped after fully_shard); the old shard's storage is freed first, which also keeps FSDP2 from comparing
    storages with the NF4 tensor (it has none)."""
    to_nf4 = require(
        "torchao.dtypes.nf4tensor", "qlora", package="torchao", purpose="lora.base_dtype nf4"
    ).to_nf4
    from torch.distributed.tensor import DTensor

    n = 0
    for name, m in lora_modules(model):
        w = m.weight
        if is_nf4(w):
            continue
        check_nf4_shape(name + ".weight", w, shard_count(w))
        # where compute runs: the base may still be in host memory (host_weight)
        device = m.lora_A.weight.device
        if isinstance(w, DTensor):
            if any(p.is_shard() and p.dim != 0 for p in w.placements):
                raise ConfigError(
                    "lora.base_dtype",
                    "nf4",
                    f"{name}.weight is sharded by columns (tensor parallel): NF4 shards by rows only",
                )
            local = DTensor.from_local(
                w.to_local().to(device),
                w.device_mesh,
                w.placements,
                run_check=False,
                shape=w.shape,
                stride=w.stride(),
            )
            q = to_nf4(local.full_tensor().to(torch.bfloat16), NF4_BLOCK, NF4_SCALER_BLOCK)
            mesh, coord = w.device_mesh, w.device_mesh.get_coordinate()
            for i, p in enumerate(w.placements):  # (Replicate, Shard(0)) for HSDP: rows over the shard axis
                if p.is_shard():
                    q = torch.chunk(q, mesh.size(i), dim=0)[coord[i]]
            w.to_local().untyped_storage().resize_(0)
            new = DTensor.from_local(q, mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())
        else:
            new = to_nf4(w.to(device, torch.bfloat16), NF4_BLOCK, NF4_SCALER_BLOCK)
        m.weight = nn.Parameter(new, requires_grad=False)
        n += 1
    return n

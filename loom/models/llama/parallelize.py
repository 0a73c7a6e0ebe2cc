"""Apply parallelism to a plain Llama, in loom's one composition order:

1. build on the meta device (caller)
2. pipeline split                 (not yet: parallel.pp is rejected by ParallelDims)
3. tensor / sequence / expert parallel   (not yet: parallel.tp/ep are rejected)
4. activation checkpointing
5. torch.compile per block
6. FSDP2 / HSDP (on meta)
7. materialize + layout-independent init
8. DDP (needs real storage: it broadcasts from rank 0 at construction)
"""

from __future__ import annotations

import torch
from torch import nn

from loom.config.sections import ParallelConfig, TrainingConfig
from loom.models.common.init import materialize
from loom.models.llama.model import Llama
from loom.parallel.activation_checkpoint import apply_activation_checkpointing
from loom.parallel.compile import apply_compile
from loom.parallel.data_parallel import apply_ddp, apply_fsdp
from loom.parallel.dims import ParallelDims

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parallelize_llama(model: Llama, dims: ParallelDims, training: TrainingConfig, parallel: ParallelConfig,
                      device: torch.device, seed: int) -> nn.Module:
    """Returns the module to train (possibly a DDP wrapper around ``model``)."""
    apply_activation_checkpointing(model.layers, training.activation_checkpointing, training.ac_every)
    if training.compile:
        apply_compile(model.layers)
    if dims.fsdp_enabled:
        mesh = dims["dp_replicate", "dp_shard_cp"] if dims.hsdp_enabled else dims["dp_shard_cp"]
        apply_fsdp(model, list(model.layers.values()), mesh, compute_dtype=DTYPES[training.dtype],
                   reshard_after_forward=parallel.reshard_after_forward, cpu_offload=parallel.cpu_offload)
    init_device = torch.device("cpu") if parallel.cpu_offload and dims.fsdp_enabled else device
    materialize(model, init_device, seed, model.param_std, model.init_buffers)
    if parallel.cpu_offload and dims.fsdp_enabled:
        model.init_buffers(device)  # buffers are not offloaded: they live where compute runs
    if dims.ddp_enabled:
        return apply_ddp(model, dims["dp_replicate"], bucket_mb=parallel.ddp_bucket_mb)
    return model

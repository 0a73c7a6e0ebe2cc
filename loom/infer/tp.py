"""Tensor parallelism for generation: the training plan's weight sharding (``loom.parallel.tensor_parallel``:
q/k/v, w1/w3 column-parallel, wo/w2 row-parallel, the embedding and the head split over the vocabulary), with the
activations between blocks replicated instead of split over the sequence.

Why not the training plan as it is: sequence parallelism splits each forward's tokens over the ranks, and a decode
step has one token per row (an uneven split that DTensor's collectives refuse). Replicated activations are
Megatron's original layout: one all-reduce after each row-parallel projection, an all-gather of the head's logits;
the weights, and so the checkpoint loading, are exactly the training plan's. Norm weights stay plain tensors on
every rank, and so do a mixture of experts' router and experts (every rank routes every token)."""

from __future__ import annotations

from torch import nn


def inference_styles(plan: dict) -> dict:
    """``plan`` (module path -> ParallelStyle) with the same column / row splits, replicated activations and no
    sequence layouts (SequenceParallel, PrepareModuleInput dropped)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {}
    for path, style in plan.items():
        kind = type(style).__name__
        if kind == "ColwiseParallel":
            # replicated in, this rank's heads / hidden units out (a plain tensor)
            out[path] = ColwiseParallel()
        elif kind == "RowwiseParallel":
            out[path] = RowwiseParallel()  # this rank's part in, all-reduced out (a plain tensor)
    return out


def apply_inference_tp(model: nn.Module, tp_mesh) -> None:
    """Shard a plain loom Llama in place over the 1-D ``tp_mesh`` (before its weights are materialized and loaded,
    or after: DTensor distributes what is there)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from loom.parallel.tensor_parallel import block_plan_for, with_adapters

    tied = model.output.weight is model.tok_embeddings.weight
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    if tied:  # both plans split the shared (V, E) weight by rows: one DTensor serves both again
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        plan = inference_styles(block_plan_for(block))
        missing = [path for path in plan if not _has(block, path)]
        if missing:  # a rename in the model would otherwise leave a layer replicated and wrongly sized caches
            raise RuntimeError(f"tensor parallel plan names modules the block lacks: {missing}")
        parallelize_module(block, tp_mesh, with_adapters(block, plan))  # LoRA factors split like their base


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False

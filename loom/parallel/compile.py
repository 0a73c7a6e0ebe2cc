"""Per-block torch.compile: one compiled graph reused by every block of the same shape.

A block whose MoE runs its experts over expert parallelism is compiled around them: the token all-to-all has
sizes known only on the host (``loom.parallel.expert_parallel.ExpertParallel.run`` is excluded from tracing), so
Dynamo splits that block into the graph before the exchange (attention, router) and the graph after (combine).
Such a block is compiled inside its activation-checkpointing wrapper, not around it: Dynamo cannot trace a
checkpointed region that breaks, and would run the whole block eagerly."""

from __future__ import annotations

from torch import nn


def apply_compile(layers: nn.ModuleDict) -> None:
    for block in layers.values():
        if expert_parallel(block):
            getattr(block, "_checkpoint_wrapped_module", block).compile(fullgraph=False)
        else:
            block.compile(fullgraph=True)  # in place: parameter names do not change


def expert_parallel(block: nn.Module) -> bool:
    from loom.models.common.moe import moe_modules

    return any(moe.expert_parallel is not None for moe in moe_modules(block))

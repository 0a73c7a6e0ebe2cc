"""Per-block torch.compile: one compiled graph reused by every block of the same shape."""

from __future__ import annotations

from torch import nn

from loom.models.common.moe import moe_modules
from loom.parallel.expert_parallel import exchanges_tokens


def apply_compile(layers: nn.ModuleDict, inside_checkpoint: bool = False, cuda_graphs: bool = False) -> None:
    """Compile every block in place (parameter names do not change); ``cuda_graphs``: torch.compile's
    reduce-overhead mode, each block's forward and backward replayed as CUDA graphs; ``inside_checkpoint``: compile a
    checkpointed block's inner module rather than the wrapper (``parallelize_llama`` sets it under tensor
    parallelism or with FlexAttention, with full / every-k recomputation, where compiling around the wrapper fails:
    docs/parallelism.md; op-level recomputation compiles around it there).

    A block whose MoE runs its experts over expert parallelism is compiled around them: the token all-to-all has
    sizes known only on the host (``loom.parallel.expert_parallel.ExpertParallel.run`` is excluded from tracing),
    so Dynamo splits that block into the graph before the exchange (attention, router) and the graph after
    (combine). Such a block is compiled inside its activation-checkpointing wrapper, not around it: Dynamo cannot
    trace a checkpointed region that breaks, and would run the whole block eagerly."""
    for block in layers.values():
        ep = expert_parallel(block)
        inner = getattr(block, "_checkpoint_wrapped_module", block) if ep or inside_checkpoint else block
        inner.compile(fullgraph=not ep, mode="reduce-overhead" if cuda_graphs else None)


def expert_parallel(block: nn.Module) -> bool:
    return any(exchanges_tokens(moe) for moe in moe_modules(block))

"""Per-block torch.compile: one compiled graph reused by every block of the same shape; under training.cuda_graphs
a second compile of each block without graphs, for the callers that run it at shapes of their own (``graph_free``)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from loom.models.common.moe import moe_modules
from loom.parallel.expert_parallel import exchanges_tokens

RECOMPILE_LIMIT = 64  # Dynamo's entries per code object, at least (``apply_compile``)


def apply_compile(
    layers: nn.ModuleDict,
    inside_checkpoint: bool = False,
    cuda_graphs: bool = False,
    counts_loads: bool = False,
    backend: str = "inductor",
) -> None:
    """Compile every block in place (parameter names do not change); ``cuda_graphs``: torch.compile's
    reduce-overhead mode, each block's forward and backward replayed as CUDA graphs; ``inside_checkpoint``: compile a
    checkpointed block's inner module rather than the wrapper (``parallelize_llama`` sets it under tensor
    parallelism or with FlexAttention, with full / every-k recomputation, where compiling around the wrapper fails:
    docs/parallelism.md; op-level recomputation compiles around it there).

    A block whose MoE runs its experts over expert parallelism is compiled around them: the token all-to-all has
    sizes known only on the host (``loom.parallel.expert_parallel.ExpertParallel.run`` is excluded from tracing),
    so Dynamo splits that block into the graph before the exchange (attention, router) and the graph after
    (combine). Such a block is compiled inside its activation-checkpointing wrapper, not around it: Dynamo cannot
    trace a checkpointed region that breaks, and would run the whole block eagerly.

    ``counts_loads`` (the selection biases move: model.moe_bias_speed > 0): a block with experts counts each token's
    experts. Compiled whole (around its checkpoint, no expert parallelism, no CUDA graphs) it counts inside the graph
    (``MoE.count_in_graph``: an in-place add to a buffer, which the compiled recomputation does not repeat), as
    torchtitan does. Otherwise it counts eagerly (``MoE.count_loads``, excluded from tracing), so it breaks there too
    and is compiled inside its checkpoint wrapper: a recomputing backward then reruns the count eagerly, where it
    sees the recomputation and skips it (its checkpoint then wraps compiled code, which an op-level policy may not
    see into). Otherwise compiled blocks count nothing. ``backend``: torch.compile's (tests: ``eager``, ``aot_eager``
    where a graph counts: the in-place add needs AOTAutograd's functionalization).

    Every block runs one code object (the block class's ``forward``), compiled once per set of guards it meets:
    training's forwards (gradients, each width), the no-gradient forwards of log-probabilities and evaluation, the
    inference engine's prefills and decode steps with their KV caches, each static then dynamic, and under
    ``cuda_graphs`` the graph-free compile's entries beside the graphed one's. Dynamo's default limit of 8 entries
    is too few for an RL run that evaluates (and ``fullgraph`` turns an overflow into a failure): raised to 64."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for block in layers.values():
        counted = counts_loads and bool(moe_modules(block))
        wrapped = hasattr(block, "_checkpoint_wrapped_module")
        # counted inside the graph where the block compiles whole around its checkpoint: the compiled recomputation
        # does not repeat the graph's in-place add (an eager checkpoint around a compiled block would rerun it);
        # not under CUDA graphs (a graph that mutates a buffer)
        in_graph = (
            counted and not expert_parallel(block) and not cuda_graphs and not (inside_checkpoint and wrapped)
        )
        for moe in moe_modules(block):
            moe.count_loads, moe.count_in_graph = counts_loads, in_graph
        breaks = expert_parallel(block) or (counted and not in_graph)
        inner = getattr(block, "_checkpoint_wrapped_module", block) if breaks or inside_checkpoint else block
        inner.compile(fullgraph=not breaks, backend=backend, mode="reduce-overhead" if cuda_graphs else None)
        if cuda_graphs:
            # the same block compiled without graphs, for ``graph_free`` (compiled on its first call)
            inner.__dict__[GRAPH_FREE] = torch.compile(
                inner._call_impl, fullgraph=not breaks, backend=backend
            )


GRAPH_FREE = "_loom_graph_free_call"  # a graphed block's compile without CUDA graphs (``apply_compile``)


def graph_free_blocks(model: nn.Module) -> list[tuple[nn.Module, object]]:
    """(module, its compile without graphs) of every block of ``model`` compiled with CUDA graphs (none without
    training.cuda_graphs): what ``graph_free`` swaps in."""
    return [(m, m.__dict__[GRAPH_FREE]) for m in model.modules() if GRAPH_FREE in m.__dict__]


@contextlib.contextmanager
def graph_free(blocks: list[tuple[nn.Module, object]]):
    """Inside, each of ``blocks`` (``graph_free_blocks``) runs its compile without CUDA graphs: the inference
    engine's prefills and decode steps (no gradients, KV caches, shapes that change with every batch of prompts;
    the engine captures its decode steps as graphs of its own) would otherwise each record a graph of training's
    reduce-overhead compile and keep its memory. Only the training step's shapes are captured there."""
    graphed = [(m, m._compiled_call_impl) for m, _ in blocks]
    for m, plain in blocks:
        m._compiled_call_impl = plain
    try:
        yield
    finally:
        for m, call in graphed:
            m._compiled_call_impl = call


def expert_parallel(block: nn.Module) -> bool:
    return any(exchanges_tokens(moe) for moe in moe_modules(block))

"""What one rank holds of the model under a layout: parameter counts per pipeline rank, split by what tensor
parallelism shards, from the model's shape (exact: a test compares them with a meta-device model)."""

from __future__ import annotations

from dataclasses import dataclass

from loom.metrics.flops import attention_matmul_params
from loom.parallel.pipeline import split_layers, stage_ids, stages_per_rank


def layer_params(args) -> tuple[int, int]:
    """(weights tensor parallelism shards, weights it replicates) of one transformer block: the norms are
    replicated, and so are a MoE block's router and experts (each tp rank runs its sequence slice's tokens
    through all of them: loom.parallel.tensor_parallel). q/k/v biases shard with their weights; q/k norms are
    replicated, and so are multi-head latent attention's compressions and their norms."""
    bias = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim if args.attention_bias else 0
    attention, attention_replicated = attention_split(args)
    norms = 2 * args.dim + (2 * args.head_dim if args.qk_norm else 0) + attention_replicated
    if args.moe:
        return attention + bias, ffn_params(args, active=False) + norms
    return attention + ffn_params(args, active=False) + bias, norms


def block_params(args, tp: int) -> float:
    """One tp rank's share of one transformer block."""
    sharded, replicated = layer_params(args)
    return sharded / tp + replicated


def attention_params(args) -> int:
    """One block's attention matmul weights (``loom.metrics.flops.attention_matmul_params``)."""
    return attention_matmul_params(args)


def attention_split(args) -> tuple[int, int]:
    """(attention weights tensor parallelism shards by heads, those it replicates). Multi-head latent attention
    replicates its compressions (``wq_a``, ``wkv_a``) and their norms (loom.parallel.tensor_parallel.mla_plan)."""
    if not args.mla:
        return attention_params(args), 0
    compressions = args.dim * (args.q_lora_rank + args.kv_lora_rank + args.qk_rope_head_dim)
    latent_norms = args.q_lora_rank + args.kv_lora_rank
    return attention_params(args) - compressions, compressions + latent_norms


def ffn_params(args, active: bool) -> int:
    """The feed-forward's weights: dense SwiGLU, or the router plus every expert (``active``: the top_k
    experts a token goes through)."""
    if not args.moe:
        return 3 * args.dim * args.ffn_dim
    experts = args.moe_top_k if active else args.moe_experts
    return args.dim * args.moe_experts + experts * expert_params(args)


def expert_params(args) -> int:
    return 3 * args.dim * args.expert_ffn_dim


@dataclass(frozen=True)
class RankShare:
    """One pipeline rank's part of the model (all of it without pipelining)."""

    layers: int  # transformer blocks on this rank (all its stages)
    stages: list[list[int]]  # layer indices of each local stage, in schedule order
    first: list[bool]  # per local stage: holds the embedding
    last: list[bool]  # per local stage: holds the final norm, the head and the loss
    vocab_params: int  # embedding and head rows (sharded by tp)
    other_params: int  # norms, a MoE block's router and experts (replicated under tp)
    matmul_params: int  # block weights sharded by tp
    active_matmul_params: int  # block weights one token goes through (a MoE block: router and top_k experts)

    def params(self, tp: int) -> float:
        """Parameters one rank of a tp group holds (before any data-parallel sharding)."""
        return (self.matmul_params + self.vocab_params) / tp + self.other_params


def rank_shares(args, pp: int, parallel, seq_len: int) -> list[RankShare]:
    """Per pp rank, what it holds (a single share without pipelining). The last stage of a tied model keeps its
    own copy of the embedding (loom.parallel.pipeline.build_stage)."""
    per_rank = stages_per_rank(parallel) if pp > 1 else 1
    n_stages = pp * per_rank
    split = (
        split_layers(args, n_stages, seq_len, parallel.pp_layers_per_stage or None)
        if pp > 1
        else [list(range(args.n_layers))]
    )
    mm, norms = layer_params(args)
    shares = []
    for rank in range(pp):
        ids = stage_ids(rank, pp, per_rank, parallel.pp_schedule) if pp > 1 else [0]
        first = [s == 0 for s in ids]
        last = [s == n_stages - 1 for s in ids]
        layers = sum(len(split[s]) for s in ids)
        vocab = 0
        if any(first):
            vocab += args.vocab_size * args.dim
        if any(last) and not (args.tie_embeddings and any(first)):
            vocab += args.vocab_size * args.dim  # the head, or the tied weight's copy on the last stage
        active = attention_params(args) + ffn_params(args, active=True)
        shares.append(
            RankShare(
                layers,
                [split[s] for s in ids],
                first,
                last,
                vocab,
                layers * norms + (args.dim if any(last) else 0),
                layers * mm,
                layers * active,
            )
        )
    return shares

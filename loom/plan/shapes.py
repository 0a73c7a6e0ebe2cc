"""What one rank holds of the model under a layout: parameter counts per pipeline rank, split by what tensor
parallelism shards, from the model's shape (exact: a test compares them with a meta-device model)."""

from __future__ import annotations

from dataclasses import dataclass

from loom.metrics.flops import attention_matmul_params
from loom.parallel.pipeline import split_layers, stage_ids, stages_per_rank


def layer_params(args, i: int | None = None) -> tuple[int, int]:
    """(weights tensor parallelism shards, weights it replicates) of transformer block ``i`` (None: a block with
    experts where the model has any): the norms are replicated, and so are a MoE block's router and routed experts
    (each tp rank runs its sequence slice's tokens through all of them: loom.parallel.tensor_parallel); its shared
    experts shard as a dense SwiGLU does. q/k/v biases shard with their weights; q/k norms are replicated, and so
    are multi-head latent attention's compressions and their norms. Block ``n_layers + k`` is the k-th multi-token
    prediction module's block (``args.moe_layer`` says which blocks have experts)."""
    bias = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim if args.attention_bias else 0
    attention, attention_replicated = attention_split(args)
    norms = 2 * args.dim + (2 * args.head_dim if args.qk_norm else 0) + attention_replicated
    if args.moe and (i is None or args.moe_layer(i)):
        shared = args.moe_shared_experts * expert_params(args)
        return attention + bias + shared, ffn_params(args, active=False) + norms
    return attention + 3 * args.dim * args.ffn_dim + bias, norms


def mtp_params(args) -> tuple[int, int]:
    """(tp-sharded, tp-replicated) weights of the multi-token prediction modules (DeepSeek-V3's ``mtp``: each its
    block, ``eh_proj`` column-parallel, and three norms; none without MTP)."""
    sharded = replicated = 0
    for k in range(getattr(args, "mtp_depth", 0)):
        block_sharded, block_replicated = layer_params(args, args.n_layers + k)
        sharded += block_sharded + 2 * args.dim * args.dim
        replicated += block_replicated + 3 * args.dim
    return sharded, replicated


def active_params(args, i: int) -> int:
    """Matmul weights one token goes through in block ``i``: attention and the dense SwiGLU, or the router, the
    top_k routed experts and the shared experts."""
    if args.moe and args.moe_layer(i):
        return attention_params(args) + ffn_params(args, active=True)
    return attention_params(args) + 3 * args.dim * args.ffn_dim


def block_params(args, tp: int, i: int | None = None) -> float:
    """One tp rank's share of transformer block ``i`` (None: a block with experts where the model has any)."""
    sharded, replicated = layer_params(args, i)
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
    """The feed-forward's weights: dense SwiGLU, or the router plus every routed expert (``active``: the top_k
    experts a token goes through, and the shared experts every token goes through)."""
    if not args.moe:
        return 3 * args.dim * args.ffn_dim
    experts = args.moe_top_k + args.moe_shared_experts if active else args.moe_experts
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
    moe_layers: int = 0  # blocks with routed experts, the MTP modules' included
    mtp: int = 0  # multi-token prediction modules (the last stage's; in FSDP2's root unit)
    kinds: tuple[
        tuple[int, int, bool], ...
    ] = ()  # each kind of block held: (tp-sharded, replicated, experts)
    block_sharded: int = 0  # of matmul_params, the transformer blocks' (the rest: the MTP modules')
    block_replicated: int = 0  # of other_params, the transformer blocks'
    dense_layers: int = 0  # transformer blocks without routed experts (of a MoE model; a dense model: 0)

    def params(self, tp: int) -> float:
        """Parameters one rank of a tp group holds (before any data-parallel sharding)."""
        return (self.matmul_params + self.vocab_params) / tp + self.other_params

    def largest_block(self, tp: int, expert_params: float = 0.0, expert_share: float = 1.0) -> float:
        """Parameters one tp rank holds of this rank's largest block, of whose routed experts
        (``expert_params`` a block) it holds ``expert_share`` (expert parallelism, tensor-parallel experts)."""
        return max(
            s / tp + r - (expert_params * (1 - expert_share) if experts else 0.0)
            for s, r, experts in self.kinds
        )

    def blocks_params(self, tp: int) -> float:
        """Of ``params``, the transformer blocks' (each its own FSDP2 unit; the rest is the root's)."""
        return self.block_sharded / tp + self.block_replicated


def rank_shares(args, pp: int, parallel, seq_len: int) -> list[RankShare]:
    """Per pp rank, what it holds (a single share without pipelining). The last stage keeps the multi-token
    prediction modules and, for them or a tied head, its own copy of the embedding (loom.parallel.pipeline.build_stage;
    under a V-shaped schedule beside the first stage's on rank 0)."""
    per_rank = stages_per_rank(parallel) if pp > 1 else 1
    n_stages = pp * per_rank
    split = (
        split_layers(args, n_stages, seq_len, parallel.pp_layers_per_stage or None)
        if pp > 1
        else [list(range(args.n_layers))]
    )
    depth = getattr(args, "mtp_depth", 0)
    experts = lambda i: args.moe and args.moe_layer(i)
    shares = []
    for rank in range(pp):
        ids = stage_ids(rank, pp, per_rank, parallel.pp_schedule) if pp > 1 else [0]
        first = [s == 0 for s in ids]
        last = [s == n_stages - 1 for s in ids]
        held = [i for s in ids for i in split[s]]
        vocab = 0
        if any(first):
            vocab += args.vocab_size * args.dim
        if any(last) and not (args.tie_embeddings and pp == 1):
            # the head, or the tied weight's copy on the last stage (a second one on rank 0 under a V-shaped
            # schedule: each stage holds its own, summed: loom.train.grads.TiedEmbeddingGrads)
            vocab += args.vocab_size * args.dim
        if pp > 1 and any(last) and depth and not args.tie_embeddings:
            # the copy of the embedding the MTP modules read, beside the head
            vocab += args.vocab_size * args.dim
        blocks = [layer_params(args, i) for i in held]
        mtp = depth if any(last) else 0
        mtp_mm, mtp_other = mtp_params(args) if mtp else (0, 0)
        mtp_blocks = range(args.n_layers, args.n_layers + mtp)
        block_sharded, block_replicated = sum(b[0] for b in blocks), sum(b[1] for b in blocks)
        shares.append(
            RankShare(
                len(held),
                [split[s] for s in ids],
                first,
                last,
                vocab,
                block_replicated + mtp_other + (args.dim if any(last) else 0),
                block_sharded + mtp_mm,
                sum(active_params(args, i) for i in (*held, *mtp_blocks)) + mtp * 2 * args.dim * args.dim,
                moe_layers=sum(map(experts, (*held, *mtp_blocks))),
                mtp=mtp,
                kinds=tuple(sorted({(*layer_params(args, i), experts(i)) for i in held})),
                block_sharded=block_sharded,
                block_replicated=block_replicated,
                dense_layers=sum(not experts(i) for i in held) if args.moe else 0,
            )
        )
    return shares

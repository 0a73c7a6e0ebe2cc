"""Peak device memory of one rank under a layout: the model state from the parameter counts (exact), the
activations from loom.plan.activations (measured on fake tensors), the pipeline's micro-batches in flight
from the schedule's own action list.

State, per parameter a rank owns after data-parallel sharding (F = dp_shard x cp ranks when FSDP2 shards):
fp32 weights 4 bytes, fp32 gradients 4, AdamW moments 8. FSDP2 gathers a block's weights in the compute
dtype right before use and frees them after (``reshard_after_forward``): two blocks are gathered at once
(the one running and the one prefetched), the root's (embedding, final norm, head) stay gathered; a block's
unsharded gradients (compute dtype, then fp32 for the reduce-scatter) exist while it is reduced. Without
FSDP, autocast keeps a compute-dtype copy of every weight from its first use to the end of the forward.
With ``parallel.cpu_offload`` the state lives in host memory (``loom.plan.planner.offloaded_state``); the device
holds what FSDP2 gathers (on one rank as well), plus the fp32 copy of a block's shards on its way in before the
cast. With ``optimizer.offload nvme`` the AdamW moments live in files (``loom.plan.planner.nvme_state``), neither on
the device nor on the host. With ``training.activation_offload`` the offloaded blocks' saved tensors wait on the
host but for two blocks' worth in flight (``offloaded_activations``).

Without a pipeline the peak is the busiest of three moments (``step_peak``): gradients are freed after every
step and built during the backward while activations are freed, so the two do not add up in full. With a
pipeline every term is counted at once (micro-batches of several phases are in flight).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from loom.plan.activations import ActivationProfile

GIB = 2.0**30
# Allocator and library workspace not in the tensors above (cuBLAS / NCCL buffers, the caching allocator's
# rounding and fragmentation): a fixed share plus a fraction of the rest, fitted in docs/planner.md's table.
WORKSPACE_BYTES = 1.0 * GIB
FRAGMENTATION = 0.05
# Share of a GPU's memory a plan leaves free by default (``loom plan --margin``): the memory estimate's error
# (docs/planner.md) and what the caching allocator cannot reuse after a long run.
MARGIN = 0.05
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # per element, by training.dtype


class ByteParts:
    """A dataclass of byte counts by kind: ``total`` adds them up, ``gib`` lists them (and the total) in GiB."""

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def gib(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) / GIB for f in fields(self)}
        out["total"] = self.total / GIB
        return out


@dataclass
class Memory(ByteParts):
    """Bytes on the busiest rank, by kind; ``total`` adds them up."""

    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    gathered: float = 0.0  # FSDP2's unsharded compute copies and gradients, or autocast's weight copies
    activations: float = 0.0  # held between forwards and backwards (all micro-batches in flight)
    backward: float = 0.0  # extra at the peak of one backward (gradients of activations, recomputation)
    workspace: float = 0.0
    kv_cache: float = 0.0  # a rollout method's generation: the inference engine's KV cache


@dataclass(frozen=True)
class MemoryInputs:
    """What the memory of one rank depends on, beyond the model's shape."""

    dtype: str
    tp: int
    cp: int
    shard: int  # FSDP2 shard degree (dp_shard x cp), 1 without sharding
    fsdp: bool  # FSDP2 wraps the model (sharding, or replicating under TP/PP)
    reshard_after_forward: bool
    micro_batch: int
    seq_len: int
    cpu_offload: bool = False
    ep: int = (
        1  # expert parallelism: FSDP2 gathers a block's experts over edp = dp_shard x cp (x tp) / ep only
    )
    expert_params: float = 0.0  # of one block (all its experts)
    etp: int = (
        1  # tensor-parallel experts (parallel.etp = tp): each tp rank holds a 1/tp slice of every expert
    )
    optimizer_shard: int = (
        1  # ZeRO-1 (parallel.zero = 1): the AdamW moments split over this many DDP replicas
    )
    cp_ring: bool = False  # parallel.cp_method = ring: no gathered K/V kept for the backward
    offload_blocks: int = 0  # training.activation_offload: blocks whose saved tensors wait on the host
    nvme: bool = False  # optimizer.offload nvme: the AdamW moments in files
    weight_versions: int = (
        0  # pp_schedule pipedream_2bw: fp32 copies of the weights beside the optimizer's (1: the stash)
    )
    reduce_bytes: int = 4  # parallel.reduce_dtype: the bytes of each gradient element FSDP2 reduces
    ddp_bucket_bytes: float = 25 * 2**20  # parallel.ddp_bucket_mb
    ep_padded: bool = (
        False  # parallel.ep_exchange = padded: each rank's experts run on ep blocks of every slot
    )
    vocab_split: bool = False  # parallel.fsdp_embedding resolves to vocab: the table is never gathered
    rows_per_example: int = 1  # the objective's rows a micro-batch example (pair data: 2)
    gather_fused: bool = (
        False  # parallel.fsdp_gather_copy fused: the shards cast straight into the gather buffer
    )
    # LoRA (lora.rank > 0): the frozen base's bytes a parameter (lora.base_dtype: 4 float32, 2 bfloat16 and for
    # nf4's unquantized weights; 0: no LoRA), those of an adapted linear's base weight (NF4's ~0.52 under QLoRA),
    # and of one block: its adapter parameters (the only ones with gradients and AdamW moments) and the base
    # weights they adapt
    lora_base_bytes: float = 0
    adapted_bytes: float = 0
    block_adapters: float = 0.0
    block_adapted: float = 0.0
    # the adapted linears' input + output widths summed over one block: the part tensor parallelism splits, the
    # part each rank holds whole (loom.plan.planner.adapted_widths)
    block_adapted_split: float = 0.0
    block_adapted_whole: float = 0.0
    # the training method's models beyond the policy (loom.methods' PlanExtras): frozen copies of its shape (a
    # reference, a teacher: their fp32 weights, sharded as the policy's) and models of its shape trained beside it
    frozen_copies: int = 0
    trained_copies: int = 0
    # a rollout method's generation (loom.infer.engine on this rank): its KV cache's bytes, and the bytes of the
    # weight copy it generates with where it cannot use the policy's own module (FSDP2, tensor parallelism)
    kv_cache: float = 0.0
    kv_kept: bool = False  # grpo.keep_cache: the cache stays parked through the training step
    engine_copy: float = 0.0

    def adapters(self, layers: float) -> float:
        """Adapter parameters of ``layers`` blocks on one tp rank (tensor parallelism splits them with their base)."""
        return layers * self.block_adapters / self.tp

    def frozen_bytes(self, params: float, layers: float) -> float:
        """Bytes of the frozen base ``params`` (the model's own, adapters apart; ``layers`` blocks' worth on one
        tp rank)."""
        adapted = layers * self.block_adapted / self.tp
        return self.lora_base_bytes * (params - adapted) + self.adapted_bytes * adapted


def held_params(share, x: MemoryInputs) -> float:
    """Parameters one rank holds before FSDP2 shards them: its tp share, with the experts split over the tp
    ranks too when expert parallelism takes them in (ep and tp > 1) or they are tensor-parallel (etp = tp > 1);
    otherwise tp replicates them."""
    return share.params(x.tp) - share.moe_layers * x.expert_params + held_experts(share, x)


def held_experts(share, x: MemoryInputs) -> float:
    """The expert parameters among ``held_params``: split over the tp ranks under ep or etp, whole otherwise."""
    experts = share.moe_layers * x.expert_params
    return experts / x.tp if x.tp > 1 and (x.ep > 1 or x.etp > 1) else experts


def state_memory(params: float, x: MemoryInputs, layers: float = 0.0) -> Memory:
    """fp32 weights, fp32 gradients and AdamW moments of ``params`` (one tp rank's share). Under LoRA
    (``x.lora_base_bytes``) the base of those ``layers`` blocks is frozen in its own dtype: gradients and moments
    are the adapters' alone (fp32), FSDP2 shards all of it."""
    if x.cpu_offload:
        return Memory()
    state = _own_state(params, x, layers)
    n = x.shard if x.shard > 1 else 1
    for kind in ("weights", "gradients", "optimizer"):
        setattr(state, kind, getattr(state, kind) * (1 + x.trained_copies))
    state.weights += x.frozen_copies * 4 * params / n
    return state


def _own_state(params: float, x: MemoryInputs, layers: float) -> Memory:
    """``state_memory`` of the policy alone."""
    if x.lora_base_bytes:
        n = x.shard if x.shard > 1 else 1
        adapters, moments = x.adapters(layers), 0 if x.nvme else 8
        weights = x.frozen_bytes(params, layers) + 4 * adapters
        return Memory(weights=weights / n, gradients=4 * adapters / n, optimizer=moments * adapters / n)
    # FSDP2 (ZeRO 2 and 3) keeps all three sharded between uses; zero 2's gathered copies: gathered
    moments = 0 if x.nvme else 8  # optimizer.offload nvme: in files
    if x.shard > 1:
        weights, grads, optimizer = stage_state(params, x.shard, 3, 4, 4, moments)
    else:
        weights, grads, optimizer = stage_state(
            params, x.optimizer_shard, 1 if x.optimizer_shard > 1 else 0, 4, 4, moments
        )
    weights += x.weight_versions * 4 * params  # unsharded: pipedream_2bw runs on pipeline ranks alone
    return Memory(weights=weights, gradients=grads, optimizer=optimizer)


def offloaded_activations(per_block: float, x: MemoryInputs) -> tuple[float, float]:
    """(device bytes saved, host bytes held) of one micro-batch under training.activation_offload: each offloaded
    block's saved tensors (``per_block``: its input alone when recomputed) wait on the host; on the device stay the
    block whose backward runs and the one prefetched behind it (or the one whose copy out is in flight)."""
    k = x.offload_blocks
    return per_block * (k - min(k, 2)), per_block * k


def split_tokens(x: MemoryInputs) -> float:
    """The tokens the embedding split by rows gathers a micro-batch: every shard rank's."""
    return x.shard * x.micro_batch * x.rows_per_example * x.seq_len / x.cp


def gathered_memory(share, args, x: MemoryInputs, gathered_layers: float) -> float:
    """FSDP2's unsharded block weights and one block's unsharded gradients (bytes); 0 without FSDP2."""
    if not x.fsdp:
        return 0.0
    compute = BYTES[x.dtype]
    held = 1 / (x.ep * x.etp)  # of each block's experts: only its own (ep), its width slice (etp)
    block = share.largest_block(x.tp, x.expert_params, held)
    root = share.params(x.tp) - share.blocks_params(x.tp)  # embeddings, head, final norm, MTP modules
    split = 0.0
    if x.vocab_split and any(share.first):  # the embedding split by rows (loom.parallel.vocab_embedding)
        root -= args.vocab_size * args.dim
        # instead: every shard rank's tokens' rows, in fp32 and the compute dtype (backward's gradients)
        split = (4 + compute) * split_tokens(x) * args.dim
    root -= (
        (share.moe_layers - (share.layers - share.dense_layers)) * x.expert_params * (1 - held)
        if args.moe
        else 0
    )
    # one block's unsharded grads (+ a copy in the reduce dtype where it is not the compute dtype): LoRA's adapters'
    trained = x.adapters(1) if x.lora_base_bytes else block
    grads = (compute + (x.reduce_bytes if compute != x.reduce_bytes else 0)) * trained
    # fp32 shards copied in, then cast
    staging = 4 * block / x.shard if x.cpu_offload and compute != 4 else 0.0
    return compute * (gathered_layers * block + root) + grads + staging + split


def autocast_cache(share, args, x: MemoryInputs, compiled: bool, held_fixed: float) -> float:
    """Bytes of autocast's weight cache at the end of the forward beyond what the activations already hold.
    Without FSDP2, fp32 weights run under autocast, which keeps a compute-dtype copy of every weight from its
    first use until the forward's autocast region ends; compiled blocks cast inside their graph instead (only
    the eager root's weights are cached). ``held_fixed``: batch-independent bytes the traced activations
    already keep (the copies a backward needs)."""
    if (
        x.fsdp or x.dtype == "float32" or x.lora_base_bytes == BYTES[x.dtype]
    ):  # (a LoRA base in the compute dtype)
        return 0.0
    params = share.params(x.tp)
    if compiled:
        params -= share.blocks_params(x.tp)
    return max(0.0, BYTES[x.dtype] * params - held_fixed)


def step_peak(
    state: Memory, gathered: float, cache: float, activations: float, backward: float, grads_before: float
) -> Memory:
    """The busiest of three moments of a step without a pipeline. ``zero_grad(set_to_none)`` frees gradients
    after every step, so they build up during the backward while activations are freed (both per block):
    the end of the forward holds the activations, autocast's cache and the gradients of earlier
    micro-batches (``grads_before``); the start of the backward holds the activations and the backward's extra;
    its end holds every gradient and the extra."""

    def moment(grads: float, held: float, extra: float, cached: float) -> Memory:
        return Memory(
            weights=state.weights,
            gradients=grads,
            optimizer=state.optimizer,
            gathered=gathered + cached,
            activations=held,
            backward=extra,
        )

    moments = [
        moment(grads_before, activations, 0.0, cache),
        moment(grads_before, activations, backward, 0.0),
        moment(state.gradients, 0.0, backward, 0.0),
    ]
    return max(moments, key=lambda m: m.total)


def stored_blocks(ac: str, ac_every: int, n_layers: int) -> float:
    """Share of blocks whose forward keeps its tensors for the backward (not activation-checkpointed)."""
    if ac == "none":
        return 1.0
    if ac == "every_k":
        return 1.0 - -(-n_layers // ac_every) / n_layers
    return 0.0  # full, or op-level (which recomputes the all-gathers below)


def stage_activation(
    profile: ActivationProfile,
    layers: int,
    last: bool,
    x: MemoryInputs,
    args,
    ac: str,
    stored: float,
    dense: int = 0,
) -> float:
    """Bytes one micro-batch holds on a stage of ``layers`` blocks between its forward and backward. Tensor
    parallelism with sequence parallelism shards every activation but the all-gathered inputs of the
    column-parallel linears (attention and MLP input, the head's input), which a stored block keeps whole;
    context parallelism keeps the gathered K/V of each block for the backward unless the block is recomputed (the
    ring keeps none: its backward passes the K/V round again);
    tensor-parallel experts keep the routed slots of the tp group's tokens.
    ``stored``: share of blocks not checkpointed (``stored_blocks``); ``dense``: of a MoE model's ``layers``, those
    without experts."""
    held = profile.held(layers, x.micro_batch, head=last, dense=dense) / x.tp
    tokens = x.micro_batch * x.seq_len / x.cp  # per micro-batch on this rank
    if x.tp > 1:
        gathered_inputs = 2 * layers * stored + (1 if last else 0)
        held += gathered_inputs * tokens * args.dim * BYTES[x.dtype] * (1 - 1 / x.tp)
    # tensor-parallel experts keep the tp group's routed slots whole (the permuted inputs of the
    if x.etp > 1:
        # grouped GEMMs and the experts' outputs, k slots a token): estimated from the tensors kept, not measured
        held += (
            2
            * args.moe_top_k
            * (layers - dense)
            * stored
            * tokens
            * args.dim
            * BYTES[x.dtype]
            * (1 - 1 / x.tp)
        )
    if x.ep_padded and x.ep > 1:
        # the padded exchange: a rank's experts see ep blocks of every slot (pads included) where the uneven one
        # sends ~its own slots, so the tensors kept over those rows (the experts' inputs and outputs, 2 x dim; the
        # gate and up projections and their product, 3 x the expert width) grow (ep - 1) times the slots; estimated
        # from the tensors kept, not measured
        width = 2 * args.dim + 3 * args.expert_ffn_dim
        held += (x.ep - 1) * args.moe_top_k * (layers - dense) * stored * tokens * width * BYTES[x.dtype]
    if x.cp > 1 and ac != "full" and not x.cp_ring:
        kv_dim = args.n_kv_heads * args.head_dim
        held += layers * x.micro_batch * x.seq_len * (1 - 1 / x.cp) * 2 * kv_dim * BYTES[x.dtype] / x.tp
    return held


def cp_attention_working(args, x: MemoryInputs, ac: str) -> float:
    """Bytes context-parallel attention adds at the peak of one block's backward beyond the traced block (which
    sees only this rank's K/V). ``allgather``, O(S) per rank: the gradient of the whole sequence's gathered K/V
    (compute dtype) before its reduce-scatter, and, in a recomputed block (full checkpointing), the other ranks'
    K/V gathered again. ``ring``, O(S/cp): the K/V block attended and the one arriving (compute dtype), three fp32
    dK/dV accumulators of one rank's block (this step's, the one arriving, the one leaving) and the fp32 dQ."""
    if x.cp == 1:
        return 0.0
    c = BYTES[x.dtype]
    kv = (
        x.micro_batch * x.seq_len * 2 * args.n_kv_heads * args.head_dim / x.tp
    )  # the whole sequence's elements
    if x.cp_ring:
        q = x.micro_batch * x.seq_len / x.cp * args.n_heads * args.head_dim / x.tp
        return kv / x.cp * (2 * c + 3 * 4) + 4 * q
    return kv * c * (1 + ((1 - 1 / x.cp) if ac == "full" else 0.0))


def pipeline_peak(
    actions: list[tuple[str, int, int]], per_stage: dict[int, float], split_backward: bool
) -> float:
    """Largest sum of activations in flight on one pp rank over its schedule: a forward adds its stage's
    activations, the backward that finishes with them (the weight pass of split-backward schedules) frees them."""
    held = peak = 0.0
    frees = "W" if split_backward else "B"
    for kind, stage, _ in actions:
        if kind == "F":
            held += per_stage[stage]
            peak = max(peak, held)
        elif kind == frees:
            held -= per_stage[stage]
    return peak


def generation_peak(state: Memory, x: MemoryInputs) -> Memory:
    """A rollout method's generation: the policy's state (gradients freed after each step), the engine's weight
    copy and its KV cache; none without rollouts. (The training step's moment holds the copy too, and the cache
    where it stays parked.)"""
    if not x.kv_cache:
        return Memory()
    return with_workspace(
        Memory(weights=state.weights + x.engine_copy, optimizer=state.optimizer, kv_cache=x.kv_cache)
    )


def with_workspace(m: Memory) -> Memory:
    m.workspace = WORKSPACE_BYTES + FRAGMENTATION * m.total
    return m


def zero_model_state(params: float, n_gpus: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per GPU under ZeRO stage 0-3 (Rajbhandari et al. 2020, Figure 1), mixed-precision Adam:
    2 bytes of fp16 weights, 2 of fp16 gradients and ``k`` of optimizer state (fp32 master weights, momentum and
    variance: 12) per parameter. Stage 1 shards the optimizer state over the ``n_gpus`` data-parallel ranks, stage 2
    the gradients too, stage 3 the weights too. loom keeps fp32 weights and gradients instead (``state_memory``);
    this is the paper's accounting, for comparing the stages."""
    return sum(stage_state(params, n_gpus, stage, 2, 2, k))


def stage_state(
    params: float, n_gpus: int, stage: int, weight_bytes: float, grad_bytes: float, optimizer_bytes: float
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per GPU under ZeRO ``stage``: what the stage shards is divided
    by ``n_gpus``. The paper's accounting is (2, 2, 12) bytes a parameter (``zero_model_state``); loom's
    ``state_memory`` is (4, 4, 8): fp32 weights that are their own master copy, fp32 gradients, AdamW moments."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage}: expected 0, 1, 2 or 3")
    n = {name: (n_gpus if stage >= s else 1) for name, s in (("optimizer", 1), ("grads", 2), ("weights", 3))}
    return (
        weight_bytes * params / n["weights"],
        grad_bytes * params / n["grads"],
        optimizer_bytes * params / n["optimizer"],
    )

"""Tensor + sequence parallelism (Megatron-style) on a plain Llama: DTensor's ``parallelize_module`` shards each
block's matmuls over the ``tp`` mesh axis, and MoE blocks get the tp parts of their ``MoE.parallel``."""

from __future__ import annotations

import functools

import torch
from torch import nn

from loom.models.common.lora import LoRALinear
from loom.models.common.mla import LatentAttention
from loom.models.common.moe import MoE
from loom.parallel.expert_parallel import ExpertTensorParallel, moe_parallel, shard_experts


def block_plan(
    moe: bool = False, qk_norm: bool = False, mla: bool = False, q_lora: bool = False, shared: bool = False
) -> dict:
    """One block's plan on the ``tp`` mesh. Attention: ``wq``/``wk``/``wv`` column-parallel (each rank owns whole
    heads, Q and KV heads alike), ``wo`` row-parallel; the MLP: ``w1``/``w3`` column-parallel, ``w2`` row-parallel.
    Sequence parallel: the residual stream and the norms hold a slice of the sequence, (B, S/tp, E); the entry of
    attention and MLP all-gathers the sequence, their row-parallel exit reduce-scatters it. A mixture-of-experts
    block in place of the MLP keeps its input's sequence slice (``apply_tp`` sets up the rest). Per-head q/k norms
    (Qwen3) see this rank's heads: replicated weights whose gradients are summed over the group. ``mla``: multi-head
    latent attention in place of GQA (``mla_plan``; ``q_lora``: its query is compressed). ``shared``: the mixture of
    experts has shared experts (DeepSeekMoE), a SwiGLU sharded as the dense MLP is: the sequence slice all-gathered,
    ``w1``/``w3`` column-parallel, ``w2`` row-parallel reduce-scattering back to this rank's slice."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    mlp = {
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    if moe:  # this rank's tokens, (B, S/tp, E), as a plain tensor; the output stays its sequence slice
        mlp = {
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
            )
        }
        if shared:  # its input: the plain (B, S/tp, E) the block hands on; its output the same slice
            mlp.update(
                {
                    "feed_forward.shared_experts": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                    "feed_forward.shared_experts.w1": ColwiseParallel(),
                    "feed_forward.shared_experts.w3": ColwiseParallel(),
                    "feed_forward.shared_experts.w2": RowwiseParallel(output_layouts=Shard(1)),
                }
            )
    attention = (
        mla_plan(q_lora)
        if mla
        else {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            **(
                {
                    name: SequenceParallel(sequence_dim=2, use_local_output=True)
                    for name in ("attention.q_norm", "attention.k_norm")
                }
                if qk_norm
                else {}
            ),
        }
    )
    return {
        "attention_norm": SequenceParallel(),
        # forward(x, rope, positions): only x is sharded; rope and positions stay plain tensors
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        **attention,
        "ffn_norm": SequenceParallel(),
        **mlp,
    }


def block_plan_for(block: nn.Module) -> dict:
    """``block_plan`` with the switches read from the block: a mixture of experts (with shared experts), q/k norms,
    latent attention."""
    attention = block.attention
    mla = isinstance(attention, LatentAttention)
    moe = isinstance(block.feed_forward, MoE)
    return block_plan(
        moe,
        qk_norm=not mla and attention.q_norm is not None,
        mla=mla,
        q_lora=mla and attention.wq is None,
        shared=moe and block.feed_forward.shared_experts is not None,
    )


def mtp_plan() -> dict:
    """A multi-token prediction module (loom.models.deepseek_v3.model.MTP) on the ``tp`` mesh, around its block's own
    plan: its norms sequence-parallel on this rank's slices of the hidden states and of the shifted tokens'
    embeddings; ``eh_proj`` column-parallel on the gathered sequence, its output scattered back to the sequence
    slice the block takes (a plain tensor, as the blocks hand on); its head's norm sequence-parallel before the
    model's shared output head."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    return {
        "enorm": SequenceParallel(),
        "hnorm": SequenceParallel(),
        "eh_proj": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
    }


def mla_plan(q_lora: bool) -> dict:
    """Multi-head latent attention (loom.models.common.mla) on the ``tp`` mesh: the per-head up-projections (``wq`` or
    ``wq_b``, ``wkv_b``) column-parallel and ``wo`` row-parallel, so each rank owns whole heads; the compressions
    (``wq_a``, ``wkv_a``) and their norms run whole on every rank (``replicated_compute``: they are small, and every
    head needs the whole latent), their outputs DTensors that the column-parallel up-projections take, whose backward
    sums the heads' partial gradients. The shared RoPE key leaves as this rank's plain tensor (``SharedKey``), its
    gradient from this rank's heads only: a partial sum the DTensor backward adds up over tp."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    replicated = replicated_compute()
    query = (
        {
            "attention.wq_a": replicated(),
            "attention.q_a_norm": replicated(),
            "attention.wq_b": ColwiseParallel(),
        }
        if q_lora
        else {"attention.wq": ColwiseParallel()}
    )
    return {
        **query,
        "attention.wkv_a": replicated(),
        "attention.kv_a_norm": replicated(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.shared_key": replicated(partial_grad_output=True),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


@functools.cache
def replicated_compute() -> type:
    """The ParallelStyle of a module every tp rank runs whole on the same input."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class ReplicatedCompute(ParallelStyle):
        """Parameters replicated (DTensors: checkpoints and FSDP2 see the tp layout; DTensor sums their partial
        gradients), the input made a replicated DTensor, the output left a DTensor for the sharded module after it;
        ``partial_grad_output``: the output handed on as this rank's plain tensor whose gradient is a partial sum
        over the tp ranks (its consumer runs on this rank's heads only)."""

        def __init__(self, partial_grad_output: bool = False):
            super().__init__()
            self.partial_grad_output = partial_grad_output

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            def replicate_inputs(mod, inputs, mesh):
                return tuple(
                    DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
                    else t
                    for t in inputs
                )

            def local_output(mod, out, mesh):
                return out.to_local(grad_placements=[Partial()]) if self.partial_grad_output else out

            return distribute_module(module, device_mesh, input_fn=replicate_inputs, output_fn=local_output)

    return ReplicatedCompute


def with_adapters(block: nn.Module, plan: dict) -> dict:
    """``plan`` with the styles of LoRA-adapted linears (loom.models.common.lora) replaced by their LoRA versions:
    the adapter factors sharded consistently with their base, so the adapter's output has the base's layout."""
    colwise, rowwise = lora_styles()
    lora_cls = {"ColwiseParallel": colwise, "RowwiseParallel": rowwise}
    out = dict(plan)
    for path, style in plan.items():
        # a replicated one (latent attention's compressions: ``replicated_compute``) replicates its factors too
        if isinstance(block.get_submodule(path), LoRALinear) and type(style).__name__ in lora_cls:
            cls = lora_cls[type(style).__name__]
            out[path] = cls.__new__(cls)
            out[path].__dict__.update(style.__dict__)  # the same input / output layouts
    return out


@functools.cache
def lora_styles() -> tuple[type, type]:
    """The ParallelStyles of an adapted linear y = x W^T + s B A x (W: out x in, A: r x in, B: out x r).
    Column-parallel base (W's output rows sharded): A replicated, B's rows sharded, so B A x comes out sharded
    like W x. Row-parallel base (W's input columns sharded, the output a partial sum): A's input columns sharded,
    B replicated, so B A x is a partial sum too and the base's reduce-scatter adds both up."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def shard(module, names, mesh, placement, src_data_rank):
        for name in names:
            p = getattr(module, name)
            if p is not None:
                module.register_parameter(
                    name,
                    nn.Parameter(
                        distribute_tensor(p, mesh, [placement], src_data_rank=src_data_rank), p.requires_grad
                    ),
                )

    # distribute_module calls these for the adapted linear ("") and each child; what they leave is replicated
    class LoRAColwiseParallel(ColwiseParallel):
        def _partition_linear_fn(self, name, module, device_mesh):
            if name in ("", "lora_B"):  # W and its bias, B: Shard(0)
                shard(module, ("weight", "bias"), device_mesh, Shard(0), self.src_data_rank)

    class LoRARowwiseParallel(RowwiseParallel):
        def _partition_linear_fn(self, name, module, device_mesh):
            if name in ("", "lora_A"):  # W, A: Shard(1) (a bias is added once: replicated)
                shard(module, ("weight",), device_mesh, Shard(1), self.src_data_rank)

    return LoRAColwiseParallel, LoRARowwiseParallel


def replicate_moe(moe: nn.Module, tp_mesh, experts: bool = True) -> None:
    """A mixture-of-experts block under tensor parallelism: router and experts replicated over ``tp_mesh``
    (DTensors, so checkpoints and FSDP2 see the tp layout). Each tp rank routes its own tokens through them
    (torchtitan's ``etp = 1``): their local gradients are Partial over tp and DTensor sums them
    (``loom.parallel.expert_parallel.local_weight``). ``experts=False``: expert parallelism or expert tensor
    parallelism will shard the experts instead."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    for module in (moe.router.gate, moe.experts) if experts else (moe.router.gate,):
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(distribute_tensor(p.data, tp_mesh, [Replicate()])))


def is_score_head(module: nn.Module | None) -> bool:
    """Whether ``module`` is a ``dim -> 1`` head (a reward model's score head, PPO's value head or its critic's): one
    output row, which a column split cannot share out over the tp ranks."""
    return isinstance(module, nn.Linear) and module.out_features == 1


def outer_plan(model: nn.Module, loss_parallel: bool) -> dict:
    """Plan for the parts outside the blocks that this (possibly pipeline-pruned) model still has: the embedding,
    the final norm, the output head (a score head: ``score_head_style``), and PPO's value head on the norm's output
    where the model has one (``value_head``: loom.rl.ppo_objective)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        plan["norm"] = SequenceParallel()
    if is_score_head(model.output):
        plan["output"] = score_head_style()()
    elif model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if is_score_head(model._modules.get("value_head")):
        plan["value_head"] = score_head_style()()
    return plan


@functools.cache
def score_head_style() -> type:
    """The ParallelStyle of a ``dim -> 1`` head on the sequence-sharded final hidden states."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class ScoreHead(ParallelStyle):
        """Weight replicated (a DTensor: DTensor sums its Partial gradient over tp, as for the norms), run on this
        rank's positions as rows, (B * S/tp, E) -> (B * S/tp, 1) with no communication (a 3-D input sharded on the
        sequence would be flattened inside the linear, which DTensor refuses in torch 2.11); the outputs
        all-gathered into the whole (B, S, 1) on every tp rank, a plain tensor (each rank's loss is the same: its
        gradient is this rank's slice of the replicated one). What one process computes, at the cost of gathering
        one value per token."""

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            def shard_inputs(mod, inputs, mesh):
                x = inputs[0]  # (B, S/tp, E): the final norm's output (SequenceParallel)
                if isinstance(x, DTensor):
                    x = (
                        x if tuple(x.placements) == (Shard(1),) else x.redistribute(mesh, [Shard(1)])
                    ).to_local()
                mod._local_positions = x.shape[:2]
                rows = DTensor.from_local(x.reshape(-1, x.shape[-1]), mesh, [Shard(0)], run_check=False)
                return (rows, *inputs[1:])  # (B * S/tp, E) on each rank

            def whole_output(mod, out, mesh):
                batch, local = mod._local_positions
                rows = out.redistribute(mesh, [Replicate()]).to_local()  # (tp * B * S/tp, 1), rank by rank
                return (
                    rows.view(mesh.size(), batch, local, -1)
                    .transpose(0, 1)
                    .reshape(batch, mesh.size() * local, -1)
                )

            return distribute_module(module, device_mesh, input_fn=shard_inputs, output_fn=whole_output)

    return ScoreHead


def apply_tp(
    model: nn.Module,
    tp_mesh,
    *,
    loss_parallel: bool,
    async_tp: bool = False,
    expert_parallel: bool = False,
    expert_tp: bool = False,
) -> None:
    """Shard ``model`` (a Llama or a pipeline stage of one) in place over the 1-D ``tp_mesh``. The embedding is
    vocab-parallel (rows sharded; the output leaves as sequence shards), the output head column-parallel over the
    vocabulary; with ``loss_parallel`` its logits stay vocab-sharded, (B, S, V/tp), and the cross-entropy runs on
    the shards. MoE blocks: ``replicate_moe``, and their ``MoE.parallel`` sums the balance loss's expert counts
    over tp; ``expert_parallel``: the experts are left to loom.parallel.expert_parallel; ``expert_tp``
    (parallel.etp = tp): the experts sharded over tp by their hidden width (here, or by
    loom.parallel.expert_parallel together with ep), and the blocks gather the tp group's tokens and routing
    before their experts and reduce-scatter the outputs (``ExpertTensorParallel``). A ``dim -> 1`` head (a reward
    model's score head, PPO's value head) keeps its weight whole and gives the whole (B, S, 1) on every rank
    (``score_head_style``); PPO's critic model (``model.critic``) gets the policy's plan. A rename in the model would
    leave a layer unsharded: ``check_all_sharded`` makes that an error."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}  # LoRA's base
    critic = model._modules.get(
        "critic"
    )  # PPO's critic (loom.rl.ppo_objective): a Llama of the policy's shape
    for trunk in (model, critic) if critic is not None else (model,):
        _apply_trunk_tp(trunk, tp_mesh, loss_parallel, expert_parallel, expert_tp)
    par = moe_parallel(model)  # one for the MoE blocks of the policy and its critic: the tp group added once
    if par is not None:
        par.sequence_shards += ((tp_mesh.get_group(), tp_mesh.size()),)
        par.sequence_slice = (
            tp_mesh.get_group(),
            tp_mesh.size(),
        )  # the balance loss's counted tokens (RL rows)
        if expert_tp:
            par.etp = ExpertTensorParallel(tp_mesh.get_group(), tp_mesh.size())
    check_all_sharded(model, tp_mesh, skip=".experts." if expert_parallel else None)
    for (
        name,
        p,
    ) in model.named_parameters():  # SequenceParallel and replicate_moe make new Parameters trainable
        if name in frozen:
            p.requires_grad_(False)
    if async_tp:
        enable_async_tp(tp_mesh)


def _apply_trunk_tp(
    model: nn.Module, tp_mesh, loss_parallel: bool, expert_parallel: bool, expert_tp: bool
) -> None:
    """``apply_tp``'s plans on one Llama (the model, or PPO's critic inside it): its outer parts, then each block."""
    from torch.distributed.tensor.parallel import parallelize_module

    tied = (
        model.output is not None
        and model.tok_embeddings is not None
        and model.output.weight is model.tok_embeddings.weight
    )
    parallelize_module(model, tp_mesh, outer_plan(model, loss_parallel))
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_own_storage)
    if tied:
        # both plans shard the shared (V, E) weight by rows (dim 0): one DTensor serves both again
        model.output.weight = model.tok_embeddings.weight
    mtp = model._modules.get("mtp")  # DeepSeek-V3's multi-token prediction modules: a block each
    for module in mtp.values() if mtp is not None else ():
        parallelize_module(module, tp_mesh, mtp_plan())
    blocks = [*model.layers.values(), *(m.block for m in (mtp.values() if mtp is not None else ()))]
    for block in blocks:
        moe = isinstance(block.feed_forward, MoE)
        parallelize_module(block, tp_mesh, with_adapters(block, block_plan_for(block)))
        if moe:
            replicate_moe(block.feed_forward, tp_mesh, experts=not (expert_parallel or expert_tp))
            if expert_tp and not expert_parallel:
                shard_experts(block.feed_forward.experts, tp_mesh)


def _own_storage(module, args, out: torch.Tensor) -> torch.Tensor:
    """The embedding's local output as a tensor of its own. RowwiseParallel hands on ``to_local()``'s output, a view
    of a tensor that does not require grad, to which a compiled MoE block gives no gradient (docs/parallelism.md).
    One copy of (B, S/tp, E) per step."""
    return out.clone()


def check_all_sharded(model: nn.Module, tp_mesh, skip: str | None = None) -> None:
    """Every parameter must have been distributed over the tp mesh (a missed name raises here), but those
    whose name contains ``skip``."""
    from torch.distributed.tensor import DTensor

    missed = [
        n for n, p in model.named_parameters() if not isinstance(p, DTensor) and not (skip and skip in n)
    ]
    if missed:
        raise RuntimeError(
            f"tensor parallel plan missed parameters {missed}: the plan's module names no longer "
            "match the model"
        )


def enable_async_tp(tp_mesh) -> None:
    """Inductor's micro-pipeline pass decomposes all-gather + matmul and matmul + reduce-scatter into
    chunked, overlapped steps on symmetric memory (CUDA only; compiled blocks only)."""
    from torch._inductor import config as inductor_config

    inductor_config._micro_pipeline_tp = True
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    except ImportError:  # newer releases enable symmetric memory on demand
        pass


def loss_parallel_context(enabled: bool):
    """The context that lets ``F.cross_entropy`` run on vocab-sharded DTensor logits (forward and backward)."""
    import contextlib

    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def to_local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss parallel is a replicated DTensor; the trainer wants a plain tensor."""
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss

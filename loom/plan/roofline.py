"""``loom plan --roofline``: every op of a training step on one rank (the one holding the most blocks) placed on
the GPU's roofline: its FLOPs, the bytes it moves through HBM, the bytes it communicates, its arithmetic
intensity (FLOPs / HBM byte) and communication intensity (FLOPs / communicated byte), which roof bounds it
(compute, HBM or network) and the FLOP/s ceiling that roof allows.

Counting (forward + backward, per optimizer step, this rank; docs/planner.md "Roofline"):
- a matmul (T x K) @ (K x N): 6 T K N FLOPs (forward, input gradient, weight gradient); bytes 3 x (T K + K N +
  T N) elements (each of the three matmuls reads two operands and writes one), at the compute dtype;
- attention (FlashAttention, causal): FLOPs as ``loom.plan.timing.attention_flops`` (forward 2 S D per query
  token and head, backward 2.5x); bytes the compulsory traffic: forward reads Q, K, V and writes O, backward
  reads Q, K, V, O, dO and writes dQ, dK, dV (K and V of the keys a rank attends to: the whole sequence's under
  context parallelism); the tiles' re-reads are left out, so its intensity is an upper bound;
- RMSNorm: 12 FLOPs per element (4 forward, 8 backward), 5 elements moved (forward reads x, writes y; backward
  reads x and dy, writes dx); SwiGLU's gate: 15 FLOPs per element of the hidden width (5 forward, 10
  backward), 8 elements moved (3 forward, 5 backward); cross-entropy on the logits: 10 FLOPs per logit, 3
  logits' worth of bytes (read, gradient written, read once more) at 4 bytes;
- AdamW: 14 FLOPs and ``ADAMW_BYTES_PER_PARAM`` bytes per parameter this rank owns;
- collectives: the bytes this rank sends (a ring all-gather / reduce-scatter of B bytes over n ranks: B (n-1)/n;
  an all-reduce twice that), no FLOPs, at the link the group spans (``loom.plan.planner._bandwidth``).
An op's time at each roof: FLOPs / peak, bytes / HBM bandwidth, communicated bytes / link bandwidth; the largest
bounds it, and its ceiling is min(peak, intensity x HBM bandwidth, communication intensity x link bandwidth).
A MoE block: the router over the rank's routed tokens (its sequence slice under tp, the tp group's with
tensor-parallel experts), its ep share of the experts as grouped GEMMs over top_k slots per routed token (balanced
over the ep ranks; every local expert's weight read once per GEMM), the shared experts, and ep's four all-to-alls
of the slots (dispatch and combine, forward and backward; six where full checkpointing reruns the block); multi-head
latent attention: its five matmuls, and attention at the mean of the query/key and value widths. Without a pipeline's per-stage detail (the busiest
rank's blocks) and without DeepSeek's multi-token-prediction modules.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass

from loom.config.errors import ConfigError
from loom.config.sections import Config
from loom.plan.hardware import GPU
from loom.plan.memory import BYTES, held_params
from loom.plan.timing import ADAMW_BYTES_PER_PARAM, attention_flops, recompute_share

NORM_FLOPS, NORM_ELEMENTS = 12, 5
SWIGLU_FLOPS, SWIGLU_ELEMENTS = 15, 8
CROSS_ENTROPY_FLOPS, CROSS_ENTROPY_BYTES = 10, 3 * 4
ADAMW_FLOPS = 14


@dataclass
class Op:
    """One op of the step on this rank, summed over its calls (``count``: blocks x micro-batches, ...)."""

    name: str
    count: int
    flops: float
    hbm_bytes: float
    comm_bytes: float = 0.0
    comm_gbps: float = 0.0  # the link its bytes cross

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per HBM byte (inf without HBM traffic)."""
        return self.flops / self.hbm_bytes if self.hbm_bytes else math.inf

    @property
    def comm_intensity(self) -> float:
        """FLOPs per communicated byte (inf for an op that communicates nothing)."""
        return self.flops / self.comm_bytes if self.comm_bytes else math.inf

    def times(self, gpu: GPU, dtype: str) -> dict[str, float]:
        """Seconds at each roof: compute, HBM, network."""
        network = self.comm_bytes / (self.comm_gbps * 1e9) if self.comm_bytes else 0.0
        return {
            "compute": self.flops / gpu.peak(dtype),
            "HBM": self.hbm_bytes / (gpu.hbm_tbps * 1e12),
            "network": network,
        }

    def bound(self, gpu: GPU, dtype: str) -> str:
        times = self.times(gpu, dtype)
        return max(times, key=times.get)

    def ceiling(self, gpu: GPU, dtype: str) -> float:
        """The FLOP/s this op can reach at best: min(peak, intensity x HBM, communication intensity x link)
        (0 for an op without FLOPs: a collective)."""
        if not self.flops:
            return 0.0
        roofs = [gpu.peak(dtype), self.intensity * gpu.hbm_tbps * 1e12]
        if self.comm_bytes:
            roofs.append(self.comm_intensity * self.comm_gbps * 1e9)
        return min(roofs)

    def seconds(self, gpu: GPU, dtype: str) -> float:
        """The op's time at its binding roof (the roofline's lower bound on its time)."""
        return max(self.times(gpu, dtype).values())


def matmul(name: str, count: int, tokens: float, k: float, n: float, c: int) -> Op:
    """``count`` matmuls (tokens x k) @ (k x n), forward and backward (see the module docstring)."""
    return Op(name, count, count * 6 * tokens * k * n, count * 3 * (tokens * k + k * n + tokens * n) * c)


def collective(name: str, count: int, nbytes: float, ranks: int, gbps: float, all_reduce: bool = False) -> Op:
    """``count`` ring collectives of a ``nbytes`` tensor over ``ranks`` ranks: what this rank sends."""
    sent = nbytes * (ranks - 1) / ranks * (2 if all_reduce else 1)
    return Op(name, count, 0.0, 0.0, count * sent, gbps)


def _ops(cfg, dims, args, m, x, shares, link) -> tuple[list[Op], dict]:
    """The step's ops on the rank holding the most blocks; ``link(axes)``: the GB/s of a group over mesh axes."""
    t = cfg.training
    share = max(shares, key=lambda s: (s.layers, any(s.last)))
    c = BYTES[t.dtype]
    tp, cp = dims.tp, dims.cp
    # per micro-batch on this rank (whole, as the matmuls see them under SP)
    tokens = x.micro_batch * t.seq_len / cp
    rec_mm, rec_attn = recompute_share(t.activation_checkpointing, t.ac_every, args.n_layers)
    n = share.layers * m  # block calls per step
    n_moe = sum(args.moe_layer(i) for stage in share.stages for i in stage) * m  # of them with experts
    e, hq, hkv, f = args.dim, args.n_heads, args.n_kv_heads, args.ffn_dim
    ops = _attention_matmuls(args, n, tokens, tp, c)
    if n > n_moe:  # dense SwiGLU blocks
        ops += [
            matmul("w1 (gate)", n - n_moe, tokens, e, f / tp, c),
            matmul("w3 (up)", n - n_moe, tokens, e, f / tp, c),
            matmul("w2 (down)", n - n_moe, tokens, f / tp, e, c),
        ]
    if n_moe:
        ops += _moe_matmuls(args, dims, n_moe, tokens, c)
    if rec_mm:  # recomputation's extra forward matmuls, as a share of forward + backward
        for op in ops:
            op.flops, op.hbm_bytes = op.flops * (1 + rec_mm), op.hbm_bytes * (1 + rec_mm)
    keys = t.seq_len  # the keys a rank's queries attend over (all of them under cp)
    qk, v = (
        (args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim) if args.mla else (args.head_dim,) * 2
    )
    # the scores use the query / key width, the weighted sum the value width: their mean as attention's one width
    attn_flops = attention_flops(1, hq / tp, (qk + v) / 2, t.seq_len, tokens, args.sliding_window)
    kv_heads = hq if args.mla else hkv  # MLA expands its latent into every head's K and V
    q, o = tokens * hq * qk / tp, tokens * hq * v / tp  # elements of Q (dQ) and O (dO)
    k, vv = keys * kv_heads * qk / tp, keys * kv_heads * v / tp  # elements of K (dK) and V (dV)
    # forward reads Q, K, V and writes O; backward reads Q, K, V, O, dO and writes dQ, dK, dV
    attn_bytes = 3 * (q + o + k + vv) * c * (1 + rec_attn)
    ops.append(Op("attention", n, n * attn_flops * (1 + rec_attn), n * attn_bytes))
    ops.append(Op("rmsnorm", 2 * n, 2 * n * NORM_FLOPS * tokens * e, 2 * n * NORM_ELEMENTS * tokens * e * c))
    if n > n_moe:
        d = n - n_moe
        ops.append(
            Op(
                "swiglu gate",
                d,
                d * SWIGLU_FLOPS * tokens * f / tp,
                d * SWIGLU_ELEMENTS * tokens * f / tp * c,
            )
        )
    if n_moe:
        slots, width = _slots(args, dims, tokens), args.expert_ffn_dim / dims.etp
        ops.append(
            Op(
                "experts swiglu gate",
                n_moe,
                n_moe * SWIGLU_FLOPS * slots * width,
                n_moe * SWIGLU_ELEMENTS * slots * width * c,
            )
        )
    if any(share.last):
        v = args.vocab_size
        ops.append(matmul("head", m, tokens, e, v / tp, c))
        ops.append(Op("final rmsnorm", m, m * NORM_FLOPS * tokens * e, m * NORM_ELEMENTS * tokens * e * c))
        ops.append(
            Op(
                "cross-entropy",
                m,
                m * CROSS_ENTROPY_FLOPS * tokens * v / tp,
                m * CROSS_ENTROPY_BYTES * tokens * v / tp,
            )
        )
    own = held_params(share, x) / x.shard
    ops.append(Op("adamw", 1, ADAMW_FLOPS * own, ADAMW_BYTES_PER_PARAM * own))
    ops += _collectives(cfg, dims, args, m, x, share, tokens, n, link)
    return ops, {"blocks": share.layers, "micro_batches": m, "tokens_per_micro_batch": tokens}


def _attention_matmuls(args, n: int, tokens: float, tp: int, c: int) -> list[Op]:
    """The attention's matmuls: q/k/v/o of grouped-query attention, or multi-head latent attention's query
    (compressed: ``wq_a`` then ``wq_b``), latent + RoPE key ``wkv_a``, per-head up-projection ``wkv_b`` and ``wo``
    (the compressions replicated under tp, the rest split by heads)."""
    e, h = args.dim, args.n_heads
    if not args.mla:
        hd, hkv = args.head_dim, args.n_kv_heads
        return [
            matmul("wq", n, tokens, e, h * hd / tp, c),
            matmul("wk", n, tokens, e, hkv * hd / tp, c),
            matmul("wv", n, tokens, e, hkv * hd / tp, c),
            matmul("wo", n, tokens, h * hd / tp, e, c),
        ]
    qk, v = args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    if args.q_lora_rank:
        query = [
            matmul("wq_a", n, tokens, e, args.q_lora_rank, c),
            matmul("wq_b", n, tokens, args.q_lora_rank, h * qk / tp, c),
        ]
    else:
        query = [matmul("wq", n, tokens, e, h * qk / tp, c)]
    return query + [
        matmul("wkv_a", n, tokens, e, args.kv_lora_rank + args.qk_rope_head_dim, c),
        matmul("wkv_b", n, tokens, args.kv_lora_rank, h * (args.qk_nope_head_dim + v) / tp, c),
        matmul("wo", n, tokens, h * v / tp, e, c),
    ]


def _slots(args, dims, tokens: float) -> float:
    """Token-slots a rank's experts compute per MoE block and micro-batch: its routed tokens (its sequence slice
    under tp, the tp group's with tensor-parallel experts) x top_k, balanced over the ep ranks."""
    return tokens / (dims.tp // dims.etp) * args.moe_top_k


def grouped_matmul(name: str, count: int, slots: float, k: float, n: float, experts: float, c: int) -> Op:
    """``count`` grouped GEMMs of ``slots`` rows over ``experts`` (k x n) weights, forward and backward: the
    FLOPs of one (slots x k) @ (k x n) matmul, the bytes of every expert's weight read (and its gradient
    written) once per GEMM."""
    return Op(
        name, count, count * 6 * slots * k * n, count * 3 * (slots * k + experts * k * n + slots * n) * c
    )


def _moe_matmuls(args, dims, count: int, tokens: float, c: int) -> list[Op]:
    """A MoE block's matmuls on this rank: the router over its routed tokens, its ep share of the experts' grouped
    GEMMs (each expert's width / etp) over the slots it receives, and the shared experts (replicated under tp)."""
    routed = tokens / (dims.tp // dims.etp)
    slots, width, local = (
        _slots(args, dims, tokens),
        args.expert_ffn_dim / dims.etp,
        args.moe_experts / dims.ep,
    )
    ops = [
        matmul("router", count, routed, args.dim, args.moe_experts, c),
        grouped_matmul("experts w1 (gate)", count, slots, args.dim, width, local, c),
        grouped_matmul("experts w3 (up)", count, slots, args.dim, width, local, c),
        grouped_matmul("experts w2 (down)", count, slots, width, args.dim, local, c),
    ]
    shared = args.moe_shared_experts * args.expert_ffn_dim
    if shared:
        ops += [
            matmul("shared w1 (gate)", count, routed, args.dim, shared, c),
            matmul("shared w3 (up)", count, routed, args.dim, shared, c),
            matmul("shared w2 (down)", count, routed, shared, args.dim, c),
        ]
    return ops


def _collectives(cfg, dims, args, m, x, share, tokens, n, link) -> list[Op]:
    """The step's collectives on this rank, each at the bandwidth of the link its group spans."""
    t, c = cfg.training, BYTES[cfg.training.dtype]
    out: list[tuple[Op, tuple]] = []
    params = held_params(share, x)
    if dims.fsdp_enabled and x.shard > 1:
        gathers = 2 if x.reshard_after_forward else 1
        out.append((collective("fsdp all-gather", gathers * m, c * params, x.shard, 0), ("dp_shard", "cp")))
        out.append((collective("fsdp reduce-scatter", m, 4 * params, x.shard, 0), ("dp_shard", "cp")))
    if dims.dp_replicate > 1:
        grads = 4 * params / (x.shard if dims.fsdp_enabled else 1)
        out.append(
            (
                collective(
                    "dp all-reduce",
                    1 if not dims.fsdp_enabled else m,
                    grads,
                    dims.dp_replicate,
                    0,
                    all_reduce=True,
                ),
                ("dp_replicate",),
            )
        )
    recomputed = t.activation_checkpointing == "full"
    if dims.tp > 1:
        count = n * (8 + (4 if recomputed else 0))
        out.append(
            (collective("tp all-gather / reduce-scatter", count, tokens * args.dim * c, dims.tp, 0), ("tp",))
        )
    if dims.cp > 1:
        kv = x.micro_batch * t.seq_len * 2 * args.n_kv_heads * args.head_dim * c / dims.tp
        if cfg.parallel.cp_method == "ring":
            block = kv / dims.cp
            sends = (dims.cp - 1) * (2 if recomputed else 1) + (dims.cp - 1)
            out.append((Op("cp ring K/V sends", n, 0.0, 0.0, n * sends * block), ("cp",)))
            out.append((Op("cp ring dK/dV sends", n, 0.0, 0.0, n * dims.cp * block * 4 / c), ("cp",)))
        else:
            count = n * (2 + (1 if recomputed else 0))
            out.append((collective("cp K/V all-gather / reduce-scatter", count, kv, dims.cp, 0), ("cp",)))
    if dims.pp > 1:
        act = tokens * args.dim * c
        out.append(
            (
                Op("pp send / recv", 2 * m * len(share.stages), 0.0, 0.0, 2 * m * len(share.stages) * act),
                ("pp",),
            )
        )
    n_moe = sum(args.moe_layer(i) for stage in share.stages for i in stage) * m
    if (
        n_moe and dims.ep > 1
    ):  # the token-slots to their experts' ranks and back (loom.parallel.expert_parallel)
        from loom.plan.planner import exchange_rerun

        slots = _slots(args, dims, tokens) * args.dim * c
        # dispatch and combine, forward and backward, and again where a block is recomputed in full
        count = round(n_moe * (4 + 2 * exchange_rerun(t.activation_checkpointing, t.ac_every, args.n_layers)))
        out.append((collective("ep all-to-all (dispatch, combine)", count, slots, dims.ep, 0), ("ep",)))
    if (
        n_moe and dims.etp > 1
    ):  # tensor-parallel experts: the tp group's tokens gathered, outputs reduce-scattered
        from loom.plan.planner import moe_rerun

        count = round(n_moe * (4 + 2 * moe_rerun(t.activation_checkpointing, t.ac_every, args.n_layers)))
        out.append(
            (collective("etp all-gather / reduce-scatter", count, tokens * args.dim * c, dims.tp, 0), ("tp",))
        )
    for op, axes in out:
        op.comm_gbps = link(axes)
    return [op for op, _ in out]


def roofline(cfg: Config, world_size: int, gpu: GPU) -> tuple[list[Op], dict]:
    """The ops of one optimizer step on the busiest rank of ``cfg`` on ``world_size`` GPUs of kind ``gpu`` (each
    collective at NVLink or network bandwidth, by where its group's ranks sit), and what they were counted for:
    blocks, micro-batches, tokens per micro-batch, the machine balance (peak / HBM bandwidth, FLOP per byte)."""
    from loom.plan.planner import _bandwidth, memory_inputs, validate
    from loom.plan.shapes import rank_shares

    dims, args, m = validate(cfg, world_size)
    x = memory_inputs(cfg, dims, args)
    # an ep group spans ep ranks of dp_shard x cp with the tp ranks inside it (as the planner's step time)
    ep_gbps = gpu.network_gbps if dims.ep * dims.etp > gpu.gpus_per_node else gpu.link_gbps
    ops, what = _ops(
        cfg,
        dims,
        args,
        m,
        x,
        rank_shares(args, dims.pp, cfg.parallel, cfg.training.seq_len),
        lambda axes: ep_gbps if axes == ("ep",) else _bandwidth(dims, axes, gpu),
    )
    what["machine_balance"] = gpu.peak(cfg.training.dtype) / (gpu.hbm_tbps * 1e12)
    return ops, what


def table(ops: list[Op], gpu: GPU, dtype: str) -> str:
    """The roofline as a markdown table, one row per op, and the step's sum."""
    rows = [
        "| op | calls | GFLOP | HBM GB | comm GB | FLOP/B (HBM) | FLOP/B (comm) | bound | ceiling TFLOP/s | "
        "ms at its roof |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def num(v: float, fmt: str) -> str:
        return (
            "-" if math.isinf(v) or (v == 0 and fmt != "ms") else format(v, ".1f" if fmt != "ms" else ".2f")
        )

    for op in ops:
        ceiling = op.ceiling(gpu, dtype)
        rows.append(
            f"| {op.name} | {op.count} | {num(op.flops / 1e9, '')} | {num(op.hbm_bytes / 1e9, '')} | "
            f"{num(op.comm_bytes / 1e9, '')} | {num(op.intensity, '')} | {num(op.comm_intensity, '')} | "
            f"{op.bound(gpu, dtype)} | {num(ceiling / 1e12, '') if ceiling else '-'} | "
            f"{op.seconds(gpu, dtype) * 1e3:.2f} |"
        )
    total = sum(op.seconds(gpu, dtype) for op in ops)
    flops, hbm = sum(o.flops for o in ops), sum(o.hbm_bytes for o in ops)
    rows.append(
        f"| **sum** (no overlap) | | {flops / 1e9:.1f} | {hbm / 1e9:.1f} | "
        f"{sum(o.comm_bytes for o in ops) / 1e9:.1f} | | | | | {total * 1e3:.2f} |"
    )
    return "\n".join(rows)


def measured_step(path: str, ops: list[Op], tokens_per_step: int, gpu: GPU, dtype: str) -> dict:
    """The step's point from a run's ``metrics.jsonl`` (``--metrics``; the run of the same config and GPU count):
    the median step time over its training records (the first one left out when there are more: compilation and
    warm-up), from ``tokens_per_s`` and the step's ``tokens_per_step``; the FLOP/s it reached on the busiest rank
    (the roofline's FLOPs over that time) at the step's arithmetic intensity; and the share of the no-overlap
    roofline bound (the sum of the ops' times at their roofs) it reached."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except OSError as err:
        raise ConfigError(
            "--metrics", path, f"cannot be read ({err.strerror}); a run's metrics.jsonl"
        ) from None
    records = []
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError("--metrics", path, f"line {i} is not JSON; a run's metrics.jsonl") from None
        if (
            isinstance(rec, dict)
            and isinstance(rec.get("tokens_per_s"), (int, float))
            and rec["tokens_per_s"] > 0
        ):
            records.append(rec)
    if not records:
        raise ConfigError(
            "--metrics", path, "has no training record with tokens_per_s; a run's metrics.jsonl"
        )
    timed = records[1:] if len(records) > 1 else records
    step_s = statistics.median(tokens_per_step / r["tokens_per_s"] for r in timed)
    flops, hbm = sum(op.flops for op in ops), sum(op.hbm_bytes for op in ops)
    bound_s = sum(op.seconds(gpu, dtype) for op in ops)
    mfus = [r["mfu"] for r in timed if isinstance(r.get("mfu"), (int, float))]
    return {
        "records": len(timed),
        "first_step": timed[0].get("step"),
        "step_s": step_s,
        "flops_per_s": flops / step_s,
        "intensity": flops / hbm,
        "roofline_bound_s": bound_s,
        "of_bound": bound_s / step_s,
        "mfu": statistics.median(mfus) if mfus else None,
    }

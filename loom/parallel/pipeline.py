"""Pipeline parallelism on ``torch.distributed.pipelining``: stage split, stage modules, schedules, bubble.

* ``split_layers`` cuts the layers into contiguous stages, balanced by training FLOPs per token, the
  embedding and the output head counted with the first and last stage; or takes a manual split.
* ``stage_ids`` says which stages a pp rank holds: ``r, r + p, ...`` (loop) or ``r, 2p - 1 - r`` (V).
* ``build_stage`` prunes a copy of the (meta) model to one stage: the model code does not change; the last
  stage holds the head, DeepSeek-V3's multi-token prediction modules and, for them or a tied head, a copy of the
  embedding.
* ``forward_chain`` runs one micro-batch forward through every stage in order (validation of the V-shaped
  schedules, whose forward-only run in torch fails).
* ``theoretical_bubble`` replays a schedule's per-rank action order with unit costs and reports the
  idle fraction: idle time / (ranks x makespan).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from loom.metrics.flops import attention_matmul_params

# loom name -> torch.distributed.pipelining class name
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
    "pipedream_2bw": None,  # loom's own runtime (loom.parallel.pipedream): torch's schedules drain every step
}
SINGLE_STAGE = ("gpipe", "1f1b", "pipedream_2bw")  # one stage per rank
# no flush between steps, two weight versions (loom.parallel.pipedream: its own runtime, not a torch schedule)
TWO_BW = "pipedream_2bw"
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank, in a V
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")  # input and weight gradients computed apart


def stages_per_rank(parallel) -> int:
    """Pipeline stages each pp rank holds: ``parallel.pp_virtual_stages`` or the schedule's own."""
    if parallel.pp_virtual_stages:
        return parallel.pp_virtual_stages
    return 1 if parallel.pp_schedule in SINGLE_STAGE else 2


# ---- the split ----------------------------------------------------------------------


def layer_cost(args, seq_len: int) -> float:
    """Training FLOPs per token of one block: 6 x matmul parameters + causal attention scores (grouped-query or
    latent attention: ``loom.metrics.flops.attention_matmul_params``)."""
    attn = attention_matmul_params(args)
    mlp = 3 * args.dim * args.ffn_dim
    qk_v = args.head_dim + args.value_head_dim  # scores over q/k, the sum over v
    return 6 * (attn + mlp) + 3 * args.n_heads * qk_v * seq_len  # QK^T and AV, causal half, x3


def head_cost(args) -> float:
    """Output projection (6 x E x V) plus the softmax/cross-entropy over the vocabulary (~10 x V)."""
    return 6 * args.dim * args.vocab_size + 10 * args.vocab_size


def embedding_cost(args) -> float:
    """A row gather forward and a scatter-add backward: memory work, about 2 x E per token."""
    return 2 * args.dim


def split_layers(args, n_stages: int, seq_len: int, manual: list[int] | None = None) -> list[list[int]]:
    """Layer indices of each stage (contiguous, in order)."""
    n = args.n_layers
    if manual:  # checked against the stage count and the model by loom.resolve
        counts = list(manual)
    else:
        counts = balanced_counts(
            n, n_stages, layer_cost(args, seq_len), embedding_cost(args), head_cost(args)
        )
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def balanced_counts(
    n_layers: int, n_stages: int, layer: float, first_extra: float, last_extra: float
) -> list[int]:
    """Layers per stage (each >= 1) minimizing the most expensive stage; ties go to the earliest stages
    holding more (later stages then hold fewer activations in 1F1B). Dynamic programming over cut points."""
    if n_stages > n_layers:  # a user's config is refused earlier (loom.resolve.check_model)
        raise ValueError(f"{n_stages} stages for {n_layers} layers")

    def cost(stage: int, count: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == n_stages - 1 else 0.0)
        return count * layer + extra

    # best[s][k]: the smallest max stage cost placing the first k layers in stages 0..s-1
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    choice = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for k in range(s, n_layers - (n_stages - s) + 1):
            for c in range(k - (s - 1), 0, -1):  # larger first: ties keep the larger early stage
                val = max(best[s - 1][k - c], cost(s - 1, c))
                if val < best[s][k] - 1e-9 * abs(val):
                    best[s][k], choice[s][k] = val, c
    counts, k = [], n_layers
    for s in range(n_stages, 0, -1):
        counts.append(choice[s][k])
        k -= choice[s][k]
    return counts[::-1]


def stage_ids(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """Stages held by ``pp_rank``, in the order the schedule expects them."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def stage_rank(stage: int, pp: int, schedule: str) -> int:
    """The pp rank that holds ``stage``."""
    if schedule in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


# ---- stage modules ------------------------------------------------------------------------


def build_stage(model, layers: list[int], first: bool, last: bool):
    """A copy of the meta-device ``model`` keeping only this stage's parts (names unchanged).

    The last stage keeps ``tok_embeddings`` where it reads the embedding (``last_stage_embeds``: the weight a tied
    head shares, the one DeepSeek-V3's multi-token prediction modules embed with), a copy of the first stage's with
    the same name (``tok_embeddings.weight``) in every layout and checkpoint (loom.train.grads.TiedEmbeddingGrads
    keeps the two equal). The MTP modules (``mtp``) sit on the last stage, beside the norm and head they share."""
    stage = copy.deepcopy(model)
    keep = {str(i) for i in layers}
    for name in list(stage.layers.keys()):
        if name not in keep:
            del stage.layers[name]
    if not first and not (last and last_stage_embeds(model.args)):
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
        if getattr(stage, "mtp", None) is not None:
            stage.mtp = None
    return stage


def last_stage_embeds(args) -> bool:
    """Whether the last stage holds a copy of the embedding: a tied head, or multi-token prediction's modules."""
    return bool(args.tie_embeddings or getattr(args, "mtp_depth", 0))


def last_stage_inputs(args, inputs, labels) -> dict:
    """The keywords the schedule gives every stage for the last stage's forward (the others ignore them): the
    micro-batches' token ids and labels (M x B, S), which multi-token prediction embeds and predicts k tokens ahead
    (loom.models.deepseek_v3.model.DeepSeekV3.forward); {} without it."""
    if not getattr(args, "mtp_depth", 0):
        return {}
    return {"mtp_tokens": inputs, "mtp_labels": labels}


# ---- schedules ------------------------------------------------------------------------------


@dataclass
class PipelinePlan:
    """What a pp rank runs: the stage split and this rank's stages."""

    schedule: str
    pp: int
    per_rank: int
    layers: list[list[int]]  # layer indices of every stage
    local: list[int]  # this rank's stage indices

    @property
    def n_stages(self) -> int:
        return self.pp * self.per_rank

    @property
    def has_first(self) -> bool:
        return 0 in self.local

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.local

    def describe(self) -> str:
        return "; ".join(
            f"stage {s} (rank {stage_rank(s, self.pp, self.schedule)}): layers "
            f"{_span(self.layers[s])}{' + embedding' if s == 0 else ''}"
            f"{' + head' if s == self.n_stages - 1 else ''}"
            for s in range(self.n_stages)
        )


def _span(ids: list[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if ids else "none"


class BusyClock:
    """Time spent computing on this rank's stages within a window (a step): device events around every
    forward / backward chunk on CUDA, the host clock on CPU. Idle = 1 - busy / window: the bubble plus
    any exposed communication."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self._event = (lambda: torch.cuda.Event(enable_timing=True)) if self.cuda else None
        self.spans: list[tuple] = []
        self.window: tuple | None = None

    def now(self):
        import time

        if not self.cuda:
            return time.perf_counter()
        ev = self._event()
        ev.record()
        return ev

    def _seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def start(self) -> None:
        self.spans, self.window = [], (self.now(), None)

    def stop(self) -> None:
        self.window = (self.window[0], self.now())

    def idle_fraction(self) -> float:
        """Read after ``stop`` (synchronizes the device)."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        total = self._seconds(*self.window)
        busy = sum(self._seconds(a, b) for a, b in self.spans)
        return max(0.0, 1.0 - busy / total) if total > 0 else 0.0


def _timed_stage_class():
    import torch
    from torch.distributed.pipelining import PipelineStage

    from loom.models.common.moe import forget_routing

    class TimedStage(PipelineStage):
        """A PipelineStage whose compute chunks are timed by a shared ``BusyClock``, and which keeps a
        split-backward chunk's autograd graph alive from its input-gradient pass to its weight pass.

        torch's input pass detaches the stage outputs, leaving the graph held only by the gradient edges
        it saved, which do not keep a Python autograd node (our custom ops' autograd is one) alive: the weight
        pass would meet a freed node (docs/parallelism.md). Holding the outputs' ``grad_fn`` until the weight pass
        keeps every node of the chunk alive."""

        clock: BusyClock

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.held_graphs: dict[
                int, list
            ] = {}  # chunk -> grad_fn of its outputs, input pass -> weight pass

        def _timed(self, fn, *args, **kwargs):
            start = self.clock.now()
            out = fn(*args, **kwargs)
            self.clock.spans.append((start, self.clock.now()))
            return out

        def forward_one_chunk(self, *args, **kwargs):
            return self._timed(super().forward_one_chunk, *args, **kwargs)

        def _prepare_forward_infra(self, *args, **kwargs):
            # a first run infers the shapes by a forward on placeholder inputs: what its MoE blocks routed is
            # no step's load (the selection bias would move by it), so it is forgotten before the real chunks
            out = super()._prepare_forward_infra(*args, **kwargs)
            forget_routing(self.submod)
            return out

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            if not full_backward and self.has_backward:
                outputs = [loss] if self.is_last else self.fwd_cache[bwd_chunk_id][0]
                self.held_graphs[bwd_chunk_id] = [
                    t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None
                ]
            return self._timed(
                super().backward_one_chunk,
                bwd_chunk_id,
                loss=loss,
                full_backward=full_backward,
                last_backward=last_backward,
            )

        def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            try:
                return self._timed(super().backward_weight_one_chunk, bwd_chunk_id, *args, **kwargs)
            finally:
                self.held_graphs.pop(bwd_chunk_id, None)

    return TimedStage


def build_schedule(
    plan: PipelinePlan, stage_modules: list, pp_group, device, n_microbatches: int, loss_fn, clock: BusyClock
):
    """The torch schedule over this rank's stages. ``loss_fn`` returns each micro-batch's loss already
    scaled to its share of the global batch, so the schedule must not divide gradients again."""
    from torch.distributed import pipelining

    cls_stage = _timed_stage_class()
    stages = []
    for mod, s in zip(stage_modules, plan.local):
        stage = cls_stage(mod, stage_index=s, num_stages=plan.n_stages, device=device, group=pp_group)
        stage.clock = clock
        stages.append(stage)
    cls = getattr(pipelining, SCHEDULES[plan.schedule])
    if plan.schedule in ("gpipe", "1f1b"):
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


# ---- forward-only, stage by stage -----------------------------------------------------------

_WIRE_DTYPES = ("float32", "bfloat16", "float16")


def forward_chain(plan: PipelinePlan, stage_modules: list, pp_group, x, device, positions=None):
    """One micro-batch forward through every stage in order, each stage on its rank, hidden states passed
    point to point (a shape header first): validation for the V-shaped schedules, whose forward-only run in
    torch.distributed.pipelining fails. ``x``: the (B, S) token ids (used by the rank holding stage 0);
    ``positions``: (B, S) per-document positions or None, given to every stage.
    Returns the last stage's output on the rank holding it, None on the others."""
    import torch.distributed as dist

    me = dist.get_rank(pp_group)
    local = dict(zip(plan.local, stage_modules))
    h = None
    for s in sorted(local):
        if s == 0:
            h = x
        elif stage_rank(s - 1, plan.pp, plan.schedule) != me:
            h = _recv_hidden(pp_group, stage_rank(s - 1, plan.pp, plan.schedule), device)
        h = local[s](h, positions)
        nxt = s + 1
        if nxt < plan.n_stages and stage_rank(nxt, plan.pp, plan.schedule) != me:
            _send_hidden(h, pp_group, stage_rank(nxt, plan.pp, plan.schedule))
    return h if plan.has_last else None


def _send_hidden(h, group, dst: int, tag: int = 0, wait: bool = True):
    """A shape header, then ``h``; ``wait`` false: sent asynchronously, returns [(work, tensor)] to keep alive."""
    import torch
    import torch.distributed as dist

    h = h.contiguous()
    header = torch.zeros(8, dtype=torch.int64, device=h.device)  # ndim, dtype, shape...
    header[0], header[1] = h.dim(), _WIRE_DTYPES.index(str(h.dtype).removeprefix("torch."))
    header[2 : 2 + h.dim()] = torch.tensor(h.shape)
    if wait:
        dist.send(header, group=group, group_dst=dst, tag=tag)
        dist.send(h, group=group, group_dst=dst, tag=tag)
        return []
    return [(dist.isend(t, group=group, group_dst=dst, tag=tag), t) for t in (header, h)]


def _recv_hidden(group, src: int, device, tag: int = 0):
    import torch
    import torch.distributed as dist

    header = torch.zeros(8, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=src, tag=tag)
    ndim, dtype = int(header[0]), getattr(torch, _WIRE_DTYPES[int(header[1])])
    h = torch.empty([int(d) for d in header[2 : 2 + ndim]], dtype=dtype, device=device)
    dist.recv(h, group=group, group_src=src, tag=tag)
    return h


# ---- the bubble ------------------------------------------------------------------------------

FORMULAS = {
    "gpipe": "(p-1)/(m+p-1)",
    "1f1b": "(p-1)/(m+p-1)",
    "interleaved_1f1b": "(p-1)/(v*m+p-1)",
    "looped_bfs": "(p-1)/(v*m+p-1)",
    TWO_BW: "(p-1)/(T*m+p-1), T = the run's steps (filled and drained once per run)",
}


def schedule_actions(schedule: str, pp: int, m: int, per_rank: int) -> list[list[tuple[str, int, int]]]:
    """Per pp rank, the compute actions in order: (kind F|B|I|W, stage, micro-batch)."""
    if schedule in SINGLE_STAGE:  # a 2BW step holds 1F1B's micro-batches in flight: its actions within a step
        return [
            _single_stage_actions("gpipe" if schedule == "gpipe" else "1f1b", r, pp, m) for r in range(pp)
        ]
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(SCHEDULES[schedule].removeprefix("Schedule"), pp, m, num_stages_per_rank=per_rank)
    out = []
    for rank_ops in ops:
        acts = []
        for a in rank_ops:
            if a is None:
                continue
            for sub in a.sub_actions or (a,):  # OVERLAP_F_B: an F and a B run together
                kind = sub.computation_type.value
                if kind in ("F", "B", "I", "W"):
                    acts.append((kind, sub.stage_index, sub.microbatch_index))
        out.append(acts)
    return out


def _single_stage_actions(schedule: str, rank: int, pp: int, m: int) -> list[tuple[str, int, int]]:
    if schedule == "gpipe":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    warm = min(pp - 1 - rank, m)
    acts = [("F", rank, i) for i in range(warm)]
    f = warm
    for b in range(m):
        if f < m:
            acts.append(("F", rank, f))
            f += 1
        acts.append(("B", rank, b))
    return acts


def theoretical_bubble(schedule: str, pp: int, m: int, per_rank: int, steps: int = 1) -> float:
    """Idle fraction of the schedule with forward = 1, full backward = 2 (input 1 + weight 1) per stage
    and free communication: 1 - busy / (pp x makespan). pipedream_2bw: over a run of ``steps`` steps
    (``twobw_bubble``); the other schedules flush at every step, so a step's fraction is the run's."""
    if schedule == TWO_BW:
        return twobw_bubble(pp, m, steps)
    return simulated_bubble(schedule_actions(schedule, pp, m, per_rank), pp * per_rank, schedule)


def simulated_bubble(actions: list[list[tuple[str, int, int]]], n_stages: int, name: str = "") -> float:
    """Idle fraction of per-rank action lists (``schedule_actions``' form) run with unit costs (F = 1, B = 2,
    I = W = 1), each action starting once its rank is free and its inputs are done."""
    pp = len(actions)
    cost = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * pp
    pos = [0] * pp
    busy = sum(cost[k] for acts in actions for k, _, _ in acts)
    while any(pos[r] < len(actions[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(actions[r]):
                kind, s, i = actions[r][pos[r]]
                deps = _deps(kind, s, i, n_stages)
                if not all(d in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = start + cost[kind]
                done[(kind if kind != "I" else "B", s, i)] = clock[r]
                if kind == "W":
                    done[("W", s, i)] = clock[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {name} ({pp} ranks) deadlocks in the simulation")
    return 1.0 - busy / (pp * max(clock))


def _deps(kind: str, s: int, i: int, n_stages: int) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    if kind in ("B", "I"):
        return [("F", s, i)] + ([("B", s + 1, i)] if s < n_stages - 1 else [])
    return [("B", s, i)]  # W after the input gradient of the same stage and micro-batch


def twobw_bubble(pp: int, m: int, steps: int) -> float:
    """pipedream_2bw's idle fraction over a ``steps``-step run (F = 1, B = 2, free communication): one 1F1B stream
    of steps x m micro-batches, filled and drained once, (p-1) / (steps*m + p-1), where 1F1B pays (p-1) / (m+p-1)
    at every step; the steady state (many steps) has none. ``theoretical_bubble("1f1b", pp, steps * m, 1)`` is the
    same stream simulated."""
    return (pp - 1) / (steps * m + pp - 1)

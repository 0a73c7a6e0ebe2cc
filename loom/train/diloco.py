"""DiLoCo: low-communication data parallelism (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models"), with the streaming variant's fragments (Douillard et al. 2025, "Streaming DiLoCo").

The groups along ``dp_replicate`` train apart: each takes H inner optimizer steps with gradients reduced only inside
the group (``ParallelDims.replicate_reduces`` is false, so FSDP2 shards over ``dp_shard x cp`` alone and no DDP
wraps the model). Every H steps the pseudo-gradient ``outer - current`` (the weights at the round's start minus the
group's weights now) is averaged over the groups with one all-reduce over the ``dp_replicate`` axis, the outer
optimizer (Nesterov SGD) steps the outer weights with it, and every group continues from the new outer weights.
Each group keeps its inner optimizer state. With ``fragments`` F > 1 the parameters are cut into F contiguous,
about equal fragments; fragment f synchronizes at steps ``(f + 1)·H / F + k·H``, so the traffic of a round is
spread over it.

With ``overlap_steps`` tau > 0 (Streaming DiLoCo's overlapping communication) a fragment's all-reduce is launched
asynchronously at its synchronization step and the inner steps go on; after step ``launch + tau`` it is waited for,
the outer step is taken from the fragment's start-of-round weights with it, and each group's weights become
``alpha·local + (1 − alpha)·outer``: the local progress of the tau overlapped steps mixed into the new outer weights
(the paper's mixing factor; 0 = take the outer weights). The reduction runs on a process group of its own over the
same ranks, so the per-step collectives on the replica group (the skip verdict) do not queue behind it.

The checkpoint holds: ``model`` = the outer weights (the same on every group: what the groups agree on, and what
an export reads), ``diloco_momentum`` = the outer momentum, and each group's current weights and inner optimizer
state under ``diloco_replica_<r>``; the position in the round is the step count (``H`` and the groups are in
``trainer_state.json``), so a resume inside a round continues exactly. With tau > 0 a save waits for the reductions
in flight and writes their averaged pseudo-gradients as ``diloco_pending`` (zeros for the fragments not in flight);
which fragments are pending, and when they are due, follows from the step, so a resume mid-overlap applies them at
the same steps as the uninterrupted run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loom.checkpoint.manager import STATE
from loom.config.errors import ConfigError
from loom.config.sections import ParallelConfig
from loom.parallel.shards import local_tensor
from loom.train.hooks import StepHook

# wrapper prefixes that activation checkpointing and torch.compile add to parameter names, and that the
# checkpoint's state dicts leave out
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def state_name(name: str) -> str:
    """A parameter's name as the checkpoint's model state dict spells it."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def fragment_split(sizes: list[int], n: int) -> list[list[int]]:
    """Indices of ``sizes`` cut into ``n`` (<= len(sizes)) contiguous runs of about equal total size, none empty:
    each entry goes to the fragment its midpoint falls in, never skipping a fragment nor leaving the last ones
    without an entry."""
    total, acc, prev, out = sum(sizes) or 1, 0, -1, [[] for _ in range(n)]
    for i, size in enumerate(sizes):
        f = min(n - 1, int((acc + size / 2) * n / total))
        f = max(prev, n - (len(sizes) - i), min(f, prev + 1))
        out[f].append(i)
        acc, prev = acc + size, f
    return out


@dataclass
class _Reduction:
    """A fragment's outer all-reduce, launched after one step and applied after step ``due``: in flight (``work``
    and its buffer ``wire``) until waited for, then the averaged pseudo-gradient (``mean``, one fp32 tensor per
    parameter of the fragment, shaped like its local shard)."""

    due: int
    wire: torch.Tensor | None = None
    work: object | None = None
    mean: list[torch.Tensor] | None = None


class DiLoCo:
    """The outer state and step of one rank: ``after_step(step)`` after every optimizer step synchronizes the
    fragments due at that step (with overlap: launches their reductions and applies those due)."""

    def __init__(
        self,
        parts: list[torch.nn.Module],
        cfg: ParallelConfig,
        *,
        group,
        n_groups: int,
        replica: int,
        inner_group=None,
        outer_group=None,
    ):
        """``group``: this rank's process group along dp_replicate (``n_groups`` ranks, this one the ``replica``-th);
        ``inner_group``: the ranks of its replica group that hold different tokens (None: only this rank);
        ``outer_group``: the group the overlapped reductions run on (the same ranks as ``group``; None: ``group``)."""
        self.inner_steps, self.outer_lr, self.momentum_coef = (
            cfg.diloco_inner_steps,
            cfg.diloco_outer_lr,
            cfg.diloco_outer_momentum,
        )
        self.bf16, self.n_groups, self.group, self.replica = cfg.diloco_bf16, n_groups, group, replica
        self.inner_group = inner_group
        self.overlap, self.alpha = cfg.diloco_overlap_steps, cfg.diloco_overlap_alpha
        self.outer_group = outer_group if outer_group is not None else group
        self.in_flight: dict[int, _Reduction] = {}  # fragment -> its reduction not yet applied
        self._buffers: dict[str, torch.Tensor] | None = None  # diloco_pending of the last save or load
        # name -> this rank's parameters of that name (two under a V-shaped pipeline's tied embeddings: equal copies)
        self.params: dict[str, list[torch.nn.Parameter]] = {}
        seen: set[int] = set()
        for part in parts:
            for name, p in part.named_parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self.params.setdefault(state_name(name), []).append(p)
        names = list(self.params)
        n = max(1, min(cfg.diloco_fragments, len(names)))
        sizes = [self.params[k][0].numel() for k in names]
        self.fragments = [[names[i] for i in idx] for idx in fragment_split(sizes, n)]
        self.offsets = [(f + 1) * self.inner_steps // n for f in range(n)]
        with torch.no_grad():
            self.outer = {k: ps[0].detach().clone() for k, ps in self.params.items()}
            # kept at momentum 0 too: diloco_outer_momentum may change on resume, and the checkpoint always has it
            self.momentum = {k: torch.zeros_like(v) for k, v in self.outer.items()}
        self.bytes_sent = 0  # payload of this rank's outer all-reduces so far (what crosses the groups)
        self.syncs = 0

    @classmethod
    def build(cls, parts: list[torch.nn.Module], dims, cfg: ParallelConfig) -> DiLoCo:
        """The groups from the mesh: along ``dp_replicate``, and a group's token ranks along FSDP2's shard axis;
        with overlap, a second group along ``dp_replicate`` for the outer reductions (every rank creates every such
        group, in the same order)."""
        inner = dims["dp_shard_cp"].get_group() if dims.dp_shard * dims.cp > 1 else None
        outer = None
        if cfg.diloco_overlap_steps:
            ranks = dims.mesh.mesh  # the world mesh's ranks, one tensor dimension per axis
            axis = dims.mesh.mesh_dim_names.index("dp_replicate")
            lists = ranks.movedim(axis, -1).reshape(-1, ranks.shape[axis]).tolist()
            outer, _ = dist.new_subgroups_by_enumeration(lists, group_desc="diloco_outer")
        return cls(
            parts,
            cfg,
            group=dims["dp_replicate"].get_group(),
            n_groups=dims.dp_replicate,
            replica=dims["dp_replicate"].get_local_rank(),
            inner_group=inner,
            outer_group=outer,
        )

    # ---- during a step ---------------------------------------------------------------
    def group_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed in place over this group's ranks that hold different tokens."""
        if self.inner_group is not None:
            dist.all_reduce(t, group=self.inner_group)
        return t

    def agree(self, flag: torch.Tensor) -> torch.Tensor:
        """``flag`` (a bool tensor) true on every group: the groups skip or apply an update together (a gradient
        norm is a group's own), so the step count and the rounds stay aligned."""
        t = flag.to(torch.float32).reshape(1)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t[0] > 0

    def due(self, step: int) -> list[int]:
        """The fragments that synchronize after optimizer step ``step`` (counted from 1)."""
        return [f for f, o in enumerate(self.offsets) if step >= o and (step - o) % self.inner_steps == 0]

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        self._buffers = None
        if not self.overlap:
            for f in self.due(step):
                self._sync(self.fragments[f])
            return
        for f in sorted(f for f, r in self.in_flight.items() if r.due == step):
            self._apply(f, self.in_flight.pop(f))
        for f in self.due(step):
            self._launch(f, step)

    @torch.no_grad()
    def _sync(self, names: list[str]) -> None:
        """Average the pseudo-gradients of ``names`` over the groups, step the outer weights, restart from them."""
        wire = self._pseudo_gradient(names)
        dist.all_reduce(wire, group=self.group)
        self._count(wire)
        self._outer_step(names, self._mean(names, wire))
        for k in names:
            for p in self.params[k]:
                local_tensor(p).copy_(local_tensor(self.outer[k]))

    def _pseudo_gradient(self, names: list[str]) -> torch.Tensor:
        """(n,) outer - current of ``names``' local shards, flat, in the wire's dtype."""
        outer = [local_tensor(self.outer[k]) for k in names]
        current = [local_tensor(self.params[k][0]) for k in names]
        delta = torch.cat([(o.float() - c.float()).reshape(-1) for o, c in zip(outer, current)])  # (n,) fp32
        return delta.to(torch.bfloat16) if self.bf16 else delta

    def _count(self, wire: torch.Tensor) -> None:
        self.bytes_sent += wire.numel() * wire.element_size()
        self.syncs += 1

    def _mean(self, names: list[str], wire: torch.Tensor) -> list[torch.Tensor]:
        """The summed ``wire`` as the averaged pseudo-gradient: fp32, one view per parameter of ``names``."""
        mean = wire.float().div_(self.n_groups)  # (n,) the averaged pseudo-gradient
        out, start = [], 0
        for k in names:
            o = local_tensor(self.outer[k])
            out.append(mean[start : start + o.numel()].view_as(o))
            start += o.numel()
        return out

    def _outer_step(self, names: list[str], grads: list[torch.Tensor]) -> None:
        """One Nesterov SGD step of the outer weights of ``names`` with gradients ``grads`` (fp32)."""
        for k, g in zip(names, grads):
            o = local_tensor(self.outer[k])
            g = g.to(o.dtype)
            if self.momentum_coef:  # Nesterov, as torch.optim.SGD: b = mu b + g; step g + mu b
                buf = local_tensor(self.momentum[k])
                buf.mul_(self.momentum_coef).add_(g)
                g = g.add(buf, alpha=self.momentum_coef)
            o.sub_(g, alpha=self.outer_lr)

    # ---- overlapped reductions (overlap_steps > 0) -----------------------------------------
    def _launch(self, f: int, step: int) -> None:
        """Start fragment ``f``'s all-reduce without waiting for it; it is applied after step ``step + tau``."""
        assert f not in self.in_flight, f"fragment {f} reduced again before its last reduction was applied"
        wire = self._pseudo_gradient(self.fragments[f])
        work = dist.all_reduce(wire, group=self.outer_group, async_op=True)
        self._count(wire)
        self.in_flight[f] = _Reduction(due=step + self.overlap, wire=wire, work=work)

    def _wait(self, f: int, r: _Reduction) -> None:
        if r.work is not None:
            r.work.wait()
            r.mean, r.wire, r.work = self._mean(self.fragments[f], r.wire), None, None

    def _apply(self, f: int, r: _Reduction) -> None:
        """The outer step from the start-of-round weights, then each weight = alpha·local + (1 - alpha)·outer."""
        self._wait(f, r)
        names = self.fragments[f]
        self._outer_step(names, r.mean)
        for k in names:
            o = local_tensor(self.outer[k])
            for p in self.params[k]:
                if self.alpha:
                    local_tensor(p).mul_(self.alpha).add_(o, alpha=1 - self.alpha)
                else:
                    local_tensor(p).copy_(o)

    def wait(self) -> None:
        """Wait for every reduction in flight (before a save, a load, or the process group's end); their updates
        stay pending until their due steps."""
        for f, r in sorted(self.in_flight.items()):
            self._wait(f, r)

    def pending_at(self, step: int) -> list[tuple[int, int]]:
        """(fragment, due step) of the reductions launched but not applied after step ``step``."""
        out = []
        for f, o in enumerate(self.offsets):
            if self.overlap and step >= o:
                launch = step - (step - o) % self.inner_steps
                if step < launch + self.overlap:
                    out.append((f, launch + self.overlap))
        return out

    # ---- checkpoint --------------------------------------------------------------------
    @property
    def key(self) -> str:
        """Where this group's own weights and inner optimizer state sit in the checkpoint."""
        return f"diloco_replica_{self.replica}"

    def shared_state(self, model_state: dict) -> dict:
        """The checkpoint entries every group shares: the outer weights as ``model`` (parameters that do not train
        are the model's own) and the outer momentum; with overlap, ``diloco_pending``: the averaged pseudo-gradients
        not yet applied (the reductions in flight are waited for first). DCP loads into these same tensors."""
        missing = sorted(set(self.outer) - set(model_state))
        assert not missing, f"parameters without a state dict name: {missing[:3]}"
        state = {
            "model": {k: self.outer.get(k, v) for k, v in model_state.items()},
            "diloco_momentum": dict(self.momentum),
        }
        if self.overlap:
            self.wait()
            self._buffers = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in self.outer.items()}
            for f, r in self.in_flight.items():
                for k, g in zip(self.fragments[f], r.mean):
                    local_tensor(self._buffers[k]).copy_(g)
            state["diloco_pending"] = self._buffers
        return state

    def resumed(self, step: int) -> None:
        """After a checkpoint of step ``step`` was loaded: its pending reductions (``diloco_pending``) replace those
        in flight, each due at the step the uninterrupted run applies it."""
        if not self.overlap:
            return
        assert self._buffers is not None, "resumed() follows a load through shared_state()"
        self.in_flight = {
            f: _Reduction(due=due, mean=[local_tensor(self._buffers[k]) for k in self.fragments[f]])
            for f, due in self.pending_at(step)
        }
        self._buffers = None

    def record(self, step: int) -> dict:
        """What trainer_state.json keeps: H, the groups and fragments (checked on resume) and the position in the
        round after ``step`` (steps since the last synchronization of the first fragment)."""
        out = {
            "inner_steps": self.inner_steps,
            "groups": self.n_groups,
            "fragments": len(self.fragments),
            "position": (step - self.offsets[0]) % self.inner_steps if step >= self.offsets[0] else step,
        }
        if self.overlap:  # for the reader: resumed() derives the same from the step
            out.update(overlap_steps=self.overlap, pending=[list(p) for p in self.pending_at(step)])
        return out

    def check_resume(self, folder: str) -> None:
        """A checkpoint written with another number of groups holds other groups' weights: refuse it before any
        weight is read (a weights-only checkpoint starts the first round from its weights: ``restart``)."""
        with open(os.path.join(folder, STATE)) as fh:
            state = json.load(fh)
        saved = state.get("diloco")
        if state.get("model_only"):
            return
        if saved is None:
            raise ConfigError(
                "parallel.diloco_inner_steps",
                self.inner_steps,
                "the checkpoint was written without DiLoCo: resume it without DiLoCo",
            )
        if saved["groups"] != self.n_groups:
            raise ConfigError(
                "parallel.dp_replicate",
                self.n_groups,
                f"the DiLoCo checkpoint holds {saved['groups']} replica groups: resume with "
                f"parallel.dp_replicate = {saved['groups']}",
            )

    @torch.no_grad()
    def restart(self) -> None:
        """Start a round from the current weights (after weights-only loading): outer = current, no momentum."""
        for k, ps in self.params.items():
            local_tensor(self.outer[k]).copy_(local_tensor(ps[0]))
        for buf in self.momentum.values():
            local_tensor(buf).zero_()
        self.wait()
        self.in_flight.clear()


class DiLoCoHook(StepHook):
    """DiLoCo as a step hook: a group's gradient is the mean over its own tokens, the groups agree on skipping a
    step, the outer synchronization follows each optimizer step, and the outer state goes into checkpoints."""

    def __init__(self, diloco: DiLoCo, dims):
        self.diloco, self.dims = diloco, dims
        self.replica = diloco  # the checkpoint's outer state (loom.checkpoint.manager)
        self._group: torch.Tensor | None = None  # this step's count over the replica group

    @classmethod
    def build(cls, parts: list[torch.nn.Module], dims, cfg: ParallelConfig) -> DiLoCoHook:
        return cls(DiLoCo.build(parts, dims, cfg), dims)

    def before_count(self, local: torch.Tensor) -> None:
        self._group = self.diloco.group_sum(local.clone())  # a replica group's tokens

    def grad_scale(self, scale: torch.Tensor, loss_scale: float) -> torch.Tensor:
        # a group's gradient is the mean over its own tokens (FSDP2 averages over dp_shard x cp)
        return self.dims.dp_shard * self.dims.cp * loss_scale / self._group.clamp(min=1)

    def agree(self, applies: torch.Tensor) -> torch.Tensor:
        return self.diloco.agree(applies)  # a gradient norm is its group's: the groups skip together

    def after_update(self, step: int) -> None:
        self.diloco.after_step(step)  # every H steps (per fragment), applied or not: the rounds stay aligned

    def record(self) -> dict:
        return {"diloco_bytes": self.diloco.bytes_sent}

    def finish(self) -> None:
        self.diloco.wait()  # outer reductions still in flight finish before the process group can go

    def state_dict(self, step: int) -> dict:
        return {"diloco": self.diloco.record(step)}

    def check_resume(self, folder: str) -> None:
        self.diloco.check_resume(folder)  # another number of groups is refused

    def loaded(self, with_state: bool) -> None:
        if not with_state:  # weights only: the first round starts from them
            self.diloco.restart()

    def resumed(self, step: int) -> None:
        self.diloco.resumed(step)  # the checkpoint's pending outer reductions

"""PipeDream-2BW (Narayanan et al., 2021): a pipeline without a flush between steps, on two weight versions.

The rule, whatever the number of stages: step t's micro-batches run forward and backward on the weights one
update behind the newest, and their gradient updates the newest,

    W[t+1] = optimizer(W[t], grad f_t(W[t-1])),   W[-1] = W[0].

``WeightVersions`` holds the two versions a rank computes with in two buffers per weight, as the paper does: the
optimizer's parameter lives on one (the newest weights) and the other is the stash (the version of this step's
micro-batches). The next step's first forwards run on the newest before the optimizer steps it, so each step ends
with the stash taking a copy of the newest and the parameter moving onto it: the update lands there and the
buffer the parameter left keeps the version those forwards saved, the next step's. On one rank it is the whole
rule (``pp_schedule = pipedream_2bw`` with pp = 1: the single-process reference). ``TwoBWPipeline``
runs one stage per rank in 1F1B order as one stream over the steps: each step ends with the next step's first
``pp - 1 - rank`` forwards, so the pipeline fills and drains once per run instead of once per step.
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch
import torch.distributed as dist
from torch.nn.utils.stateless import _reparametrize_module

from loom.parallel.pipeline import _recv_hidden, _send_hidden, last_stage_inputs

ACTIVATION_TAG, GRADIENT_TAG = 21, 22  # apart from validation's point-to-point traffic (tag 0)


class WeightVersions:
    """The two weight versions of ``modules`` (this rank's parts), in two buffers per parameter: the optimizer's
    parameter lives on one (``newest``), the other is the stash (``current``: one update behind, what this step's
    micro-batches compute with). Checkpoints, validation and export see the parameters: the newest weights.

    A step: ``begin`` → forwards / backwards inside ``using`` → ``finish`` (the gradients, accumulated on the
    stash, move to the parameters; the stash, free once the step's backwards are done, takes a copy of the newest
    and the parameter moves onto it, so the optimizer's in-place update leaves the buffer the next step's early
    forwards saved untouched: the graph of those forwards keeps the version it ran on)."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules = modules
        self.params = [dict(m.named_parameters()) for m in modules]  # a tied weight once per module
        unique = {id(p): p for params in self.params for p in params.values()}  # and once across modules
        # by parameter: [its alias, the stash]; the one parameter-sized copy each keeps
        self.buffers = {i: [_alias(p), _leaf(p.detach().clone(), p)] for i, p in unique.items()}
        self.unique = list(unique.values())
        self.newest = 0  # the buffer the parameter lives on; 1 - newest is the stash
        self.started = False

    @torch.no_grad()
    def begin(self) -> None:
        """Start of a step: the newest version is the parameters as they are now (an alias of their memory, which a
        load or an init may have replaced since). The first step of a run computes with its initial weights
        (W[-1] = W[0])."""
        for p in self.unique:
            self.buffers[id(p)][self.newest] = _alias(p)
        if not self.started:
            self._copy_params()
            self.started = True

    @torch.no_grad()
    def _copy_params(self) -> None:
        for p in self.unique:
            self.buffers[id(p)][1 - self.newest].copy_(p.detach())

    @contextlib.contextmanager
    def using(self, version: str, index: int = 0):
        """Module ``index`` computes with ``version`` ('current', this step's, or 'newest', the next step's first
        micro-batches') inside the block; the autograd graph keeps that version's buffer, which no one writes to
        until the graph's backward has run."""
        slot = 1 - self.newest if version == "current" else self.newest
        tensors = {n: self.buffers[id(p)][slot] for n, p in self.params[index].items()}
        with _reparametrize_module(self.modules[index], tensors, tie_weights=True):
            yield

    def stash(self) -> dict[str, torch.Tensor]:
        """The version the next step computes with (one update behind the optimizer's weights), by parameter name:
        what a checkpoint holds beside the weights so that a resumed run continues as the uninterrupted one. A
        checkpoint load writes into these tensors, then ``loaded``."""
        if not self.started:  # no step ran: the next computes with the weights as they are
            self._copy_params()
        slot = 1 - self.newest
        return {n: self.buffers[id(p)][slot].detach() for params in self.params for n, p in params.items()}

    def loaded(self) -> None:
        """A checkpoint's stash is in place: the next step computes with it."""
        self.started = True

    @torch.no_grad()
    def finish(self) -> None:
        """End of a step's backward (every backward of its micro-batches has run): the stash's gradients become the
        parameters' (what the engine norms, clips and steps), the stash takes a copy of the newest weights and
        the parameters move onto it; the buffer they leave holds the next step's version."""
        stash = 1 - self.newest
        for p in self.unique:
            mine = self.buffers[id(p)][stash]
            g = mine.grad
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
                mine.grad = None
            mine.copy_(p.detach())
            p.data = mine.detach()
        self.newest = stash


def _alias(p: torch.nn.Parameter) -> torch.Tensor:
    """A leaf on ``p``'s memory with a version counter of its own: the optimizer's in-place update of ``p`` (after
    ``p`` moved to the other buffer) neither touches nor invalidates what a graph saved of it."""
    return _leaf(p.data, p)


def _leaf(t: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
    return t.requires_grad_(p.requires_grad)


def twobw_order(pp: int, rank: int, m: int, filled: bool, more: bool) -> list[tuple[str, str, int]]:
    """One step's actions on pp rank ``rank`` of the 2BW stream, in order: ("F", version, i) runs micro-batch i of
    this step ("current" version) or of the next ("newest"), ("B", "current", i) its backward. 1F1B's order
    without its drain: the last ``pp - 1 - rank`` forwards are the next step's first. ``filled``: the step before
    ran this step's first forwards; ``more``: a step follows (else the stream drains)."""
    warm = min(pp - 1 - rank, m)
    acts = [] if filled else [("F", "current", i) for i in range(warm)]
    for i in range(m):
        j = i + warm
        if j < m:
            acts.append(("F", "current", j))
        elif more:
            acts.append(("F", "newest", j - m))
        acts.append(("B", "current", i))
    return acts


def twobw_stream(pp: int, m: int, steps: int) -> list[list[tuple[str, int, int]]]:
    """The run's per-rank actions as ``schedule_actions`` writes them ((kind, stage, micro-batch of the run)):
    ``twobw_order`` over ``steps`` steps, for the bubble's simulation."""
    out = []
    for r in range(pp):
        acts = []
        for t in range(steps):
            for kind, version, i in twobw_order(pp, r, m, t > 0, t < steps - 1):
                acts.append((kind, r, (t + (version == "newest")) * m + i))
        out.append(acts)
    return out


class TwoBWPipeline:
    """This rank's stage in the 2BW stream: forwards and backwards in 1F1B order, hidden states and their
    gradients passed point to point (asynchronous sends), never drained between steps except at the run's last.

    ``step(batch, upcoming, loss_fn)``: ``batch`` and ``upcoming`` (the next step's micro-batches, None at the
    run's last step) are lists of (inputs, labels, positions); the first stage reads inputs, the last labels,
    every stage positions. Returns the last stage's ``loss_fn`` outputs (empty elsewhere)."""

    def __init__(self, plan, versions: WeightVersions, group, device, clock):
        self.plan, self.versions, self.group, self.device, self.clock = plan, versions, group, device, clock
        self.rank = dist.get_rank(group)
        self.stage = versions.modules[0]
        self.in_flight: deque = deque()  # (input, output) of forwards whose backward is to come, in order
        self.sends: list = []  # (work, tensors kept alive until it completes)
        self.filled = False  # the step before ran this step's first forwards
        # the hidden states' layout past (batch, sequence) and dtype, from the run's first message: only that one
        # carries a shape header (reading one waits for the GPU, which then idles while the host launches the
        # stage's kernels: on 2 H200s 2BW ran 0.85x 1F1B with a header on every micro-batch)
        self.hidden_in: tuple | None = None
        self.hidden_out: tuple | None = None

    def step(self, batch: list, upcoming: list | None, loss_fn) -> list[torch.Tensor]:
        filled = self.filled
        losses: list[torch.Tensor] = []
        for kind, version, i in twobw_order(
            self.plan.pp, self.rank, len(batch), filled, upcoming is not None
        ):
            if kind == "B":
                self._backward()
            else:
                self._forward((batch if version == "current" else upcoming)[i], version, loss_fn, losses)
        self.filled = upcoming is not None and min(self.plan.pp - 1 - self.rank, len(batch)) > 0
        if upcoming is None:  # drained: every send has its receive
            self.wait_sends()
        return losses

    def _forward(self, mb, version: str, loss_fn, losses: list) -> None:
        inputs, labels, positions = mb
        if self.plan.has_first:
            x = inputs
        else:
            x = self._recv(inputs).requires_grad_()
        start = self.clock.now()
        # the last stage's forward also reads the token ids and labels where it predicts tokens ahead (MTP)
        extra = last_stage_inputs(self.stage.args, inputs, labels) if self.plan.has_last else {}
        with self.versions.using(version):
            out = self.stage(x, positions, **extra)
        if self.plan.has_last:
            out = loss_fn(out, labels)
            losses.append(out.detach())
        self.clock.spans.append((start, self.clock.now()))
        if not self.plan.has_last:
            self._send(out.detach(), self.rank + 1, hidden=True, inputs=inputs)
        self.in_flight.append((x, out))

    @staticmethod
    def _layout(inputs: torch.Tensor, meta: tuple) -> tuple[list[int], torch.dtype]:
        return [*inputs.shape[:2], *meta[0]], meta[1]

    def _recv(self, inputs: torch.Tensor) -> torch.Tensor:
        """The previous stage's hidden states of this micro-batch: the first with its header, the rest into a
        buffer of the micro-batch's (batch, sequence) and the first's trailing layout and dtype."""
        if self.hidden_in is None:
            x = _recv_hidden(self.group, self.rank - 1, self.device, tag=ACTIVATION_TAG)
            if tuple(x.shape[:2]) != tuple(inputs.shape[:2]):
                raise RuntimeError(
                    f"pipedream_2bw: hidden states of shape {tuple(x.shape)} for token ids of shape "
                    f"{tuple(inputs.shape)}: a stage must pass (batch, sequence, ...)"
                )
            self.hidden_in = (tuple(x.shape[2:]), x.dtype)
            return x
        shape, dtype = self._layout(inputs, self.hidden_in)
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, group=self.group, group_src=self.rank - 1, tag=ACTIVATION_TAG)
        return x

    def _backward(self) -> None:
        x, out = self.in_flight.popleft()
        if self.plan.has_last:
            grad = None
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, group=self.group, group_src=self.rank + 1, tag=GRADIENT_TAG)
        start = self.clock.now()
        # this step's version: a block under activation checkpointing recomputes on the weights it ran forward on
        with self.versions.using("current"):
            torch.autograd.backward(out, grad)
        self.clock.spans.append((start, self.clock.now()))
        if not self.plan.has_first:
            self._send(x.grad, self.rank - 1, hidden=False)

    def _send(self, t: torch.Tensor, dst: int, hidden: bool, inputs: torch.Tensor | None = None) -> None:
        self.sends = [(w, k) for w, k in self.sends if not w.is_completed()]
        if hidden and self.hidden_out is None:  # the run's first: with its header
            self.hidden_out = (tuple(t.shape[2:]), t.dtype)
            self.sends.extend(_send_hidden(t, self.group, dst, tag=ACTIVATION_TAG, wait=False))
        elif hidden:
            shape, dtype = self._layout(inputs, self.hidden_out)
            if list(t.shape) != shape or t.dtype != dtype:
                raise RuntimeError(
                    f"pipedream_2bw: this stage's output is {tuple(t.shape)} {t.dtype}, the next stage expects "
                    f"{tuple(shape)} {dtype} (the layout of the run's first micro-batch)"
                )
            t = t.contiguous()
            self.sends.append((dist.isend(t, group=self.group, group_dst=dst, tag=ACTIVATION_TAG), t))
        else:
            t = t.contiguous()
            self.sends.append((dist.isend(t, group=self.group, group_dst=dst, tag=GRADIENT_TAG), t))

    def wait_sends(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends = []

"""What stops a run on purpose: preemption signals (or a launcher that died) and non-finite steps."""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch

from loom.config.errors import TrainingStopped

PREEMPTED = "preempted.json"  # written by rank 0 after a preemption save: the launcher reads it


class Preemption:
    """SIGTERM / SIGINT ask the run to stop: the ranks agree at the end of the current step, save and exit 0.
    A rank still running ``grace_s`` after the request exits 1 (the last complete checkpoint stays). In a
    launcher's worker the launcher's death is a request too (a watcher thread sees the parent change), so
    SIGKILLing the launcher never leaves workers training. A second Ctrl-C in a single process interrupts."""

    def __init__(self, grace_s: float, *, rank: int = 0):
        self.grace_s, self.rank = grace_s, rank
        self.requested, self.reason = False, ""
        self._timer: threading.Timer | None = None
        self._old: dict = {}
        # started by an elastic agent (loom's or torchrun's)
        self._worker = "TORCHELASTIC_RUN_ID" in os.environ
        if threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        self._done = threading.Event()
        if self._worker:
            threading.Thread(target=self._watch_parent, args=(os.getppid(),), daemon=True).start()

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT and not self._worker:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, without a checkpoint
        self.request(signal.Signals(signum).name)

    def _watch_parent(self, parent: int) -> None:
        while not self._done.wait(1.0):
            if os.getppid() != parent:
                self.request("the launcher exited")
                return

    def request(self, reason: str) -> None:
        if self.requested:
            return
        self.requested, self.reason = True, reason
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        print(
            f"loom: rank {self.rank}: still running {self.grace_s:g} s after {self.reason} "
            "(checkpoint.preempt_grace_s); exiting without a new checkpoint (the last complete one stays)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    def restore(self) -> None:
        self._done.set()
        if self._timer is not None:
            self._timer.cancel()
        for sig, old in self._old.items():
            signal.signal(sig, old)


class NonFiniteGuard:
    """``training.nonfinite``: what a step whose loss or gradient norm is not finite does. ``skip`` drops the
    update (``limit`` in a row stop the run), ``stop`` stops at once, ``rollback`` reloads the newest complete
    checkpoint and skips the offending batch when the replay reaches it (``limit`` rollbacks to one checkpoint
    stop the run). Its state travels in checkpoints, so a resumed run skips the same batches."""

    def __init__(self, mode: str, limit: int):
        self.mode, self.limit = mode, limit
        self.skipped = 0  # steps whose update was dropped, over the whole run
        self.streak = 0  # of them in a row, up to the current step
        self.skip_steps: set[int] = set()  # steps whose batch made a rollback happen
        self.rollbacks: dict[int, int] = {}  # checkpoint step -> rollbacks to it
        self.why = ""  # what made bad_step answer "stop"

    def state_dict(self) -> dict:
        return {
            "skipped": self.skipped,
            "skip_steps": sorted(self.skip_steps),
            "rollbacks": {str(k): v for k, v in self.rollbacks.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.skip_steps = {int(s) for s in state.get("skip_steps", ())}
        self.rollbacks = {int(k): int(v) for k, v in state.get("rollbacks", {}).items()}

    def finite_step(self) -> None:
        self.streak = 0

    def bad_step(self, step: int, loss: float, norm: float) -> str:
        """Record a non-finite ``step``: ``skip``, ``rollback``, or ``stop`` (then ``why`` says why)."""
        self.skipped += 1
        self.streak += 1
        what = f"step {step}: loss {loss}, grad norm {norm}"
        if self.mode == "stop":
            self.why = (
                f"non-finite {what} (training.nonfinite = stop); the update was not applied and the last "
                "complete checkpoint stays"
            )
            return "stop"
        if self.mode == "rollback":
            self.skip_steps.add(step)
            return "rollback"
        if self.streak >= self.limit:
            self.why = (
                f"{self.streak} non-finite steps in a row (training.nonfinite_limit = {self.limit}), the "
                f"last {what}; stopping (the last complete checkpoint stays)"
            )
            return "stop"
        return "skip"

    def rolled_back_to(self, step: int) -> None:
        self.rollbacks[step] = self.rollbacks.get(step, 0) + 1
        if self.rollbacks[step] > self.limit:
            raise TrainingStopped(
                f"rolled back to the checkpoint of step {step} {self.rollbacks[step] - 1} times "
                f"(training.nonfinite_limit = {self.limit}) and the loss is still not finite; "
                "stopping"
            )


class StepCheck:
    """One step's verdict (finite or not) with its loss and gradient norm, copied to the host without waiting:
    ``read`` waits only for that copy, so the host learns it a step late for free (the GPU has moved on).
    ``deferred``: the device already decided (skipped the update itself), the host only takes back counts.
    ``figures``: more scalars of the step (its count, the objective's statistics) in the same copy, so a logged
    record reads them there (``figures``) instead of from the device, where the read would wait for the update
    queued after them and leave the GPU idle until the host has queued the next step."""

    def __init__(
        self,
        step: int,
        finite: torch.Tensor,
        loss: torch.Tensor,
        norm: torch.Tensor,
        deferred: bool,
        figures: dict[str, torch.Tensor] | None = None,
    ):
        self.step, self.deferred = step, deferred
        self._names = list(figures or {})
        extra = [
            torch.as_tensor(v).detach().float().to(loss.device).reshape(()) for v in (figures or {}).values()
        ]
        values = torch.stack(
            [finite.to(torch.float32), loss.detach().float(), norm.detach().float().to(loss.device), *extra]
        )
        self._event = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.numel(), dtype=torch.float32, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = values

    def _values(self) -> list[float]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()

    def read(self) -> tuple[bool, float, float]:
        finite, loss, norm = self._values()[:3]
        return finite > 0, loss, norm

    def figures(self) -> dict[str, float]:
        """The loss, the gradient norm and ``figures`` as the host read them."""
        _, loss, norm, *extra = self._values()
        return {"loss": loss, "grad_norm": norm, **dict(zip(self._names, extra))}


class StopVote:
    """The ranks' stop requests, agreed without touching the GPU: each step starts an all-reduce (max) on a gloo
    group and reads the one the step before started, so every rank learns of a request at the same step."""

    def __init__(self, group=None):
        self.group = group
        self._work, self._flag = None, None

    def agreed(self, requested: bool) -> bool:
        if self.group is None:
            return requested
        import torch.distributed as dist

        seen = False
        if self._work is not None:
            self._work.wait()
            seen = bool(self._flag.item() > 0)
        self._flag = torch.tensor([float(requested)])
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return seen

    def close(self, wait: bool) -> None:
        """Finish the vote in flight (every rank started it) before the group may go; not after an error."""
        if self._work is not None and wait:
            self._work.wait()
        self._work = None

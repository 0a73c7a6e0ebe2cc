"""Host-slack diagnostics for FSDP2 training, loaded as ``sitecustomize`` (``PYTHONPATH=bench/diag``; with
bench.peers: ``--loom-variant "NAME:...;env.DIAG_LEAD=FILE"``, PYTHONPATH exported for the call). Each is off unless
its variable is set:

- ``DIAG_HOST_DELAY_US=N``: N us of busy host time at each FSDP2 unit's pre-forward. If the step does not grow by
  units x N, the host had that much slack in the forward (the GPU, not the host, paces it).
- ``DIAG_LEAD=FILE``: at each unit's pre-forward entry and exit, post-forward and pre-backward (from the fifth step
  on), whether the GPU had already finished everything launched before (an event query, no wait): "idle" there
  means the GPU waited for the host. One line per rank appended to FILE at exit (``DIAG_TAG`` names the run).
- ``DIAG_SYNC=1`` (with ``DIAG_LEAD``): PyTorch's CUDA sync debug mode ``warn`` from the fourth step on; each
  distinct warning and stack into FILE.

Used on 2 H200s on 2026-11-30 (docs/benchmarks.md, seventh session). It wraps FSDP2's private hooks
(``FSDPState._pre_forward`` and others, torch 2.11-2.13): a measuring tool, not part of loom."""

import os

if os.environ.get("DIAG_HOST_DELAY_US") or os.environ.get("DIAG_LEAD"):
    import atexit
    import collections
    import time
    import traceback

    import torch
    import torch.distributed.fsdp._fully_shard._fsdp_state as _fsdp

    _delay = int(os.environ.get("DIAG_HOST_DELAY_US", "0")) / 1e6
    _lead = os.environ.get("DIAG_LEAD")
    _sync = os.environ.get("DIAG_SYNC") == "1"
    _orig_pre = _fsdp.FSDPState._pre_forward
    _orig_post = _fsdp.FSDPState._post_forward
    _orig_pre_backward = _fsdp.FSDPState._pre_backward
    _state = {"step": 0, "last": None, "counts": collections.Counter(), "seen": set(), "lines": [], "t": None}
    _step_ms: list = []

    def _mark(key: str) -> None:
        """Counts whether the GPU had passed the previous mark (idle) and records this one."""
        if not _lead or not torch.cuda.is_available():
            return
        last = _state["last"]
        if _state["step"] > 4 and last is not None:
            _state["counts"][key + (".idle" if last.query() else ".busy")] += 1
        event = torch.cuda.Event()
        event.record()
        _state["last"] = event

    def _record_sync_warnings() -> None:
        import warnings

        torch.cuda.set_sync_debug_mode("warn")

        def show(message, category, filename, lineno, file=None, line=None):
            stack = "".join(traceback.format_stack(limit=14)[:-2])
            if (str(message)[:80], stack) not in _state["seen"]:
                _state["seen"].add((str(message)[:80], stack))
                _state["lines"].append(f"SYNC step {_state['step']}: {message}\n{stack}")

        warnings.showwarning = show
        warnings.simplefilter("always")

    @torch._dynamo.disable
    def _pre_forward(self, module, args, kwargs):
        root = getattr(self, "_is_root", False)
        if root and self._training_state != _fsdp.TrainingState.FORWARD:  # a new forward pass
            _state["step"] += 1
            now = time.perf_counter()
            if _state["t"] is not None:
                _step_ms.append(round((now - _state["t"]) * 1e3, 1))
            _state["t"] = now
            if _sync and _state["step"] == 4:
                _record_sync_warnings()
        _mark(("root." if root else "") + "pre_forward.entry")
        if _delay:
            end = time.perf_counter() + _delay
            while time.perf_counter() < end:
                pass
        out = _orig_pre(self, module, args, kwargs)
        _mark("pre_forward.exit")
        return out

    @torch._dynamo.disable
    def _post_forward(self, module, inputs, output):
        out = _orig_post(self, module, inputs, output)
        _mark("post_forward")
        return out

    @torch._dynamo.disable
    def _pre_backward(self, grad):
        _mark("pre_backward")
        return _orig_pre_backward(self, grad)

    _fsdp.FSDPState._pre_forward = _pre_forward
    _fsdp.FSDPState._post_forward = _post_forward
    _fsdp.FSDPState._pre_backward = _pre_backward

    def _dump() -> None:
        if not _lead:
            return
        counts = _state["counts"]
        keys = sorted({k.rsplit(".", 1)[0] for k in counts})
        idle = " ".join(
            f"{k}={counts[k + '.idle']}/{counts[k + '.idle'] + counts[k + '.busy']}" for k in keys
        )
        with open(_lead, "a") as fh:
            fh.write(
                f"{os.environ.get('DIAG_TAG', '?')} rank {os.environ.get('RANK', '?')} steps {_state['step']} "
                f"host step ms {_step_ms[-8:]} idle: {idle}\n"
            )
            for line in _state["lines"][:12]:
                fh.write(line + "\n")

    atexit.register(_dump)

# this file shadows any other sitecustomize further on the path (the image's, say): run that one too
import sys as _sys

_here = os.path.dirname(os.path.abspath(__file__))
for _d in _sys.path:
    _p = os.path.join(_d or ".", "sitecustomize.py")
    if os.path.abspath(_d or ".") != _here and os.path.isfile(_p) and "loom_py" not in _d:
        with open(_p) as _f:
            exec(compile(_f.read(), _p, "exec"), {"__name__": "sitecustomize", "__file__": _p})
        break

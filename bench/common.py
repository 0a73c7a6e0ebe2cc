"""What the benchmark scripts share: the environment every result records, GPU timing, and running one
``loom train --nproc-per-node N`` job (layouts.py, parallel_2gpu.py, throughput.py) with the names of its layouts.

The scripts run from the repository root as modules, ``python -m bench.<script> ...``, so that ``loom`` and this
module import without an installed package or a path edit (bench/README.md).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time


def command() -> str:
    """The command that started this script, as typed from the repository root: ``python -m bench.<name> ...``."""
    name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    return " ".join(["python", "-m", f"bench.{name}"] + [shlex.quote(a) for a in sys.argv[1:]])


def environment(commit: str, command: str) -> dict:
    """Device, library versions, commit and command: what every result file records beside its figures."""
    import torch

    env = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(), "commit": commit, "command": command,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for mod in ("transformers", "triton", "torchao"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    return env


def default_commit() -> str:
    """The ``--commit`` every script records: LOOM_COMMIT, as the device copy of the tree may hold no .git (or a
    stale one: a result once recorded an older commit than the code it ran)."""
    return os.environ.get("LOOM_COMMIT", "unknown")


def bench_ms(fn, grads=None) -> float:
    """Mean ms per call (triton's do_bench); ``grads``: leaf tensors whose .grad is reset before every call, so
    that a backward assigns its gradients instead of adding them to the previous call's."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, grad_to_none=grads)


# ------------------------------------------------------------------------------------------ loom train jobs
# multicast (NVLS) off as the device notes ask; a fresh TCP store per torchrun (stale addresses otherwise)
JOB_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1"}


def run_train(cfg: dict, gpus: int, timeout: float) -> tuple[subprocess.CompletedProcess, str, float]:
    """Runs loom train with ``cfg`` (dotted key -> value) on ``gpus`` processes: (process, command, wall s)."""
    args = ["train", "--nproc-per-node", str(gpus)] + [f"--{k}={v}" for k, v in cfg.items()]
    cmd = [sys.executable, "-c", "from loom.cli.main import entry; entry()"] + args
    t0 = time.time()
    proc = subprocess.run(cmd, env={**os.environ, **JOB_ENV}, capture_output=True, text=True, timeout=timeout)
    return proc, "loom " + " ".join(args), round(time.time() - t0, 1)


def config_rejection(proc: subprocess.CompletedProcess) -> str | None:
    """loom's one-line config error (exit 2), or None."""
    if proc.returncode != 2:
        return None
    reasons = [ln for ln in proc.stderr.splitlines() if ln.startswith("loom: error:")]
    return reasons[0] if reasons else "exit 2"


def failure(proc: subprocess.CompletedProcess) -> str:
    """What a failed job said: each worker's exception line (the first cause, not the shutdown noise after
    it) and the last lines of its output."""
    text = proc.stderr or proc.stdout or ""
    causes = [ln for ln in text.splitlines()
              if re.match(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception): ", ln) and "frame #" not in ln]
    tail = text[-1500:]
    return "\n".join(dict.fromkeys(causes[:8])) + ("\n...\n" if causes else "") + tail


def metrics(run_dir: str) -> list[dict]:
    """The logged intervals of a finished run, in order."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]

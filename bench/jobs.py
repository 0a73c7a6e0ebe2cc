"""Running one ``loom train --nproc-per-node N`` job from a benchmark script, and reading its metrics.

Shared by bench/layouts.py, bench/parallel_2gpu.py and bench/throughput.py: the job's environment (NVLink
multicast off, a fresh rendezvous store per job), the exact command as a user would type it, and the
per-interval records of its ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

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

"""What the benchmark scripts share: the environment every result records, GPU timing, and running one
``loom train --nproc-per-node N`` job (layouts.py, parallel_2gpu.py, throughput.py) with the names of its layouts.

The scripts run from the repository root as modules, ``python -m bench.<script> ...``, so that ``loom`` and this
module import without an installed package or a path edit (bench/README.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time


def command() -> str:
    """The command that started this script, as typed from the repository root: ``python -m bench.<name> ...``
    (``bench.diag.<name>`` for the diagnostics)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rel = os.path.relpath(os.path.splitext(os.path.abspath(sys.argv[0]))[0], root)
    module = (
        rel.replace(os.sep, ".") if rel.startswith("bench" + os.sep) else "bench." + os.path.basename(rel)
    )
    return " ".join(["python", "-m", module] + [shlex.quote(a) for a in sys.argv[1:]])


def environment(commit: str, command: str, modules: tuple[str, ...] = ()) -> dict:
    """Device, library versions (and those of ``modules``), commit and command: what every result file records
    beside its figures."""
    import torch

    from loom.runtime.topology import usable_cpus

    env = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": commit,
        "command": command,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # host CPUs as the OS counts them, and as this container lets the job use them (affinity, cgroup quota)
        "cpus": {"os": os.cpu_count(), "usable": usable_cpus()},
    }
    for mod in ("transformers", "triton", "torchao", *modules):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    return env


def default_commit() -> str:
    """The ``--commit`` every script records: LOOM_COMMIT, as the device copy of the tree may hold no .git (or a
    stale one: a result once recorded an older commit than the code it ran)."""
    return os.environ.get("LOOM_COMMIT", "unknown")


def event_ms(fn, n: int, warm: int = 0) -> list[float]:
    """Milliseconds of each of ``n`` calls of ``fn`` on the current CUDA stream (events around each, a sync
    after), after ``warm`` untimed ones."""
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def bench_ms(fn, grads=None) -> float:
    """Mean ms per call (triton's do_bench); ``grads``: leaf tensors whose .grad is reset before every call, so
    that a backward assigns its gradients instead of adding them to the previous call's."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, grad_to_none=grads)


# ------------------------------------------------------------------------------------------ loom train jobs
# multicast (NVLS) off as the device notes ask; a fresh TCP store per torchrun (stale addresses otherwise)
JOB_ENV = {
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONUNBUFFERED": "1",
}


TIMED_OUT = 124  # a job's return code when it ran past its limit (as coreutils' timeout)
# from SIGTERM to SIGKILL for a job past its limit: longer than torchrun's own grace for its workers (30 s), so
# that it has stopped them before it is killed itself
KILL_GRACE_S = 60


def run_train(cfg: dict, gpus: int, timeout: float) -> tuple[subprocess.CompletedProcess, str, float]:
    """Runs loom train with ``cfg`` (dotted key -> value) on ``gpus`` processes: (process, command, wall s).

    Past ``timeout`` seconds the job's process group gets SIGTERM, which torchrun passes on to its workers (they
    run in sessions of their own, and would otherwise keep their GPUs from the next job), and SIGKILL
    ``KILL_GRACE_S`` later if it is still there; it returns with code ``TIMED_OUT``, what it printed and a
    last line saying so, so that a script records it as that layout's failure and goes on."""
    args = ["train", "--nproc-per-node", str(gpus)] + [f"--{k}={v}" for k, v in cfg.items()]
    cmd = [sys.executable, "-c", "from loom.cli.main import entry; entry()"] + args
    t0 = time.time()
    popen = subprocess.Popen(
        cmd,
        env={**os.environ, **JOB_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = popen.communicate(timeout=timeout)
        code = popen.returncode
    except subprocess.TimeoutExpired:
        out, err = _stop(popen)
        code = TIMED_OUT
        err += f"\nTimeoutError: the job ran past {timeout:g} s and was killed\n"
    proc = subprocess.CompletedProcess(cmd, code, out, err)
    return proc, "loom " + " ".join(args), round(time.time() - t0, 1)


def _stop(popen: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM to the job's process group, SIGKILL ``KILL_GRACE_S`` later; what it printed. A process that
    escaped the group (a worker in a session of its own) may still hold the pipes after that: its output is
    given up after another ``KILL_GRACE_S`` rather than waited for."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):  # the group may be gone already
            os.killpg(popen.pid, sig)
        try:
            out, err = popen.communicate(timeout=KILL_GRACE_S)
            return out or "", err or ""
        except subprocess.TimeoutExpired:
            continue
    for pipe in (popen.stdout, popen.stderr):
        pipe.close()
    popen.wait()
    return "", "(its output was held open by a process outside its group)"


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
    causes = [
        ln
        for ln in text.splitlines()
        if re.match(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception): ", ln) and "frame #" not in ln
    ]
    tail = text[-1500:]
    return "\n".join(dict.fromkeys(causes[:8])) + ("\n...\n" if causes else "") + tail


def metrics(run_dir: str) -> list[dict]:
    """The logged intervals of a finished run, in order."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


# ------------------------------------------------------------------------- one-GPU training comparisons
def hf_llama_config(args, dtype):
    """transformers' LlamaConfig of a loom model shape (llama3 RoPE scaling, SDPA attention), weights in ``dtype``."""
    from transformers import LlamaConfig

    sc = args.rope_scaling
    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings,
        max_position_embeddings=131072,
        rope_theta=args.rope_theta,
        rope_scaling={
            "rope_type": "llama3",
            "factor": sc.factor,
            "low_freq_factor": sc.low_freq_factor,
            "high_freq_factor": sc.high_freq_factor,
            "original_max_position_embeddings": sc.original_max_position,
        },
        attn_implementation="sdpa",
        dtype=dtype,
    )


def hf_train_step(model, params, opt):
    """A transformers training step over loom micro-batches: bf16 autocast, the loss on the inputs (transformers
    shifts the labels itself), clipping at 1.0, the optimizer step."""
    import torch

    def step_fn(mbs):
        for mb in mbs:
            mb = mb.to("cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=mb.inputs, labels=mb.inputs)
            out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"loss": out.loss.detach()}

    return step_fn


def time_steps(step_fn, batches: list, warmup: int) -> tuple[list[float], list[float], float, dict | None]:
    """Runs ``step_fn`` on every batch: (seconds of each step after the first ``warmup``, every step's loss, the
    first step's seconds, compilation included, the GPUs' clock and power over the steps: GpuSampler's summary).
    The GPU is synchronized around each timed step."""
    with GpuSampler(every_s=0.1) as gpus:
        times, losses, first_step_s = _time_steps(step_fn, batches, warmup)
    return times, losses, first_step_s, gpus.summary()


def _time_steps(step_fn, batches: list, warmup: int) -> tuple[list[float], list[float], float]:
    import torch

    losses, times = [], []
    t_first = time.perf_counter()
    for i, mbs in enumerate(batches):
        t0 = time.perf_counter()
        out = step_fn(mbs)
        if i == 0 or i >= warmup:
            torch.cuda.synchronize()
        if i == 0:
            first_step_s = time.perf_counter() - t_first
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(out["loss"]))
        if i == warmup - 1:
            torch.cuda.synchronize()
    return times, losses, first_step_s


def run_children(module: str, variants: list[str], args: list[str], root: str) -> list[dict]:
    """``python -m <module> --variant V <args>`` for each variant in its own process (clean peak memory): the last
    ``RESULT {json}`` line each prints, or {"variant", "error"}; each printed as it comes."""
    results = []
    for v in variants:
        proc = subprocess.run(
            [sys.executable, "-m", module, "--variant", v] + args, capture_output=True, text=True, cwd=root
        )
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            results.append({"variant": v, "error": (proc.stderr or proc.stdout)[-3000:]})
        else:
            results.append(json.loads(line[-1][7:]))
        print(json.dumps(results[-1])[:600], flush=True)
    return results


def write_result(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)


def profile_steps_by_kind(step_fn, batches, run_dir: str, variant: str) -> dict:
    """Kernel time per step by category over ``batches`` but the first (loom.metrics.trace_summary), after the timed
    steps, with the GEMMs' time by shape (shapes recorded: the profiled steps' host time grows on both sides of a
    pair alike; the timed steps are not profiled)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from loom.metrics.trace_summary import summarize

    path = os.path.join(run_dir, f"trace_{variant}.json")
    cuda = torch.cuda.is_available()
    with profile(
        activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
        schedule=schedule(wait=0, warmup=1, active=len(batches) - 1),
        on_trace_ready=lambda p: p.export_chrome_trace(path),
        record_shapes=True,
    ) as prof:
        for mbs in batches:
            step_fn(mbs)
            if cuda:
                torch.cuda.synchronize()
            prof.step()
    with open(path) as fh:
        return summarize(json.load(fh))


class GpuSampler:
    """Each GPU's SM clock, power, temperature, utilization and clock-event reasons sampled every ``every_s`` on a
    thread while a benchmark runs (NVML through nvidia-ml-py), summarized per GPU: a rank whose GPU runs slower (a
    lower clock, a power cap) shows beside a wait the profiles find, and a run held at its power limit shows as
    such. Without NVML or a GPU the summary is None."""

    def __init__(self, every_s: float = 0.5):
        import threading

        self.every_s, self.samples, self._stop = every_s, {}, threading.Event()
        self.power_limit_w: dict = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no nvidia-ml-py, no driver: nothing to sample
            self.samples = None
            return
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            reasons = (
                getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
            )
            self.power_limit_w = {
                str(i): pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0 for i, h in enumerate(handles)
            }
            while not self._stop.is_set():
                for i, h in enumerate(handles):
                    self.samples.setdefault(i, []).append(
                        (
                            pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                            pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                            pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                            pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
                            reasons(h),
                        )
                    )
                self._stop.wait(self.every_s)
        except Exception:
            pass
        finally:
            pynvml.nvmlShutdown()

    def summary(self) -> dict | None:
        return summarize_gpu_samples(self.samples, self.power_limit_w)


def joules_per_token(gpus: dict | None, tokens_per_s_per_gpu: float | None) -> float | None:
    """Energy a token cost over the steps: each busy GPU's median power in them (GpuSampler's steady figure) over
    its tokens/s, averaged over those GPUs; None without both. On a GPU held at its power limit the step's time is
    set by its energy (docs/benchmarks.md, eighth session), so this is the throughput read another way."""
    steady = [g["steady"]["power_w_median"] for g in (gpus or {}).values() if g.get("steady")]
    if not steady or not tokens_per_s_per_gpu:
        return None
    return round(sum(steady) / len(steady) / tokens_per_s_per_gpu, 5)


# NVML's clock-event reasons that mean power: the software power cap, the hardware power brake
POWER_REASONS = 0x4 | 0x80
STEADY_UTILIZATION = 90  # % busy: the training steps, not start-up or compilation


def summarize_gpu_samples(samples: dict | None, power_limit_w: dict | None = None) -> dict | None:
    """{gpu: [(sm MHz, W, °C, util %[, clock-event reasons]), ...]} -> {gpu: medians of the busy samples
    (utilization > 0) and the hottest temperature; then over the steady ones (utilization >= 90%: the steps) the
    median clock and power and the share held down by power (``power_capped_share``), with the power limit};
    None when nothing was sampled."""
    import statistics

    if not samples:
        return None
    out = {}
    for gpu, rows in samples.items():
        busy = [r for r in rows if r[3] > 0] or rows
        steady = [r for r in rows if r[3] >= STEADY_UTILIZATION]
        out[str(gpu)] = {
            "samples": len(rows),
            "busy_samples": len([r for r in rows if r[3] > 0]),
            "sm_clock_mhz_median": statistics.median(r[0] for r in busy),
            "power_w_median": round(statistics.median(r[1] for r in busy), 1),
            "temperature_c_max": max(r[2] for r in rows),
            "utilization_median": statistics.median(r[3] for r in busy),
        }
        if steady:
            out[str(gpu)]["steady"] = {
                "samples": len(steady),
                "sm_clock_mhz_median": statistics.median(r[0] for r in steady),
                "power_w_median": round(statistics.median(r[1] for r in steady), 1),
                "power_capped_share": round(
                    sum(1 for r in steady if len(r) > 4 and r[4] & POWER_REASONS) / len(steady), 3
                ),
            }
        if power_limit_w and str(gpu) in power_limit_w:
            out[str(gpu)]["power_limit_w"] = power_limit_w[str(gpu)]
    return out

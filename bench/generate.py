"""Generation speed: loom's engine (KV cache, compiled blocks, CUDA graphs of decode steps) next to transformers'
``generate`` with its static cache and torch.compile, same weights, same GPU, same run.

Per flavor (bf16, random weights, ``1B`` and ``8B`` by default): decode tokens/s at batch 1, 8 and 64 (prompt 128
tokens, 128 new; the time of ``--new`` tokens less the time of 8, so prefill and start-up drop out), time to first
token, prefill tokens/s (1 x 2048 and 8 x 512 tokens), and batch-1 decode as a fraction of the HBM roofline: the
bytes one step must read (every weight the step multiplies by, the embedding table only when it is also the head,
plus the KV cache of the mean context) over the measured step time, at the device's peak bandwidth
(``loom.plan.hardware``). Then speculative decoding at batch 1 on the 1B shape: prompt lookup on code text (a random
model's own output is what it can find; its acceptance is whatever that gives), and the acceptance-speedup curve with
guesses of set accuracy (the target's own greedy continuation with each guessed token wrong with probability
1 - a; as cheap to propose as prompt lookup).

Each system and flavor runs in its own process (clean memory and compile caches).

    python -m bench.generate --out bench/results/generate_h100.json                # 1B and 8B, both systems
    python -m bench.generate --flavors 8B --out bench/results/generate_8b_h100.json
    python -m bench.generate --quick --out /tmp/generate_quick.json                # CPU smoke test, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench.common import command, default_commit, environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = 8  # new tokens of the short run the decode rate is measured against
CODE_MODULE = "json.decoder"  # the code text of the prompt-lookup run
CACHE_KWARG = "past_key_values"  # generate's name for a cache it is given ("cache" from transformers 5.2x on)


def settings(a) -> dict:
    quick = a.quick
    return {
        "flavors": ["debug"] if quick else a.flavors.split(","),
        "batches": [1, 2] if quick else [int(b) for b in a.batches.split(",")],
        "prompt": 16 if quick else a.prompt,
        "new": 24 if quick else a.new,
        "prefill": [(1, 32), (2, 16)]
        if quick
        else [tuple(int(x) for x in s.split("x")) for s in a.prefill.split(",")],
        "device": "cpu" if quick else "cuda",
        "compile": not quick and not a.no_compile,
        "graphs": not quick and not a.no_cuda_graphs,
        "repeats": 1 if quick else a.repeats,
        "spec_new": 24 if quick else a.spec_new,
        "spec_k": a.spec_k,
        "spec_dtype": a.spec_dtype,
        "spec_fit_steps": 40 if quick else a.spec_fit_steps,
        "spec_fit_lr": 3e-3 if quick else a.spec_fit_lr,
        "profile": a.profile,
        "rates": [0.5, 1.0] if quick else [float(r) for r in a.rates.split(",")],
    }


# ---------------------------------------------------------------------------------------------- models
def loom_model(flavor: str, device: str, compile_: bool, dtype=None):
    """The flavor with random weights (seeded: every process builds the same ones) in ``dtype``: by default bf16
    (fp32 on the CPU)."""
    import torch

    from loom.infer.load import generation_kernels
    from loom.models.llama import FLAVORS, Llama

    args = FLAVORS[flavor]
    args = args.with_(vocab_size=args.vocab_size or 384, max_seq_len=4096)
    args = generation_kernels(args, torch.device(device), compile_, tp=False)
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    with torch.device("meta"):
        model = Llama(args)
    model = model.to(dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            p.fill_(1.0) if p.ndim == 1 else p.normal_(0.0, 0.02, generator=g)
    model.init_buffers(device)
    return model.eval()


def hf_model(model):
    """transformers' LlamaForCausalLM holding ``model``'s weights (the loom model is freed)."""
    import torch
    import transformers

    from loom.checkpoint.hf.config import hf_config_from_args
    from loom.checkpoint.hf.export import hf_state_dict

    args = model.args
    dtype = next(model.parameters()).dtype
    config = transformers.LlamaConfig.from_dict(hf_config_from_args(args, dtype))
    state = hf_state_dict(model.state_dict(), args)
    device = next(model.parameters()).device
    del model
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf.eval()


def prompts_of(batch: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(300, vocab, (batch, length), generator=g).tolist()


def code_prompt(length: int) -> list[int]:
    """Python source as byte ids (a random model has no tokenizer: bytes are ids it has)."""
    import importlib
    import inspect

    return list(inspect.getsource(importlib.import_module(CODE_MODULE)).encode())[:length]


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- loom
def run_loom(flavor: str, s: dict) -> dict:
    import torch

    from loom.infer import Generator, SamplingParams

    torch._dynamo.config.cache_size_limit = 64
    dev = s["device"]
    model = loom_model(flavor, dev, s["compile"])
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    gen = Generator.from_model(
        model, compile=s["compile"], cuda_graphs=s["graphs"], max_batch=max(s["batches"]), pack=True
    )
    out = {"flavor": flavor, "system": "loom", "params": n_params, "decode": [], "prefill": []}
    vocab = model.args.vocab_size
    for batch in s["batches"]:
        prompts = prompts_of(batch, s["prompt"], vocab)
        long_, short = (SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (s["new"], SHORT))
        warm = _timed(lambda: gen.generate_ids(prompts, long_), dev)  # compiles and captures
        gen.generate_ids(prompts, short)
        longs = [_timed(lambda: gen.generate_ids(prompts, long_), dev) for _ in range(s["repeats"])]
        stats = gen.stats
        shorts = [_timed(lambda: gen.generate_ids(prompts, short), dev) for _ in range(s["repeats"])]
        first = [
            _timed(lambda: gen.generate_ids(prompts, max_new_tokens=1, ignore_eos=True), dev)
            for _ in range(s["repeats"])
        ]
        step = (statistics.median(longs) - statistics.median(shorts)) / (s["new"] - SHORT)
        out["decode"].append(
            {
                "batch": batch,
                "decode_tokens_per_s": batch / step,
                "step_ms": 1000 * step,
                "ttft_s": statistics.median(first),
                "first_call_s": warm,
                "loop_tokens_per_s": stats.new_tokens / (stats.seconds - stats.prefill_seconds),
                "cache_bytes_per_token": gen.engine.cache_bytes_per_token,
            }
        )
        print(json.dumps(out["decode"][-1]), flush=True)
        if s["profile"]:
            out.setdefault("profile", []).append({"batch": batch, **profile_steps(gen.engine, prompts, dev)})
            print(json.dumps(out["profile"][-1])[:2000], flush=True)
    for batch, seq in s["prefill"]:
        prompts = prompts_of(batch, seq, vocab, seed=2)
        gen.engine.start(prompts, 1)  # warm-up
        t = statistics.median(_timed(lambda: gen.engine.start(prompts, 1), dev) for _ in range(s["repeats"]))
        out["prefill"].append(
            {"batch": batch, "seq": seq, "prefill_tokens_per_s": batch * seq / t, "seconds": t}
        )
        print(json.dumps(out["prefill"][-1]), flush=True)
    out["setup_and_run_s"] = time.perf_counter() - t0
    out["roofline"] = roofline(model, out["decode"], s)
    return out


# kernel name pieces -> kind, first match wins: Inductor's Triton kernels (reductions: with coordinate-descent tuning
# also the batch-1 projections; pointwise), then cuBLAS/CUTLASS matmuls, attention, copies
KERNEL_KINDS = (
    ("triton reduction", ("triton_red", "triton_per")),
    ("triton pointwise", ("triton_poi", "triton")),
    ("gemm", ("gemm", "gemv", "cutlass", "xmma", "cublas", "splitk", "sm90_", "sm80_")),
    ("attention", ("fmha", "attention", "flash", "efficient", "sdpa")),
    ("copy", ("memcpy", "memset", "copy", "fill")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def profile_steps(engine, prompts: list[list[int]], device: str, steps: int = 20, top: int = 25) -> dict:
    """``steps`` decode steps as the engine runs them (CUDA graph replays on CUDA), timed, then recorded with
    torch.profiler: per step the kernels launched and their summed time against the step's time (the rest is
    time the GPU waits), by kind (Triton reductions and pointwise, cuBLAS GEMM, attention, copies), and the ``top``
    kernels by time. Where the profiler sees no kernels inside graph replays, the steps are recorded without the
    graph (same kernels, launched one by one). Without a GPU the same over CPU operators (a smoke test: nothing
    there is a kernel)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    logits, _, lens = engine.start(prompts, steps + 1)  # the caches (and graphs) of the decode runs, kept
    tokens = logits.argmax(-1)[:, None]  # (B, 1)
    pos = lens[:, None]  # (B, 1)

    def run():
        for i in range(steps):
            engine.step(tokens, pos + i)

    def eager():  # the same compiled blocks without the graph: what the graph holds, launched one by one
        with torch.no_grad():
            for i in range(steps):
                engine.model(tokens, pos + i)

    cuda = device == "cuda"

    def record(fn) -> list[dict]:
        fn()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            fn()
            engine.sync()
        rows = []
        for a in prof.key_averages():
            if cuda and a.device_type != DeviceType.CUDA:
                continue
            us = (
                next(
                    (
                        t
                        for t in (
                            getattr(a, n, 0)
                            for n in (
                                "self_device_time_total",
                                "device_time_total",
                                "self_cuda_time_total",
                                "cuda_time_total",
                            )
                        )
                        if t
                    ),
                    0,
                )
                if cuda
                else a.self_cpu_time_total
            )
            if us > 0:
                rows.append(
                    {
                        "name": a.key[:160],
                        "kind": kernel_kind(a.key),
                        "calls_per_step": a.count / steps,
                        "us_per_step": us / steps,
                    }
                )
        return sorted(rows, key=lambda r: -r["us_per_step"])

    run()
    step_s = _timed(run, device) / steps
    rows, graphs = record(run), bool(engine.cuda_graphs)
    if not rows and graphs:  # a profiler that does not see inside graph replays
        rows, graphs = record(eager), False
    total_us = sum(r["us_per_step"] for r in rows)
    kinds: dict[str, float] = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0.0) + r["us_per_step"]
    return {
        "what": "CUDA kernels" if cuda else "CPU operators (self time)",
        "recorded_in_graphs": graphs,
        "steps": steps,
        "step_ms": 1000 * step_s,
        "kernel_ms_per_step": total_us / 1000,
        "kernel_share_of_step": total_us / 1e6 / step_s if step_s else None,
        "kernels_per_step": sum(r["calls_per_step"] for r in rows),
        "ms_per_step_by_kind": {k: v / 1000 for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top": [
            {**r, "share_of_kernels": r["us_per_step"] / total_us if total_us else None} for r in rows[:top]
        ],
    }


def roofline(model, decode: list[dict], s: dict) -> dict | None:
    """Batch-1 decode against the HBM roofline: bytes read per step / peak bandwidth over the measured step."""
    import torch

    one = next((d for d in decode if d["batch"] == 1), None)
    if one is None or s["device"] != "cuda":
        return None
    from loom.plan.hardware import GPUS

    name = torch.cuda.get_device_name()
    gpu = next((g for key, g in GPUS.items() if key in name), None)
    args = model.args
    size = next(model.parameters()).element_size()
    n_params = sum(p.numel() for p in model.parameters())
    table = args.vocab_size * args.dim  # a lookup reads one row of it; a head reads all of it
    weight_bytes = (n_params - (0 if args.tie_embeddings else table)) * size
    context = s["prompt"] + s["new"] / 2
    kv_bytes = one["cache_bytes_per_token"] * context
    out = {
        "device": name,
        "weight_bytes": weight_bytes,
        "kv_bytes_mean_context": kv_bytes,
        "step_ms": one["step_ms"],
        "hbm_tbps": gpu.hbm_tbps if gpu else None,
    }
    if gpu:
        ideal = (weight_bytes + kv_bytes) / (gpu.hbm_tbps * 1e12)
        out.update(roofline_step_ms=1000 * ideal, fraction=ideal / (one["step_ms"] / 1000))
    return out


# ---------------------------------------------------------------------------------------------- transformers
def run_hf(flavor: str, s: dict) -> dict:
    """transformers' ``generate`` with a StaticCache of the run's full length (so the short and long runs share one
    compiled graph), which makes ``generate`` compile the forward itself (its automatic compilation on CUDA)."""
    import torch
    import transformers
    import transformers.generation.utils as hf_utils

    global CACHE_KWARG
    CACHE_KWARG = "cache" if "cache" in getattr(hf_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"

    torch._dynamo.config.cache_size_limit = 64
    dev = s["device"]
    model = hf_model(loom_model(flavor, dev, False))
    if dev != "cuda":
        model.generation_config.disable_compile = True  # the CPU smoke test: eager
    out = {
        "flavor": flavor,
        "system": "hf_static_compile" if dev == "cuda" else "hf_static",
        "decode": [],
        "transformers": transformers.__version__,
    }
    vocab = model.config.vocab_size
    for batch in s["batches"]:
        x = torch.tensor(prompts_of(batch, s["prompt"], vocab), device=dev)
        length = s["prompt"] + s["new"]

        cache = transformers.StaticCache(
            config=model.config, max_cache_len=length
        )  # one per batch, reset per call

        def run(n):
            cache.reset()
            _sync(dev)
            t0 = time.perf_counter()
            model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                **{CACHE_KWARG: cache},
            )
            _sync(dev)
            return time.perf_counter() - t0

        t_warm = time.perf_counter()
        run(s["new"])
        run(SHORT)
        warm = time.perf_counter() - t_warm
        longs = [run(s["new"]) for _ in range(s["repeats"])]
        shorts = [run(SHORT) for _ in range(s["repeats"])]
        first = [run(1) for _ in range(s["repeats"])]
        step = (statistics.median(longs) - statistics.median(shorts)) / (s["new"] - SHORT)
        out["decode"].append(
            {
                "batch": batch,
                "decode_tokens_per_s": batch / step,
                "step_ms": 1000 * step,
                "ttft_s": statistics.median(first),
                "first_calls_s": warm,
            }
        )
        print(json.dumps(out["decode"][-1]), flush=True)
    return out


# ---------------------------------------------------------------------------------------------- speculative
class Oracle:
    """Guesses of set accuracy: ``continuation``, the target's own greedy tokens, each guessed token replaced by a
    wrong one with probability 1 - ``rate`` (``continuation`` None: every guess is the pending token's id + 1, a
    proposer that keeps about nothing). Proposing costs what prompt lookup's lookup costs (host lists).

    ``continuation`` comes from a speculative run of the same k (``run_speculative``), not from plain decoding:
    a random model's next-token logits are nearly flat, and in bf16 the (k+1)-token verification forward rounds
    differently from the one-token step, so the two decodings part at a near-tie, and every guess taken from the
    plain run is wrong from there on (the first GPU run's oracle acceptance, docs/inference.md). A row's result in
    a (k+1)-token forward does not depend on the other rows, so every run with this k gives the reference's
    tokens: each oracle run checks that it did (``same_tokens_as_reference``)."""

    def __init__(self, k: int, rate: float, continuation: list[list[int]] | None, vocab: int):
        self.k, self.rate, self.continuation, self.vocab = k, rate, continuation, vocab

    def run(self, engine, prompts, params, sequences):
        from loom.infer.speculative import speculate

        return speculate(engine, prompts, params, sequences, self)

    def start(self, prompts, reserve, params):
        import random

        self._emitted = [0] * len(prompts)
        self._random = random.Random(0)  # every run draws the same wrong guesses

    def propose(self, pending, pending_host, pos, done):
        import torch

        guesses = []
        for b, finished in enumerate(done):
            self._emitted[b] += 0 if finished else 1  # the pending token
            if self.continuation is None:
                guesses.append([(pending_host[b] + 1) % self.vocab] * self.k)
                continue
            cont = self.continuation[b][self._emitted[b] : self._emitted[b] + self.k]
            cont += [0] * (self.k - len(cont))
            guesses.append([t if self._random.random() < self.rate else (t + 1) % self.vocab for t in cont])
        return torch.tensor(guesses, device=pending.device), None, [not d for d in done]

    def accepted(self, kept, kept_host, drafts_host, done):
        for b, m in enumerate(kept_host):
            if not done[b]:
                self._emitted[b] += m

    def advance(self, prev, running):
        pass


def fit(model, tokens: list[int], steps: int, lr: float) -> dict:
    """A few AdamW steps of ``model`` (float32 weights, bf16 autocast on CUDA) on one sequence, so that its greedy
    continuation of a piece of that text is the text with confident logits: a model whose output really repeats its
    prompt, for prompt lookup. Returns the first and last loss."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    x = torch.tensor([tokens], device=device)  # (1, S)
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    model.train()
    losses = []
    for i in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (i + 1) / 10)  # 10 warm-up steps
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, :-1])  # (1, S - 1, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[0, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    for p in params:
        p.requires_grad_(False)
    del opt
    return {
        "steps": steps,
        "lr": lr,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
    }


def expected_acceptance(rate: float, k: int) -> float:
    """Kept guesses over proposed ones when each guess is right with probability ``rate`` on its own: a round
    keeps the agreeing prefix, on average rate + rate^2 + ... + rate^k of k."""
    return sum(rate**i for i in range(1, k + 1)) / k


def forward_ms(engine, prompt: list[list[int]], k: int, device: str, n: int = 50) -> dict:
    """The target's forward alone, as the runs replay it: one decode step (1 token) and one verification (k + 1
    tokens), in ms. A round costs a verification plus the proposer and the host's bookkeeping; the speedup's
    ceiling at full acceptance is (k + 1) x step / verification."""
    import torch

    logits, _, lens = engine.start(prompt, k + n + 1)
    pos = lens[:, None]  # (1, 1)
    out = {}
    for name, width in (("step_ms", 1), ("verify_ms", k + 1)):
        tokens = logits.argmax(-1)[:, None].expand(-1, width).contiguous()  # (1, width)
        at = pos + torch.arange(width, device=pos.device)  # (1, width)
        engine.step(tokens, at)
        out[name] = 1000 * _timed(lambda: [engine.step(tokens, at) for _ in range(n)], device) / n
    return out


def run_speculative(flavor: str, s: dict) -> dict:
    """Batch-1 speculative decoding on ``flavor`` (bf16 by default). With ``spec_fit_steps`` the model is first fit
    (float32) on a piece of Python source, and the prompt is that source followed by its first line again: the
    fitted model continues with the source, which prompt lookup finds in the prompt. The rows: plain decoding, prompt
    lookup, the oracle curve (guesses of set accuracy) and a proposer that keeps about nothing; each with its
    acceptance, tokens per target forward and speedup over plain decoding."""
    import torch

    from loom.infer import Generator, PromptLookup, SamplingParams

    torch._dynamo.config.cache_size_limit = 64
    dev = s["device"]
    dtype = getattr(torch, s["spec_dtype"])
    text = code_prompt(512 if dev != "cpu" else 48)
    # the prompt repeats the source's first bytes: the model goes on from there
    restart = 32 if dev != "cpu" else 8
    fitted = None
    if s["spec_fit_steps"]:
        model = loom_model(flavor, dev, s["compile"], torch.float32)
        fitted = fit(model, text + text, s["spec_fit_steps"], s["spec_fit_lr"])
        model = model.to(dtype)
        model.init_buffers(dev)  # the RoPE table back in float32
        prompt = [text + text[:restart]]
        described = (
            f"{CODE_MODULE} source ({len(text)} byte ids) and its first {restart} again, after the fit"
        )
    else:
        model = loom_model(flavor, dev, s["compile"], dtype)
        prompt = [text]
        described = f"{CODE_MODULE} source, {len(text)} byte ids, random weights"
    gen = Generator.from_model(model, compile=s["compile"], cuda_graphs=s["graphs"], max_batch=1, pack=True)
    params = SamplingParams(max_new_tokens=s["spec_new"], ignore_eos=True)
    k = s["spec_k"]
    vocab = model.args.vocab_size

    def measure(spec) -> dict:
        gen.generate_ids(prompt, params, speculative=spec)  # warm-up: compile, capture
        runs = []
        for _ in range(s["repeats"]):
            outs = gen.generate_ids(prompt, params, speculative=spec)
            st = gen.stats
            runs.append((st.new_tokens / (st.seconds - st.prefill_seconds), st, outs[0].token_ids))
        tps, st, tokens = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        return {
            "tokens_per_s": tps,
            "acceptance": st.acceptance,
            "target_steps": st.target_steps,
            "tokens_per_target_step": st.new_tokens / st.target_steps if st.target_steps else 1.0,
            "tokens": tokens,
        }

    plain = measure(False)
    reference = measure(Oracle(k, 0.0, None, vocab))  # the tokens every speculative run with this k gives
    # how much of plain decoding's output is the source going on (memorized, not looping)
    if fitted is not None:
        source = text[restart : restart + len(plain["tokens"])]
        fitted["output_follows_source"] = sum(a == b for a, b in zip(plain["tokens"], source)) / len(source)
    out = {
        "flavor": flavor,
        "dtype": s["spec_dtype"],
        "k": k,
        "prompt": described,
        "fit": fitted,
        "new_tokens": s["spec_new"],
        "plain_tokens_per_s": plain["tokens_per_s"],
        "reference_same_as_plain": reference["tokens"] == plain["tokens"],
        "reference_first_difference": next(
            (i for i, (a, b) in enumerate(zip(reference["tokens"], plain["tokens"])) if a != b), None
        ),
        "runs": [],
    }

    def row(name: str, m: dict, rate: float | None = None) -> dict:
        r = {
            "proposer": name,
            "acceptance": m["acceptance"],
            "tokens_per_s": m["tokens_per_s"],
            "speedup": m["tokens_per_s"] / plain["tokens_per_s"],
            "target_steps": m["target_steps"],
            "tokens_per_target_step": m["tokens_per_target_step"],
            "same_tokens_as_plain": m["tokens"] == plain["tokens"],
            "same_tokens_as_reference": m["tokens"] == reference["tokens"],
        }
        if rate is not None:
            r.update(guess_rate=rate, expected_acceptance=expected_acceptance(rate, k))
        out["runs"].append(r)
        print(json.dumps(r), flush=True)
        return r

    row("none", reference, 0.0)
    row("prompt_lookup", measure(PromptLookup(k=k)))
    for rate in s["rates"]:
        row(f"oracle_{rate}", measure(Oracle(k, rate, [reference["tokens"]], vocab)), rate)
    out.update(forward_ms(gen.engine, prompt, k, dev))
    valid = [r for r in out["runs"] if r["same_tokens_as_reference"] and (r["acceptance"] or 0) >= 0.7]
    out["bar"] = {
        "acceptance_at_least": 0.7,
        "speedup_at_least": 1.5,
        "rows": [r["proposer"] for r in valid],
        "min_speedup": min((r["speedup"] for r in valid), default=None),
    }
    out["bar"]["met"] = bool(valid) and out["bar"]["min_speedup"] >= 1.5
    return out


# ---------------------------------------------------------------------------------------------- driver
JOBS = {"loom": run_loom, "hf": run_hf, "speculative": run_speculative}


def child(job: str, flavor: str, s: dict) -> dict:
    return JOBS[job](flavor, s)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavors", default="1B,8B")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--prefill", default="1x2048,8x512", help="BATCHxSEQ,...")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--systems", default="loom,hf,speculative")
    p.add_argument("--spec-flavor", default="1B")
    p.add_argument("--spec-new", type=int, default=256)
    p.add_argument("--spec-k", type=int, default=4)
    p.add_argument(
        "--spec-dtype",
        default="bfloat16",
        choices=("float32", "bfloat16"),
        help="the speculative runs' model dtype",
    )
    p.add_argument(
        "--spec-fit-steps",
        type=int,
        default=150,
        help="AdamW steps fitting the speculative target to its prompt's source (0: random weights)",
    )
    p.add_argument("--spec-fit-lr", type=float, default=5e-4)
    p.add_argument(
        "--profile",
        action="store_true",
        help="record decode steps with torch.profiler: top kernels, kernel time against step time",
    )
    p.add_argument("--rates", default="0.6,0.8,0.9,0.95,1.0", help="guess accuracies of the acceptance curve")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument(
        "--quick", action="store_true", help="the debug flavor on the CPU, in-process: a smoke test"
    )
    p.add_argument("--out", default="bench/results/generate.json")
    p.add_argument("--commit", default=default_commit())
    p.add_argument("--child", nargs=2, metavar=("JOB", "FLAVOR"), help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        res = child(a.child[0], a.child[1], json.loads(a.settings))
        print("RESULT " + json.dumps(res), flush=True)
        return res
    s = settings(a)
    systems = a.systems.split(",")
    jobs = [(j, f) for f in s["flavors"] for j in ("loom", "hf") if j in systems]
    if "speculative" in systems:
        jobs.append(("speculative", "debug" if a.quick else a.spec_flavor))
    results = []
    for job, flavor in jobs:
        t0 = time.perf_counter()
        if a.quick:  # in-process: seconds on a CPU
            res = child(job, flavor, s)
        else:
            cmd = [
                sys.executable,
                "-m",
                "bench.generate",
                "--child",
                job,
                flavor,
                "--settings",
                json.dumps(s),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            res = (
                json.loads(line[-1][7:])
                if not proc.returncode and line
                else {"job": job, "flavor": flavor, "error": (proc.stderr or proc.stdout)[-3000:]}
            )
        res["wall_s"] = time.perf_counter() - t0
        results.append(res)
        print(f"{job} {flavor}: {res['wall_s']:.0f} s" + (" ERROR" if "error" in res else ""), flush=True)
        doc = {
            "benchmark": "generate",
            "environment": environment(a.commit, command()),
            "settings": s,
            "results": results,
            "ratios": ratios(results),
        }
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:  # after every job: a run cut short keeps what it measured
            json.dump(doc, fh, indent=1)
    print(table(doc))
    return doc


def ratios(results: list[dict]) -> dict:
    """loom's decode tokens/s over transformers' at every flavor and batch."""
    out = {}
    by = {(r.get("system"), r.get("flavor")): r for r in results if "decode" in r}
    for (system, flavor), r in by.items():
        hf = next((v for (sy, fl), v in by.items() if fl == flavor and sy.startswith("hf")), None)
        if system != "loom" or hf is None:
            continue
        for d in r["decode"]:
            h = next((x for x in hf["decode"] if x["batch"] == d["batch"]), None)
            if h:
                key = f"{flavor}_batch{d['batch']}"
                out[f"{key}_decode_loom_vs_hf"] = d["decode_tokens_per_s"] / h["decode_tokens_per_s"]
                out[f"{key}_ttft_hf_vs_loom"] = h["ttft_s"] / d["ttft_s"]
    return out


def table(doc: dict) -> str:
    lines = [
        f"\n{'flavor':<6} {'system':<18} {'batch':>5} {'decode tok/s':>13} {'step ms':>8} {'TTFT ms':>8}"
    ]
    for r in doc["results"]:
        if "error" in r:
            lines.append(f"{r.get('flavor', ''):<6} {r.get('job', ''):<18} ERROR {r['error'][-300:]}")
            continue
        for d in r.get("decode", []):
            lines.append(
                f"{r['flavor']:<6} {r['system']:<18} {d['batch']:>5} {d['decode_tokens_per_s']:>13.1f} "
                f"{d['step_ms']:>8.2f} {1000 * d['ttft_s']:>8.1f}"
            )
        for d in r.get("prefill", []):
            lines.append(
                f"{r['flavor']:<6} {'loom prefill':<18} {d['batch']:>5} x {d['seq']}: "
                f"{d['prefill_tokens_per_s']:.0f} tokens/s"
            )
        if r.get("roofline"):
            rf = r["roofline"]
            frac = (
                f"{100 * rf['fraction']:.1f}% of the HBM roofline"
                if rf.get("fraction")
                else "no bandwidth figure"
            )
            lines.append(f"{r['flavor']:<6} batch-1 decode: {frac}")
        for p in r.get("profile", []):
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in p["ms_per_step_by_kind"].items())
            lines.append(
                f"{r['flavor']:<6} profile batch {p['batch']}: step {p['step_ms']:.2f} ms, {p['what']} "
                f"{p['kernel_ms_per_step']:.2f} ms in {p['kernels_per_step']:.0f} ({kinds})"
            )
        for run in r.get("runs", []):
            acc = "-" if run["acceptance"] is None else f"{100 * run['acceptance']:.0f}%"
            want = (
                f" (rate {run['guess_rate']}: {100 * run['expected_acceptance']:.0f}% expected)"
                if "guess_rate" in run
                else ""
            )
            lines.append(
                f"{r['flavor']:<6} speculative {run['proposer']:<14} acceptance {acc:>5}{want}  "
                f"{run['tokens_per_target_step']:.2f} tokens/forward  speedup {run['speedup']:.2f}x  "
                f"same tokens as reference: {run['same_tokens_as_reference']}"
            )
        if r.get("verify_ms"):
            lines.append(
                f"{r['flavor']:<6} speculative target forward: step {r['step_ms']:.2f} ms, verification of "
                f"{r['k'] + 1} tokens {r['verify_ms']:.2f} ms"
            )
        if r.get("bar"):
            lines.append(f"{r['flavor']:<6} speculative bar (>= 1.5x where acceptance >= 70%): {r['bar']}")
        if r.get("fit"):
            lines.append(f"{r['flavor']:<6} speculative target fit: {r['fit']}")
    lines.append("ratios: " + json.dumps({k: round(v, 3) for k, v in doc["ratios"].items()}))
    return "\n".join(lines)


if __name__ == "__main__":
    main()

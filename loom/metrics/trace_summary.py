"""Where a training step's GPU time goes, from the trace ``--metrics.profile_steps A:B`` writes:
kernel time by category (attention, matmul, fused elementwise, loss, optimizer, ...), the top kernels,
the time the GPU runs no kernel (idle), and the compute stream's kernel time and where it waits (its gaps, by the
kernels either side), per profiled step (docs/metrics.md, "Profiling").

    loom train --model.flavor 1B ... --run.dir runs/x --metrics.profile_steps 5:7
    python -m loom.metrics.trace_summary runs/x/profile/trace_rank0.json [--out summary.json] [--label 1B]
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
import sys
from collections import defaultdict

# first match wins; names are lower-cased kernel names
CATEGORIES = [
    ("attention", r"flash|fmha|cudnn|attn|sdpa|_attn_"),
    ("loss", r"cross_entropy|_ce_|linear_ce|nll|log_softmax|logsumexp"),
    ("optimizer", r"adam|multi_tensor|foreach|_amp_"),
    ("matmul", r"gemm|sm90_|cutlass|nvjet|cublas|matmul|wgmma|_scaled_mm|f8f8"),
    ("communication", r"nccl"),
    # MoE token routing (top-k, sorting tokens by expert, gathers / scatters / index copies), embedding lookups
    ("sort / gather / scatter / index", r"sort|topk|scatter|gather|index"),
    ("copy / cast", r"copy|memcpy|memset|cast|to_copy|fill"),
    ("fused elementwise (triton)", r"^triton|_kernel$|rms|rope|swiglu"),
    ("elementwise (aten)", r"elementwise|vectorized|reduce|unrolled"),
]


STEPS_KEY = "loom_profiled_steps"  # the trace's count of profiled steps (loom.metrics.profile writes it)
GAP_US = 10.0  # a compute-stream gap shorter than this is a launch's own latency, not a wait
COPIES = ("gpu_memcpy", "gpu_memset")  # what else occupies a stream besides kernels
FSDP_RANGE = re.compile(r"^FSDP::(all_gather|all_gather_copy_out) \((.+)\)$")  # FSDP2's host ranges


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


def summarize(trace: dict, skip_first: bool = False) -> dict:
    """The per-step figures of ``trace``; ``skip_first``: without the first profiled step, which starts from a
    drained GPU (loom's profiler waits for it), so its host has none of an unprofiled step's lead."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    steps = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X"
            and str(e.get("name", "")).startswith("ProfilerStep#")
            and e.get("cat") != "gpu_user_annotation"
        ),  # each step also appears as a range on the GPU rows
        key=lambda e: e["ts"],
    )
    if skip_first:
        if len(steps) < 2:
            raise SystemExit(
                f"--skip-first needs two or more ProfilerStep ranges; this trace has {len(steps)} (profile more "
                "steps, with metrics.profile_host true)"
            )
        steps = steps[1:]
    recorded = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if not recorded:
        raise SystemExit("no GPU kernels in this trace (a CPU run?)")
    launches = launch_times(events)
    kernels = in_steps(recorded, steps, launches)
    if not kernels:
        raise SystemExit(
            f"none of this trace's {len(recorded)} GPU kernels was launched inside a ProfilerStep range"
        )
    start = min(k["ts"] for k in kernels)
    end = max(k["ts"] + k["dur"] for k in kernels)
    # a GPU-only trace (metrics.profile_host false) has no step ranges: the count loom wrote beside its events
    n_steps = len(steps) or (int(trace.get(STEPS_KEY, 1)) if isinstance(trace, dict) else 1)
    by_cat, by_name = defaultdict(float), defaultdict(float)
    for k in kernels:
        by_cat[category(k["name"])] += k["dur"]
        by_name[k["name"][:120]] += k["dur"]
    # intervals from the first kernel's start: trace times are ~1e12 us, where a double's step is ~1e-3 us, and
    # the busy time is summed from their differences
    interval = lambda k: (k["ts"] - start, k["ts"] - start + k["dur"])
    busy = merged([interval(k) for k in kernels])
    by_shape = matmul_by_shape(events, kernels)
    comm = merged([interval(k) for k in kernels if category(k["name"]) == "communication"])
    compute = merged([interval(k) for k in kernels if category(k["name"]) != "communication"])
    covered = sum(b - a for a, b in busy)
    comm_total = sum(b - a for a, b in comm)
    span = end - start
    ms = lambda us: us / 1000 / n_steps
    gpu_ops = (
        in_steps([e for e in events if e.get("ph") == "X" and e.get("cat") in COPIES], steps, launches)
        + kernels
    )
    stream = compute_stream(gpu_ops, n_steps)
    return {
        "steps": n_steps,
        "gpu_span_ms_per_step": ms(span),
        "gpu_busy_ms_per_step": ms(covered),
        "gpu_idle_fraction": 1 - covered / span,
        # communication kernels running while no other kernel runs: what overlap failed to hide
        "exposed_communication_ms_per_step": ms(comm_total - overlap(comm, compute)),
        "by_category_ms_per_step": {c: ms(t) for c, t in sorted(by_cat.items(), key=lambda x: -x[1])},
        "top_kernels_ms_per_step": {n: ms(t) for n, t in sorted(by_name.items(), key=lambda x: -x[1])[:15]},
        "compute_stream": stream,
        "fsdp_gathers": fsdp_gathers(events, gpu_ops, stream["stream"], steps, n_steps),
        # only where the profiler recorded shapes (record_shapes=True): GEMM time by the launching op and its inputs
        "matmul_by_shape_ms_per_step": {
            key: {"ms": ms(t), "calls": n / n_steps}
            for key, (t, n) in sorted(by_shape.items(), key=lambda x: -x[1][0])[:20]
        },
    }


def compute_stream(ops: list, n_steps: int) -> dict:
    """The compute stream (the one running the most kernel time besides communication), per step: its kernel time
    by category (what the step's critical path is made of, where other streams' work overlaps it) and where it
    waits: its gaps of at least ``GAP_US`` between one kernel or copy and the next, grouped by the two either side
    (a gap before each block's first kernel, say, is the host launching it late, or a wait on another stream)."""
    by_stream: dict = defaultdict(list)
    for k in ops:
        by_stream[k.get("args", {}).get("stream")].append(k)
    stream = max(
        by_stream,
        key=lambda s: sum(
            k["dur"]
            for k in by_stream[s]
            if k.get("cat") == "kernel" and category(k["name"]) != "communication"
        ),
    )
    seq = sorted(by_stream[stream], key=lambda k: k["ts"])
    by_cat: dict = defaultdict(float)
    for k in seq:
        if k.get("cat") == "kernel":
            by_cat[category(k["name"])] += k["dur"]
    groups: dict = defaultdict(lambda: [0.0, 0])
    total, end = 0.0, seq[0]["ts"] + seq[0]["dur"]
    for prev, k in zip(seq, seq[1:]):
        end = max(end, prev["ts"] + prev["dur"])
        gap = k["ts"] - end
        if gap >= GAP_US:
            total += gap
            entry = groups[(prev["name"][:60], k["name"][:60])]
            entry[0] += gap
            entry[1] += 1
    ms = lambda us: us / 1000 / n_steps
    return {
        "stream": stream,
        "kernel_ms_per_step": ms(sum(by_cat.values())),
        "by_category_ms_per_step": {c: ms(t) for c, t in sorted(by_cat.items(), key=lambda x: -x[1])},
        "gap_ms_per_step": ms(total),
        "gaps_by_neighbours": [
            {"before": a, "after": b, "ms_per_step": ms(t), "per_step": n / n_steps}
            for (a, b), (t, n) in sorted(groups.items(), key=lambda x: -x[1][0])[:10]
        ],
    }


def fsdp_gathers(events: list, gpu_ops: list, stream, steps: list, n_steps: int) -> dict | None:
    """FSDP2's gathers unit by unit, from the ranges FSDP2 records on the host (``FSDP::all_gather (unit)``, then
    ``FSDP::all_gather_copy_out (unit)``; None in a trace without them, one of the GPU alone say): how long the
    compute stream sat idle before each unit's copy-out, and why: the gather's transfer still running ("gather":
    its copy-in or a peer that issued its side late held it back) or the copy-out launched after the stream ran dry
    ("host"). Per gather also its copy-in (the casts and copies before the transfer, on FSDP2's copy-in stream),
    its transfer (a NCCL kernel, or a copy-engine peer copy) and the transfer's lag: from its launch, or the end of
    its copy-in where later, to its start."""
    ranges = fsdp_ranges(events, steps)
    if not ranges:
        return None
    calls = launch_calls(events)
    inside = launched_inside(gpu_ops, ranges, calls)
    idle_before = stream_idle(gpu_ops, stream)
    last_gather: dict = {}
    rows = []
    for r in ranges:  # in time order: a copy-out belongs to its unit's latest gather
        if r[3] == "all_gather":
            last_gather[r[4]] = r
        elif r[4] in last_gather:
            out = sorted(
                (op for op, _ in inside[r] if op.get("args", {}).get("stream") == stream),
                key=lambda o: o["ts"],
            )
            if out:
                rows.append(gather_row(r[4], inside[last_gather[r[4]]], out[0], idle_before(out[0]), calls))
    if not rows:
        return None
    ms = lambda us: us / 1000 / n_steps
    waits = [x for x in rows if x["wait_us"]]
    as_ms = lambda us: None if us is None else us / 1000
    parts = ("copy_in", "transfer", "lag")
    return {
        "gathers_per_step": len(rows) / n_steps,
        "wait_ms_per_step": ms(sum(x["wait_us"] for x in waits)),
        "wait_for_gather_ms_per_step": ms(sum(x["wait_us"] for x in waits if x["cause"] == "gather")),
        "wait_for_host_ms_per_step": ms(sum(x["wait_us"] for x in waits if x["cause"] == "host")),
        "median_ms": {
            k: as_ms(statistics.median(v))
            if (v := [x[f"{k}_us"] for x in rows if x[f"{k}_us"] is not None])
            else None
            for k in parts
        },
        "largest_waits": [
            {"unit": x["unit"], "wait_ms": x["wait_us"] / 1000, "cause": x["cause"]}
            | {f"{k}_ms": as_ms(x[f"{k}_us"]) for k in parts}
            for x in sorted(waits, key=lambda x: -x["wait_us"])[:8]
        ],
    }


def fsdp_ranges(events: list, steps: list) -> list[tuple]:
    """FSDP2's gather and copy-out ranges on the host, (start, end, thread, kind, unit), in time order; only those
    starting inside a profiled step where the trace has step ranges."""
    spans = [(s["ts"], s["ts"] + s["dur"]) for s in steps]
    out = []
    for e in events:
        m = FSDP_RANGE.match(str(e.get("name", "")))
        if m and e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            if not spans or any(a <= e["ts"] <= b for a, b in spans):
                out.append((e["ts"], e["ts"] + e["dur"], e.get("tid"), m.group(1), m.group(2)))
    return sorted(out)


def launch_calls(events: list) -> dict:
    """Each kernel's launch call, (start, thread), by correlation id."""
    return {
        e["args"]["correlation"]: (e["ts"], e.get("tid"))
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }


def launched_inside(gpu_ops: list, ranges: list, calls: dict) -> dict:
    """Each range's GPU ops, (op, launch time), those whose launch call ran inside it on its thread (FSDP2's ranges
    do not nest in one another)."""
    by_tid: dict = defaultdict(list)
    for r in ranges:
        by_tid[r[2]].append(r)
    starts = {tid: [r[0] for r in rs] for tid, rs in by_tid.items()}
    inside: dict = defaultdict(list)
    for op in gpu_ops:
        call = calls.get(op.get("args", {}).get("correlation"))
        if call is None or call[1] not in by_tid:
            continue
        i = bisect.bisect_right(starts[call[1]], call[0]) - 1
        if i >= 0 and by_tid[call[1]][i][1] >= call[0]:
            inside[by_tid[call[1]][i]].append((op, call[0]))
    return inside


def stream_idle(gpu_ops: list, stream):
    """A function of one of ``stream``'s ops: how long the stream sat idle before it (0 below ``GAP_US``)."""
    spans = sorted(
        (op["ts"], op["ts"] + op["dur"]) for op in gpu_ops if op.get("args", {}).get("stream") == stream
    )
    starts, ends = [a for a, _ in spans], []  # ends[i]: the latest end among the first i + 1 ops
    for _, b in spans:
        ends.append(max(b, ends[-1]) if ends else b)

    def idle(op) -> float:
        i = bisect.bisect_left(starts, op["ts"]) - 1
        gap = op["ts"] - ends[i] if i >= 0 else 0.0
        return gap if gap >= GAP_US else 0.0

    return idle


def gather_row(unit: str, gathered: list, copy_out, idle: float, calls: dict) -> dict:
    """One gather's figures (us): ``gathered`` the GPU ops its gather range launched, ``copy_out`` the first op of
    its copy-out, ``idle`` the compute stream's wait before it."""
    transfers = [
        (op, t) for op, t in gathered if category(op["name"]) == "communication" or "PtoP" in op["name"]
    ]
    copy_in = [op for op, _ in gathered if all(op is not x for x, _ in transfers)]
    copy_in_end = max((op["ts"] + op["dur"] for op in copy_in), default=None)
    row = {"unit": unit, "wait_us": idle, "cause": None, "transfer_us": None, "lag_us": None}
    row["copy_in_us"] = copy_in_end - min(op["ts"] for op in copy_in) if copy_in else None
    transfer_end = None
    if transfers:
        op, launched = min(transfers, key=lambda x: x[0]["ts"])
        transfer_end = max(o["ts"] + o["dur"] for o, _ in transfers)
        row["transfer_us"] = transfer_end - op["ts"]
        row["lag_us"] = max(
            0.0, op["ts"] - max(launched, copy_in_end if copy_in_end is not None else launched)
        )
    if idle:
        copy_out_launch = calls.get(copy_out.get("args", {}).get("correlation"), (copy_out["ts"], None))[0]
        row["cause"] = "gather" if transfer_end is not None and transfer_end >= copy_out_launch else "host"
    return row


def launch_times(events: list) -> dict:
    """When each kernel was launched: the CUDA runtime / driver call's start, by correlation id."""
    return {corr: ts for corr, (ts, _) in launch_calls(events).items()}


def in_steps(kernels: list, steps: list, launched: dict) -> list:
    """The kernels launched inside a profiled step. The profiler records every kernel that runs while it records,
    so where the host runs ahead of the GPU (a loop that does not wait on each step) the trace also holds the tail
    of the step before the window (its backward and optimizer), launched while the profiler was warming up: their
    launch calls are not in the trace. Counted, they would inflate every per-step figure. A trace without step
    ranges or launch records (a synthetic one) keeps every kernel."""
    if not steps or not launched:
        return kernels
    ranges = sorted((s["ts"], s["ts"] + s["dur"]) for s in steps)

    def inside(k) -> bool:
        t = launched.get(k.get("args", {}).get("correlation"))
        return t is not None and any(a <= t <= b for a, b in ranges)

    return [k for k in kernels if inside(k)]


def matmul_by_shape(events: list, kernels: list) -> dict[str, list[float]]:
    """GEMM kernel time and count by the op that launched each kernel and its input shapes ("aten::addmm [[4096,
    14336], [4096, 4096], [4096, 14336]]"): a kernel's ``External id`` is its launching op's, and the op carries
    ``Input Dims`` when the profiler recorded shapes. Kernel names do not say which GEMM of a model they ran."""
    ops = {
        e["args"]["External id"]: e
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and "Input Dims" in e.get("args", {})
    }
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for k in kernels:
        op = ops.get(k.get("args", {}).get("External id"))
        if op is not None and category(k["name"]) == "matmul":
            dims = [d for d in op["args"]["Input Dims"] if d]  # scalars (beta, alpha) have none
            entry = out[f"{op['name']} {dims}"]
            entry[0] += k["dur"]
            entry[1] += 1
    return out


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping intervals covering the same time as ``intervals``."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Time covered by both of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        total += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m loom.metrics.trace_summary",
        description="Where a profiled training step's GPU time goes, by kernel category.",
    )
    p.add_argument("trace", help="a trace_rank<r>.json that --metrics.profile_steps wrote")
    p.add_argument("--out", default="", help="also write the summary as JSON here")
    p.add_argument("--label", default="", help="a name printed and stored with the summary")
    p.add_argument(
        "--skip-first",
        action="store_true",
        help="leave out the first profiled step (it starts from a drained GPU: no host lead)",
    )
    a = p.parse_args()
    try:
        with open(a.trace) as f:
            res = summarize(json.load(f), skip_first=a.skip_first)
    except (OSError, ValueError) as e:  # missing, unreadable or not JSON
        why = f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e) else type(e).__name__
    except SystemExit as e:  # a trace without GPU kernels to count
        why = str(e)
    else:
        why = ""
    if why:
        print(f"trace_summary: {a.trace}: {why}", file=sys.stderr)
        raise SystemExit(2)
    res["label"], res["trace"] = a.label, a.trace
    if a.out:  # first: a closed pipe on the printout (| head) must not lose the file
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    busy = res["gpu_busy_ms_per_step"]
    print(
        f"{a.label}: GPU span {res['gpu_span_ms_per_step']:.1f} ms/step, busy {busy:.1f}, "
        f"idle {100 * res['gpu_idle_fraction']:.1f}%, exposed communication "
        f"{res['exposed_communication_ms_per_step']:.1f} ms"
    )
    for c, t in res["by_category_ms_per_step"].items():
        print(f"  {c:<28} {t:8.2f} ms  {100 * t / busy:5.1f}%")
    for n, t in list(res["top_kernels_ms_per_step"].items())[:8]:
        print(f"    {t:8.2f} ms  {n}")
    cs = res["compute_stream"]
    print(
        f"  compute stream ({cs['stream']}): kernels {cs['kernel_ms_per_step']:.1f} ms/step, gaps "
        f"{cs['gap_ms_per_step']:.2f}, the largest kinds:"
    )
    for g in cs["gaps_by_neighbours"][:5]:
        print(f"    {g['ms_per_step']:8.2f} ms  {g['per_step']:5.1f} x  {g['before']}  ->  {g['after']}")
    g = res.get("fsdp_gathers")
    if g:
        med = g["median_ms"]
        print(
            f"  FSDP2 gathers: {g['gathers_per_step']:.0f} a step; the compute stream waited {g['wait_ms_per_step']:.2f} "
            f"ms/step before copy-outs ({g['wait_for_gather_ms_per_step']:.2f} for the gather, "
            f"{g['wait_for_host_ms_per_step']:.2f} for the host); median copy-in {fmt(med['copy_in'])}, transfer "
            f"{fmt(med['transfer'])}, transfer lag {fmt(med['lag'])} ms"
        )
        for w in g["largest_waits"][:5]:
            print(f"    {w['wait_ms']:8.2f} ms  {w['unit']} ({w['cause']}; lag {fmt(w['lag_ms'])} ms)")
    for key, v in list(res["matmul_by_shape_ms_per_step"].items())[:8]:
        print(f"    {v['ms']:8.2f} ms  {v['calls']:5.1f} calls  {key}")


if __name__ == "__main__":
    main()

"""loom.metrics.trace_summary on a synthetic trace: categories, per-step division (a step's GPU-row copy is not
a second step), idle time between kernels."""

from __future__ import annotations

from loom.metrics.trace_summary import category, summarize


def kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def launch(corr, ts):
    """The CUDA runtime call that launched kernel ``corr`` (its correlation id) at ``ts``."""
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "ts": ts,
        "dur": 1,
        "args": {"correlation": corr},
    }


def run(name, ts, dur, corr):
    """A kernel whose launch has correlation id ``corr``."""
    return {**kernel(name, ts, dur), "args": {"correlation": corr}}


def test_categories():
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert category("nvjet_sm90_tst_256x128") == "matmul"
    assert category("_ce_rows_kernel") == "loss"
    assert category("multi_tensor_apply_kernel<FusedAdam>") == "optimizer"
    assert category("ncclDevKernel_AllGather") == "communication"
    assert category("triton_poi_fused_mul_silu_0") == "fused elementwise (triton)"


def test_summary_per_step_and_idle():
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "ts": 100, "dur": 100},
        kernel("nvjet_gemm", 0, 60),
        kernel("cudnn_sdpa_flash_fprop", 50, 20),  # overlapping
        kernel("nvjet_gemm", 100, 40),
        kernel("multi_tensor_apply_kernel_adam", 180, 20),
    ]
    s = summarize({"traceEvents": events})
    assert s["steps"] == 2
    assert s["by_category_ms_per_step"] == {"matmul": 0.05, "attention": 0.01, "optimizer": 0.01}
    assert abs(s["gpu_busy_ms_per_step"] - 0.065) < 1e-12  # union 0-70, 100-140, 180-200 = 130 us, / 2 steps
    assert abs(s["gpu_idle_fraction"] - 0.35) < 1e-12  # span 200 us


def test_busy_time_at_a_real_traces_timestamps_is_the_kernels_time():
    """Profiler timestamps are microseconds since the epoch (~5e12), where a double's step is ~1e-3 us: the busy time
    of back-to-back kernels on one stream is their summed durations, not the rounding of their ends' differences
    (a 2-H200 GPU-only trace had one stream's kernel time above the GPU's busy time by 4e-3 us)."""
    base, events, t = 5184609929243.67, [], 0.0
    for i in range(400):
        dur = 3.072 + (i % 7) * 0.101
        events.append(kernel("nvjet_gemm", base + t, dur))
        t += dur + 0.5
    s = summarize({"traceEvents": events})
    total_ms = sum(e["dur"] for e in events) / 1000
    assert abs(s["gpu_busy_ms_per_step"] - total_ms) < 1e-9
    assert s["compute_stream"]["kernel_ms_per_step"] <= s["gpu_busy_ms_per_step"] + 1e-9


def test_exposed_communication_is_what_no_other_kernel_hides():
    events = [
        kernel("ncclDevKernel_AllGather", 0, 50),
        kernel("nvjet_gemm", 10, 20),  # hides 10-30 of it
        kernel("nvjet_gemm", 40, 30),  # hides 40-50
        kernel("ncclDevKernel_ReduceScatter", 80, 10),  # fully exposed
    ]
    s = summarize({"traceEvents": events})
    assert abs(s["exposed_communication_ms_per_step"] - 0.03) < 1e-12  # 0-10, 30-40, 80-90


def test_matmul_time_by_the_launching_op_and_its_shapes():
    """A GEMM kernel is counted under the op whose External id it carries, with that op's input shapes (scalars
    dropped); kernels of other categories, or of ops without recorded shapes, are not."""

    def op(eid, name, dims):
        return {
            "ph": "X",
            "cat": "cpu_op",
            "name": name,
            "ts": 0,
            "dur": 1,
            "args": {"External id": eid, **dims},
        }

    def launched(name, ts, dur, eid):
        return {**kernel(name, ts, dur), "args": {"External id": eid}}

    events = [
        op(1, "aten::addmm", {"Input Dims": [[8, 6], [8, 4], [4, 6], [], []]}),
        op(2, "aten::mm", {"Input Dims": [[8, 4], [4, 6]]}),
        op(3, "aten::mm", {}),  # shapes not recorded
        launched("nvjet_gemm_badd", 0, 30, 1),
        launched("nvjet_gemm_bz", 40, 10, 2),
        launched("nvjet_gemm_bz", 60, 10, 2),
        launched("nvjet_gemm_bz", 80, 10, 3),
        launched("triton_poi_fused_add_0", 95, 5, 2),
    ]
    s = summarize({"traceEvents": events})
    assert s["matmul_by_shape_ms_per_step"] == {
        "aten::addmm [[8, 6], [8, 4], [4, 6]]": {"ms": 0.03, "calls": 1.0},
        "aten::mm [[8, 4], [4, 6]]": {"ms": 0.02, "calls": 2.0},
    }


def test_kernels_launched_before_the_window_are_not_counted():
    """A host that runs ahead leaves the previous step's last kernels running when recording starts: those launched
    before the ProfilerStep range (by their runtime call's correlation id), or whose launch the profiler did not keep
    (it was warming up), are dropped."""

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#15", "ts": 100, "dur": 100},
        launch(1, 50),  # the step before: its optimizer, still running at ts 110
        launch(2, 120),
        launch(3, 150),
        run("_adamw_kernel", 110, 40, 1),
        run("nvjet_gemm", 150, 30, 2),
        run("_adamw_kernel", 190, 40, 3),
        launch(4, 160),
        run("cudnn_sdpa_flash_fprop", 180, 10, 4),
        run("_adamw_kernel", 100, 10, 9),  # launched during the warm-up: no launch record
    ]
    s = summarize({"traceEvents": events})
    assert s["by_category_ms_per_step"] == {"optimizer": 0.04, "matmul": 0.03, "attention": 0.01}
    assert abs(s["gpu_idle_fraction"] - 0.0) < 1e-12  # span 150-230, covered


def test_the_command_exits_2_with_one_line_on_a_bad_trace(tmp_path):
    """A missing file, text that is not JSON, a trace without kernels and one whose kernels were all launched before
    the profiled step: one line on stderr each, exit 2."""
    import json
    import subprocess
    import sys

    outside = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "ts": 100, "dur": 100},
        launch(1, 50),
        run("nvjet_gemm", 120, 10, 1),
    ]
    cases = {
        "absent.json": (None, "FileNotFoundError"),
        "text.json": ("not json", "JSONDecodeError"),
        "empty.json": (json.dumps({"traceEvents": []}), "no GPU kernels in this trace"),
        "outside.json": (
            json.dumps({"traceEvents": outside}),
            "none of this trace's 1 GPU kernels was launched",
        ),
    }
    for name, (text, why) in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        out = subprocess.run(
            [sys.executable, "-m", "loom.metrics.trace_summary", str(path)], capture_output=True, text=True
        )
        assert out.returncode == 2 and why in out.stderr and len(out.stderr.strip().splitlines()) == 1, (
            out.stderr
        )


def test_compute_stream_kernels_and_gaps_by_the_kernels_either_side():
    """The stream with the most kernel time besides communication: its kernel time by category, and its gaps of at
    least GAP_US (a copy occupies the stream too), grouped by the two either side and divided by the steps; another
    stream's kernels fill none of them; a GPU-only trace's step count is the one written beside its events."""

    def on(name, ts, dur, stream, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    events = []
    for base in (
        0,
        1000,
    ):  # two steps, each: copy-out, a wait, the block's first kernel, GEMM; NCCL elsewhere
        events += [
            on("split_with_sizes_copy", base, 100, 7),
            on("rms_norm_fwd", base + 900, 50, 7),  # 800 us after the copy-out
            on("Memcpy HtoD", base + 955, 5, 7, cat="gpu_memcpy"),
            on("nvjet_gemm", base + 962, 30, 7),  # 2 us after the copy: a launch's latency, not a gap
            on("ncclDevKernel_ReduceScatter", base + 100, 800, 26),
        ]
    s = summarize({"traceEvents": events, "loom_profiled_steps": 2})
    cs = s["compute_stream"]
    assert s["steps"] == 2 and cs["stream"] == 7
    # 800 us of gaps a step; the GEMM's 8 us to the next step's copy is none
    assert abs(cs["gap_ms_per_step"] - 0.8) < 1e-9
    # its kernels only (the copy is not one), by category: the copy-out 100, the norm 50, the GEMM 30 us a step
    assert abs(cs["kernel_ms_per_step"] - 0.18) < 1e-9
    assert cs["by_category_ms_per_step"] == {
        "copy / cast": 0.1,
        "fused elementwise (triton)": 0.05,
        "matmul": 0.03,
    }
    top = cs["gaps_by_neighbours"][0]
    assert (top["before"], top["after"], top["per_step"]) == ("split_with_sizes_copy", "rms_norm_fwd", 1.0)
    assert abs(top["ms_per_step"] - 0.8) < 1e-9


def test_skip_first_leaves_out_the_drained_step():
    """``skip_first``: the kernels launched in the first ProfilerStep range are left out and the steps counted are
    the rest; a trace without two step ranges cannot skip one."""
    import pytest

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 100, "dur": 100},
        launch(1, 5),
        run("nvjet_gemm", 10, 80, 1),
        launch(2, 105),
        run("nvjet_gemm", 110, 30, 2),
    ]
    full, later = summarize({"traceEvents": events}), summarize({"traceEvents": events}, skip_first=True)
    assert full["steps"] == 2 and abs(full["by_category_ms_per_step"]["matmul"] - 0.055) < 1e-12
    assert later["steps"] == 1 and abs(later["by_category_ms_per_step"]["matmul"] - 0.03) < 1e-12
    with pytest.raises(SystemExit, match="needs two or more ProfilerStep ranges; this trace has 0"):
        summarize({"traceEvents": [kernel("nvjet_gemm", 0, 10)]}, skip_first=True)


def test_fsdp_gathers_waits_split_by_cause():
    """Each unit's copy-out against the compute stream's last op before it: an idle stream while the unit's transfer
    still ran is a wait for the gather (its lag: from launch or copy-in end to start), one where the copy-out was
    launched after the stream ran dry a wait for the host; a trace without FSDP2's ranges (GPU-only) has none."""

    def rng(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "tid": tid}

    def op(name, ts, dur, stream, corr, cat="kernel"):
        return {
            "ph": "X",
            "cat": cat,
            "name": name,
            "ts": ts,
            "dur": dur,
            "args": {"stream": stream, "correlation": corr},
        }

    def call(corr, ts, tid=1):
        return {**launch(corr, ts), "tid": tid}

    events = [
        rng("ProfilerStep#1", 0, 1000),
        # layers.0: copy-in 100-120, transfer 130-180 (launched at 15: 10 us lag after the copy-in), copy-out at 200
        rng("FSDP::all_gather (layers.0)", 10, 10),
        call(1, 12),
        op("triton_poi_fused__to_copy_clamp_mul_0", 100, 20, 18, 1),
        call(2, 15),
        op("ncclDevKernel_AllGather_RING_LL", 130, 50, 22, 2),
        rng("FSDP::all_gather_copy_out (layers.0)", 21, 4),
        call(3, 22),
        op("Memcpy HtoD (Pinned -> Device)", 200, 5, 7, 3, cat="gpu_memcpy"),
        call(10, 5),
        op(
            "nvjet_gemm", 50, 100, 7, 10
        ),  # the compute stream runs dry at 150: 50 us waiting for the transfer
        # layers.1: a copy-engine transfer 305-335, the copy-out launched at 601, after the stream ran dry at 400
        rng("FSDP::all_gather (layers.1)", 300, 10),
        call(4, 302),
        op("Memcpy PtoP (Device -> Device)", 305, 30, 22, 4, cat="gpu_memcpy"),
        call(11, 205),
        op("nvjet_gemm", 210, 190, 7, 11),
        rng("FSDP::all_gather_copy_out (layers.1)", 600, 5),
        call(5, 601),
        op("split_with_sizes_copy", 602, 10, 7, 5),
    ]
    g = summarize({"traceEvents": events})["fsdp_gathers"]
    assert g["gathers_per_step"] == 2
    assert abs(g["wait_ms_per_step"] - 0.252) < 1e-9
    assert abs(g["wait_for_gather_ms_per_step"] - 0.05) < 1e-9
    assert abs(g["wait_for_host_ms_per_step"] - 0.202) < 1e-9
    first = g["largest_waits"][0]
    assert (first["unit"], first["cause"]) == ("layers.1", "host")
    second = g["largest_waits"][1]
    assert (second["unit"], second["cause"]) == ("layers.0", "gather")
    assert abs(second["lag_ms"] - 0.01) < 1e-9 and abs(second["copy_in_ms"] - 0.02) < 1e-9
    assert abs(second["transfer_ms"] - 0.05) < 1e-9
    assert abs(g["median_ms"]["transfer"] - 0.04) < 1e-9  # 50 and 30 us
    gpu_only = [e for e in events if e["cat"] not in ("user_annotation", "cuda_runtime")]
    assert summarize({"traceEvents": gpu_only, "loom_profiled_steps": 1})["fsdp_gathers"] is None

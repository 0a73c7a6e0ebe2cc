"""bench.peers, loom against torchtitan on the same GPUs: the TOML it writes for torchtitan holds the settings of the
loom config it runs beside it (parsed back with tomllib), loom's side of each workload builds torchtitan's shape
(parameter count and FLOPs per token against torchtitan 0.2.2's count of the flavor the tool registers), and the log
parser reads torchtitan's metrics line as its metrics processor prints it. No torchtitan run here: its trainer needs
CUDA (it sets ``cuda:<local rank>``)."""

from __future__ import annotations

import json
import tomllib

import pytest

from bench import peers

# torchtitan 0.2.2's parameter count and FLOPs per token (``get_nparams_and_flops``) of the flavor each workload
# registers, its model built on the meta device from the module ``peers.flavor_module`` writes (recorded on the CPU
# with torch 2.13; test_flavor_module_builds_the_recorded_shape re-derives them where torchtitan is installed)
TITAN_SHAPES = {
    "llama3_3b": (3_606_752_256, 2.773e10),
    "llama3_8b": (8_030_261_248, 5.791e10),
    "qwen3_moe_12l": (8_099_779_584, 8.379e09),
    "deepseek_v3_proxy": (6_654_008_320, 2.359e10),
    "qwen3_moe_8l_1gpu": (5_607_297_024, 6.208e09),
    "deepseek_v3_3l_1gpu": (5_718_203_392, 1.909e10),
    "llama3_debug": (360_768, 1.771392e6),
}


def _paths(tmp_path) -> dict:
    keys = ("data_dir", "titan_dir", "titan_py", "loom_dir", "loom_py", "loom_cache")
    out = {k: str(tmp_path / k) for k in keys}
    out["data_dir"] = str(tmp_path / "data")
    out.update(data_file=str(tmp_path / "data" / "data.jsonl"), tokenizer=str(tmp_path / "tokenizer"))
    out["loom_tokens"] = str(tmp_path / "loom_cache" / "data.bin")
    return out


@pytest.mark.parametrize("name", sorted(peers.WORKLOADS))
def test_the_toml_matches_the_loom_config(name, tmp_path):
    w = peers.WORKLOADS[name]
    paths = _paths(tmp_path)
    titan = tomllib.loads(peers.to_toml(peers.titan_config(w, 2, paths, peers.Matched())))
    loom = peers.loom_config(w, 2, paths, peers.Matched())
    t = titan["training"]
    assert (t["seq_len"], t["local_batch_size"], t["global_batch_size"], t["steps"], t["max_norm"]) == (
        loom["training.seq_len"],
        loom["training.micro_batch_size"],
        loom["training.global_batch_size"],
        loom["training.steps"],
        loom["training.max_norm"],
    )
    # fp32 master weights, bf16 compute, fp32 reduction: loom's training.dtype is the compute dtype
    assert (t["dtype"], t["mixed_precision_param"], t["mixed_precision_reduce"]) == (
        "float32",
        "bfloat16",
        "float32",
    )
    assert loom["training.dtype"] == "bfloat16"
    o = titan["optimizer"]
    assert (o["lr"], o["eps"], o["weight_decay"]) == (
        loom["optimizer.lr"],
        loom["optimizer.eps"],
        loom["optimizer.weight_decay"],
    )
    # the kernel is each framework's default (PyTorch's fused; loom's own): a difference the result lists
    assert o["implementation"] == "fused" and "optimizer.implementation" not in loom
    assert any(d.startswith("AdamW kernel") for d in peers.DIFFERENCES)
    assert (o["beta1"], o["beta2"]) == (0.9, 0.95)  # loom's optimizer.betas default
    assert titan["lr_scheduler"] == {"warmup_steps": 10, "decay_type": "cosine", "min_lr_factor": 0.1}
    assert (loom["optimizer.warmup_steps"], loom["optimizer.schedule"], loom["optimizer.min_lr_ratio"]) == (
        10,
        "cosine",
        0.1,
    )
    assert titan["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert loom["training.activation_checkpointing"] == "op"
    assert titan["compile"] == {"enable": True, "components": ["model", "loss"]}
    assert loom["training.compile"] == "true"
    par = titan["parallelism"]
    assert par["data_parallel_shard_degree"] == -1 and loom["parallel.dp_shard"] == 2  # every GPU in both
    assert par["expert_parallel_degree"] == loom["parallel.ep"] == w.ep
    assert titan["model"]["hf_assets_path"] == loom["data.tokenizer"]
    assert titan["training"]["dataset_path"] == paths["data_dir"]  # the text file's folder
    assert loom["data.source"] == paths["loom_tokens"]  # the same file, tokenized by loom data prepare
    assert titan["experimental"]["custom_import"] == peers.FLAVOR_MODULE
    assert (
        titan["model"]["flavor"] == peers.FLAVOR
        and titan["metrics"]["log_freq"] == loom["metrics.every"] == 1
    )
    assert titan["training"]["dataloader"]["num_workers"] == 1
    assert (
        "converters" not in titan["model"] and "quantize" not in titan and loom["training.float8"] == "none"
    )


def test_float8_and_the_reduce_dtype_are_the_same_on_both_sides(tmp_path):
    """--float8 tensorwise --float8-all-gather: torchtitan's float8 converter with torchao's recipe and FSDP float8
    gather, its output head left out as loom leaves it; --reduce-dtype bfloat16: its mixed_precision_reduce; loom's
    fields, a config loom resolves for 2 ranks."""
    from loom.config import build_config
    from loom.resolve import resolve

    w = peers.WORKLOADS["llama3_3b"]
    paths = _paths(tmp_path)
    f8 = peers.Matched(float8="tensorwise", float8_all_gather=True, reduce_dtype="bfloat16")
    titan = tomllib.loads(peers.to_toml(peers.titan_config(w, 2, paths, f8)))
    loom = peers.loom_config(w, 2, paths, f8)
    assert titan["training"]["mixed_precision_reduce"] == loom["parallel.reduce_dtype"] == "bfloat16"
    assert titan["model"]["converters"] == ["quantize.linear.float8"]
    assert titan["quantize"]["linear"][
        "float8"
    ] == {  # torchtitan 0.2.2 refuses a recipe name with the gather
        "enable_fsdp_float8_all_gather": True,
        "precompute_float8_dynamic_scale_for_fsdp": True,
        "filter_fqns": ["output"],
    }
    plain = tomllib.loads(peers.to_toml(peers.titan_config(w, 2, paths, peers.Matched(float8="rowwise"))))
    assert plain["quantize"]["linear"]["float8"]["recipe_name"] == "rowwise"
    assert (loom["training.float8"], loom["training.float8_all_gather"]) == ("tensorwise", "true")
    cfg = {k: str(v) for k, v in loom.items() if not k.startswith(("data.", "run."))}
    resolve(build_config(None, cfg), 2, device="cuda", triton=False)


def test_other_ac_modes_and_refusals():
    assert peers.ac_sections("full") == {"mode": "full"}
    with pytest.raises(SystemExit, match="every_k"):
        peers.ac_sections("every_k")
    assert peers._toml_literal("8") == 8 and peers._toml_literal("rowwise") == "rowwise"
    deeper = peers.with_layers(peers.WORKLOADS["deepseek_v3_proxy"], 5)  # --layers: both sides
    assert deeper.titan_args["n_layers"] == deeper.loom_model["model.n_layers"] == 5
    assert deeper.titan_args["attn_type"] == "sdpa" and deeper.loom_model["model.moe_experts"] == 64


@pytest.mark.parametrize("name", sorted(peers.WORKLOADS))
def test_loom_builds_torchtitans_shape(name, tmp_path):
    w = peers.WORKLOADS[name]
    cfg = peers.loom_config(w, w.gpus, _paths(tmp_path), peers.Matched())
    cfg.update({"data.tokenizer": "byte", "data.source": "", "run.device": "cpu"})
    shape = peers.loom_shape(cfg)
    params, flops = TITAN_SHAPES[name]
    assert shape["params"] == params
    # torchtitan's count also takes 6 FLOPs per norm weight (1e-3 of the debug model's, less elsewhere)
    assert shape["flops_per_token"] == pytest.approx(flops, rel=2e-3)


def test_flavor_module_builds_the_recorded_shape(tmp_path, monkeypatch):
    pytest.importorskip("torchtitan")
    import importlib
    import sys

    import torch
    from torchtitan.config import ConfigManager

    monkeypatch.syspath_prepend(str(tmp_path))
    for name, w in peers.WORKLOADS.items():
        (tmp_path / f"{peers.FLAVOR_MODULE}.py").write_text(peers.flavor_module(w))
        sys.modules.pop(peers.FLAVOR_MODULE, None)
        importlib.import_module(peers.FLAVOR_MODULE)
        from torchtitan.protocols.train_spec import get_train_spec

        spec = get_train_spec(w.titan_model)
        args = spec.model_args.pop(peers.FLAVOR)
        toml = tmp_path / f"{name}.toml"
        toml.write_text(peers.to_toml(peers.titan_config(w, 2, _paths(tmp_path), peers.Matched())))
        args.update_from_config(ConfigManager().parse_args(["--job.config_file", str(toml)]))
        with torch.device("meta"):
            model = spec.model_cls(args)
        params, flops = args.get_nparams_and_flops(model, w.seq)
        assert (params, pytest.approx(flops, rel=1e-3)) == TITAN_SHAPES[name]


# torchtitan's metrics line (components/metrics.py MetricsProcessor.log) with its colours, behind its logger's
# format ("[titan] %(asctime)s - %(name)s - %(levelname)s - %(message)s") and torchrun's --role rank --tee prefix;
# the MoE models' count line (models/utils.py) comes before the total the parser reads. Checked against torchtitan
# 0.2.2's own output: its trainer run on the CPU through bench.peers.run_titan (gloo, a device shim; 2026-11-28)
_LOG = """[rank0]:[titan] 2026-11-27 10:00:01,000 - root - INFO - Building llama3 loom_peerwith {
[rank0]:  "dim": 3072,
[rank0]:  "n_layers": 28
[rank0]:}
[rank0]:[titan] 2026-11-27 10:00:02,000 - root - INFO - Total parameter count: dense 848,876,544, sparse \
7,250,903,040, active 1,305,007,104
[rank0]:[titan] 2026-11-27 10:00:02,000 - root - INFO - \x1b[34mModel llama3 loom_peer \x1b[31msize: 3,606,752,256 \
total parameters\x1b[39m
[rank0]:[titan] 2026-11-27 10:00:03,000 - root - INFO - Peak FLOPS used for computing MFU: 9.890e+14
[rank0]:[titan] 2026-11-27 10:00:40,000 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 12.25000  \
\x1b[38;2;180;60;0mgrad_norm:  4.1234  \x1b[38;2;54;234;195mmemory: 39.87GiB(28.50%)  \x1b[34mtps: 1,234  \
\x1b[36mtflops: 34.22  \x1b[35mmfu: 3.46%\x1b[39m
[rank0]:[titan] 2026-11-27 10:00:41,000 - root - INFO - step: 10  loss:  7.81250  grad_norm:  1.0000  \
memory: 41.40GiB(29.60%)  tps: 16,701  tflops: 463.13  mfu: 46.83%
[rank0]:[titan] 2026-11-27 10:00:42,000 - root - WARNING - Dataset c4_test is being re-looped
[rank0]:[titan] 2026-11-27 10:00:43,000 - root - INFO - step: 11  loss:  3.25000  grad_norm:  0.8000  \
memory:  9.50GiB(65.00%)  tps: 7,300  tflops: 0.52  mfu: 0.17%
"""


def test_the_log_parser_reads_torchtitans_metrics_lines():
    out = peers.parse_titan_log(_LOG)
    first, second, third = out["steps"]
    # a one-digit memory figure is padded to width 5 (torchtitan's "{:5.2f}GiB")
    assert (third["step"], third["mem_gib"], third["tps"], third["mfu"]) == (
        11,
        9.5,
        7300.0,
        pytest.approx(0.0017),
    )
    assert first == {
        "step": 1,
        "loss": 12.25,
        "grad_norm": 4.1234,
        "mem_gib": 39.87,
        "mem_pct": 28.5,
        "tps": 1234.0,
        "tflops": 34.22,
        "mfu": pytest.approx(0.0346),
    }
    assert (second["step"], second["tps"], second["mem_gib"], second["mfu"]) == (10, 16701.0, 41.4, 0.4683)
    assert out["peak_flops"] == 989e12 and out["params"] == 3_606_752_256
    assert out["model_args"] == {"dim": 3072, "n_layers": 28}


def test_medians_leave_out_the_warmup_and_mfu_is_given_on_both_conventions():
    assert peers.timed([9.0, 1.0, 2.0, 3.0], 1) == [1.0, 2.0, 3.0]
    assert peers.timed([9.0], 5) == [9.0]  # fewer steps than the warm-up: all of them
    assert peers.timed([9.0, 1.0, 2.0, 20.0, 30.0], 1, profiled=2) == [
        1.0,
        2.0,
    ]  # profiler warm-up, step out
    assert peers.timed([9.0, 1.0, 2.0, 10.0, 20.0, 30.0], 1, profiled=3) == [1.0, 2.0]  # loom's: two recorded
    titan = {"tokens_per_s_per_gpu": 1000.0, "mfu": 0.30, "peak_flops": 1e15, "flops_per_token": 3e11}
    loom = {"tokens_per_s_per_gpu": 1200.0, "mfu": 0.372}  # loom counts 3.1e11 FLOPs per token here
    peers.conventions(titan, loom)
    assert titan["mfu_torchtitan_convention"] == 0.30 and loom["mfu_loom_convention"] == 0.372
    assert loom["mfu_torchtitan_convention"] == pytest.approx(0.36)
    assert titan["mfu_loom_convention"] == pytest.approx(0.31)


def test_the_shared_inputs(tmp_path):
    pytest.importorskip("tokenizers")
    path = tmp_path / "data" / "data.jsonl"
    docs = peers.write_text(str(path), 0.05)
    lines = path.read_text().splitlines()
    assert docs == len(lines) > 0 and all(json.loads(ln)["text"] for ln in lines)
    vocab = peers.make_tokenizer(str(tmp_path / "tok"), str(path), 1000, bpe_vocab=300, train_mb=0.05)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert vocab == tok.get_vocab_size() == 1000  # the model's vocabulary, filled with reserved tokens
    assert tok.token_to_id("<|end_of_text|>") is not None
    cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert cfg == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}


def test_the_first_step_line_of_loom_is_recognized():
    from loom.metrics.logger import format_line

    rec = {"step": 1, "loss": 7.65, "grad_norm": 0.76, "lr": 1e-4, "tokens_per_s": 2100.0}
    line = format_line({**rec, "tokens_per_s_per_device": 1050.0, "mfu": None, "mem_gib": 0.47}, 30)
    assert peers._LOOM_STEP.search(line) and not peers._LOOM_STEP.search("batch: 4 x 256 tokens per step")


def test_a_run_that_stops_printing_is_killed_at_its_timeout(tmp_path):
    run = peers.stream(
        ["bash", "-c", "echo 'step 1/3 | loss 1'; sleep 30"], {}, 0.5, str(tmp_path / "log"), peers._LOOM_STEP
    )
    assert run["rc"] != 0 and run["first_step_s"] is not None and run["wall_s"] < 10
    assert run["output"].endswith("killed after 0 s\n") and (tmp_path / "log").read_text().startswith(
        "step 1/3"
    )


def test_loom_processes_get_torchtitans_sdpa_backends(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(peers.SDPA_SITECUSTOMIZE)
    probe = (
        "import torch; from torch.nn.attention import SDPBackend as B; "
        "order = torch._C._get_sdp_priority_order(); "
        "print(order[:3] == [int(B.CUDNN_ATTENTION), int(B.FLASH_ATTENTION), int(B.MATH)], "
        "torch.backends.cuda.mem_efficient_sdp_enabled())"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [
        "True",
        "False",
    ]  # cuDNN, flash, math first; memory-efficient off, as torchtitan


def test_profile_sections_and_the_summary_of_a_kept_trace(tmp_path):
    import gzip

    prof = peers.titan_profiling(7)
    assert (
        prof["profile_freq"] - prof["profiler_warmup"] - prof["profiler_active"] == 5
    )  # its wait: the last step
    # loom records the last two steps (the first starts drained); a GPU-only trace the last one
    assert peers.loom_profiling(7) == {"metrics.profile_steps": "6:7", "metrics.profile_memory": "false"}
    assert peers.loom_profiling(7, host=False)["metrics.profile_steps"] == "7:7"
    assert peers.loom_profiling(1)["metrics.profile_steps"] == "1:1"
    trace = tmp_path / "trace_rank0.json"
    kernel = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}
    step = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "ts": 0, "dur": 100}
    trace.write_text(
        json.dumps({"traceEvents": [step, kernel("nvjet_gemm", 0, 60), kernel("ncclDevKernel_X", 60, 40)]})
    )
    rank1 = tmp_path / "trace_rank1.json"  # a rank whose gather waited longer
    rank1.write_text(
        json.dumps({"traceEvents": [step, kernel("nvjet_gemm", 0, 30), kernel("ncclDevKernel_X", 30, 70)]})
    )
    out = peers.profile_summary(str(trace), str(tmp_path / "keep"), "loom")
    assert out["by_category_ms_per_step"] == {"matmul": 0.06, "communication": 0.04}
    assert out["exposed_communication_ms_per_step"] == pytest.approx(0.04)
    assert out["other_ranks"]["1"]["communication_ms_per_step"] == pytest.approx(0.07)
    assert out["other_ranks"]["1"]["exposed_communication_ms_per_step"] == pytest.approx(0.07)
    assert [k.rsplit("/", 1)[-1] for k in out["kept"]] == [
        "loom_trace_rank0.json.gz",
        "loom_trace_rank1.json.gz",
    ]
    for kept, src in zip(out["kept"], (trace, rank1)):
        assert json.loads(gzip.open(kept).read()) == json.loads(src.read_text())
    assert "error" in peers.profile_summary(str(tmp_path / "absent.json"), "", "loom")


def test_loom_variants_parse_and_print():
    """--loom-variant NAME:KEY=VALUE[;...]: its fields, a usage error naming the spec, and one summary line each."""
    from bench import peers

    assert peers.parse_variant("padded:parallel.ep_exchange=padded;training.max_norm=0.5") == (
        "padded",
        ("parallel.ep_exchange=padded", "training.max_norm=0.5"),
    )
    assert peers.split_fields(("parallel.zero=2", "env.NCCL_MAX_NCHANNELS=8", "x.y=a=b")) == (
        {"parallel.zero": "2", "x.y": "a=b"},
        {"NCCL_MAX_NCHANNELS": "8"},
    )
    with pytest.raises(ValueError, match="env.NAME=VALUE"):
        peers.parse_variant("nc:parallel.zero=2;env.=8")
    for bad in ("padded", "padded:", "pa dded:x=1", ":x=1", "padded:x"):
        with pytest.raises(ValueError, match="NAME:KEY=VALUE"):
            peers.parse_variant(bad)
    doc = {
        "loom": {"tokens_per_s_per_gpu": 1000.0, "peak_reserved_gib": 1.0, "launch_to_first_step_s": 2.0},
        "loom_variants": {
            "padded": {
                "fields": ["parallel.ep_exchange=padded"],
                "tokens_per_s_per_gpu": 1200.0,
                "ratio": 1.1,
            },
            "broken": {"fields": ["x=1"], "error": "boom"},
        },
    }
    lines = peers.summary(doc).splitlines()
    assert (
        lines[-2] == "loom variant padded (parallel.ep_exchange=padded): 1,200 tok/s/GPU, 1.100x torchtitan"
    )
    assert lines[-1] == "loom variant broken (x=1): ERROR"


def test_gpu_samples_summarize_each_gpu_and_nothing_without_nvml():
    from bench.common import GpuSampler, summarize_gpu_samples

    samples = {
        0: [
            (1980, 650.0, 60, 100, 0),
            (1980, 690.0, 66, 99, 0x4),
            (1800, 300.0, 50, 40, 0),
            (345, 90.0, 40, 0, 1),
        ],
        1: [(1755, 700.0, 70, 100)],  # no reasons read: not counted as capped
    }
    out = summarize_gpu_samples(samples, {"0": 700.0})
    assert out["0"] == {
        "samples": 4,
        "busy_samples": 3,
        "sm_clock_mhz_median": 1980,
        "power_w_median": 650.0,
        "temperature_c_max": 66,
        "utilization_median": 99,
        "steady": {
            "samples": 2,
            "sm_clock_mhz_median": 1980,
            "power_w_median": 670.0,
            "power_capped_share": 0.5,
        },
        "power_limit_w": 700.0,
    }
    assert out["1"]["sm_clock_mhz_median"] == 1755  # the slower GPU stands out
    assert out["1"]["steady"]["power_capped_share"] == 0 and "power_limit_w" not in out["1"]
    from bench.common import joules_per_token
    from bench.peers import power_line

    run = {"gpus": out, "tokens_per_s_per_gpu": 10_000.0}
    assert power_line(run) == "; GPU 0 in its steps 670 W, 1,980 MHz, power-capped 50%"
    run["joules_per_token"] = joules_per_token(out, 10_000.0)
    assert run["joules_per_token"] == 0.0685  # (670 + 700) / 2 W over 10,000 tokens/s
    assert power_line(run).endswith("power-capped 50%, 68.5 mJ/token")
    assert power_line({}) == "" and power_line({"gpus": {"0": {"samples": 1}}}) == ""
    assert joules_per_token(out, None) is None and joules_per_token(None, 1.0) is None
    assert summarize_gpu_samples({}) is None and summarize_gpu_samples(None) is None
    with GpuSampler(every_s=0.01) as s:  # on a machine without a GPU (or NVML) it samples nothing, silently
        pass
    import torch

    if not torch.cuda.is_available():
        assert s.summary() is None


def test_rounds_give_each_ratio_per_round_and_its_median(monkeypatch, capsys):
    """--rounds N: each round's tokens/s of each side and variant with its ratio to that round's torchtitan run, the
    ratios' median over the rounds (a variant that failed in a round counts in none), one summary line each; refused
    below 1 and with --profile."""
    rounds = []
    for titan, loom, z2 in (
        (10_000.0, 12_000.0, 12_500.0),
        (11_000.0, 12_100.0, None),
        (10_500.0, 12_600.0, 12_400.0),
    ):
        doc = {
            "torchtitan": {"tokens_per_s_per_gpu": titan, "peak_reserved_gib": 80.0, "log": ["..."]},
            "loom": {"tokens_per_s_per_gpu": loom, "peak_reserved_gib": 81.0},
            "loom_variants": {"z2": {"tokens_per_s_per_gpu": z2} if z2 else {"error": "boom"}},
        }
        rounds.append(peers.round_figures(doc))
    assert rounds[0]["torchtitan"] == {"tokens_per_s_per_gpu": 10_000.0, "peak_reserved_gib": 80.0}
    assert rounds[1]["variant z2"] == {"error": "boom"}
    assert rounds[2]["loom"]["ratio"] == pytest.approx(1.2)
    doc = {
        "loom_variants": {
            "z2": {"fields": ["parallel.zero=2"], "tokens_per_s_per_gpu": 12_500.0, "ratio": 1.25}
        }
    }
    peers.over_rounds(doc, rounds)
    assert doc["ratio_over_rounds"]["per_round"] == pytest.approx([1.2, 1.1, 1.2])
    assert doc["ratio_over_rounds"]["median"] == pytest.approx(1.2)
    assert doc["loom_variants"]["z2"]["ratio_over_rounds"]["per_round"] == pytest.approx(
        [1.25, 12_400 / 10_500]
    )
    lines = peers.summary(doc).splitlines()
    assert lines[0] == "loom / torchtitan over 3 rounds: 1.200, 1.100, 1.200; median 1.200"
    assert lines[1].startswith(
        "loom variant z2 (parallel.zero=2): 12,500 tok/s/GPU, 1.250x torchtitan (over 2 rounds: "
    )
    for argv, why in (
        (["--rounds", "0"], "at least 1"),
        (["--rounds", "2", "--profile"], "profile one round"),
    ):
        monkeypatch.setattr("sys.argv", ["peers", "--workload", "llama3_debug", "--sides", "loom", *argv])
        with pytest.raises(SystemExit) as e:
            peers.main()
        assert e.value.code == 2 and why in capsys.readouterr().err

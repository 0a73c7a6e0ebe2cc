"""``loom plan --generate`` (loom.plan.generate): the KV cache's bytes against the model's own K/V tensors, the 8B
shape's weights and decode rate on an H100, tensor parallelism's split, the decode roofline's growth with the
context, and the command's output and errors."""

from __future__ import annotations

import json
import types

import pytest
import torch

from loom.cli.main import main as loom_main
from loom.config import build_config
from loom.models.llama.flavors import FLAVORS
from loom.models.llama.model import Llama
from loom.plan import decode_time_per_token
from loom.plan.generate import (
    attention_kind,
    cache_shape,
    decode_seconds,
    decode_step,
    generation_args,
    kv_cache_bytes,
    plan_generation,
    weight_bytes,
)
from loom.plan.hardware import GPUS

H100 = GPUS["H100"]


def test_kv_cache_bytes_count_the_models_own_k_and_v():
    """Only the KV heads are cached: the bytes of every layer's K and V projections of a (B, S) batch, computed by
    the debug model itself in bf16."""
    args = FLAVORS["debug"].with_(vocab_size=256)
    model = Llama(args).to(torch.bfloat16)
    batch, seq = 3, 17
    x = torch.randn(batch, seq, args.dim, dtype=torch.bfloat16)  # (B, S, E)
    counted = 0
    for block in model.layers.values():
        k = block.attention.wk(x).view(batch, seq, -1, args.head_dim)  # (B, S, Hkv, D)
        v = block.attention.wv(x).view(batch, seq, -1, args.head_dim)
        counted += k.nbytes + v.nbytes
    assert kv_cache_bytes(args, batch, seq, "bfloat16") == counted
    assert kv_cache_bytes(args, batch, seq, "float32") == 2 * counted
    assert attention_kind(args) == "gqa" and args.n_kv_heads < args.n_heads  # the debug model is GQA
    assert kv_cache_bytes(args, batch, seq, "bfloat16", tp=2) == counted / 2


def test_kv_cache_bytes_equal_the_engines_cache():
    """The cache loom.infer installs in the debug model (every layer's buffers) holds what the plan counts."""
    from loom.infer.cache import install

    args = FLAVORS["debug"].with_(vocab_size=256)
    model = Llama(args)
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        caches = install(model, 3, 40, dtype, "cpu")
        held = sum(b.nbytes for cache in caches for b in cache.buffers())
        assert held == kv_cache_bytes(args, 3, 40, name)
        assert sum(cache.bytes_per_token for cache in caches) == kv_cache_bytes(args, 1, 1, name)


def test_mla_caches_the_latent_and_the_rope_key_for_every_head():
    """DeepSeek-V2's 512 + 64 elements per layer, against 2 x 8 KV heads x 128 for an 8-KV-head GQA layer (about
    3.6x smaller); the latent is shared by every head, so tensor parallelism does not split it. The formula reads
    only the shape's numbers: a namespace of DeepSeek-V2-Lite's stands in where the MLA flavor is not there."""
    args = FLAVORS.get("deepseek_v2_lite") or types.SimpleNamespace(
        n_layers=27, n_heads=16, kv_lora_rank=512, qk_rope_head_dim=64
    )
    assert attention_kind(args) == "mla" and cache_shape(args).elements == 512 + 64
    assert kv_cache_bytes(args, 4, 10, "bfloat16") == 27 * 4 * 10 * 576 * 2
    assert kv_cache_bytes(args, 4, 10, "bfloat16", tp=2) == kv_cache_bytes(args, 4, 10, "bfloat16")
    gqa = cache_shape(FLAVORS["8B"]).elements
    assert gqa == 2 * 8 * 128 and gqa / 576 == pytest.approx(3.56, abs=0.01)
    if hasattr(args, "cache_elements_per_token"):  # the model's own statement of it
        assert cache_shape(args).elements == args.cache_elements_per_token


@pytest.mark.parametrize("flavor", ["debug_mla", "deepseek_v2_lite"])
def test_mla_parameters_match_the_model(flavor):
    """Weights per GPU of an MLA model: the planner's count against a meta-device model, and tp's share (the
    compressions and their norms replicated, the per-head projections split)."""
    if flavor not in FLAVORS:
        pytest.skip(f"no {flavor} flavor (multi-head latent attention) in this tree")
    from loom.plan.shapes import attention_split

    args = FLAVORS[flavor].with_(vocab_size=FLAVORS[flavor].vocab_size or 256)
    with torch.device("meta"):
        model = Llama(args)
    assert weight_bytes(args, 1, "bfloat16") == 2 * sum(p.numel() for p in model.parameters())
    attention = model.layers["0"].attention
    replicated = sum(
        p.numel()
        for name, p in attention.named_parameters()
        if name.split(".")[0] in ("wq_a", "q_a_norm", "wkv_a", "kv_a_norm")
    )
    assert attention_split(args) == (sum(p.numel() for p in attention.parameters()) - replicated, replicated)
    plan = plan_generation(args, 2, 64, 16, H100)
    assert (
        plan.attention == "mla"
        and plan.kv_bytes_per_token == args.n_layers * 2 * args.cache_elements_per_token
    )


def test_8b_on_an_h100_weights_and_decode_rate():
    """Llama-3-8B holds 8.03e9 parameters: 16.06e9 bytes in bf16. A batch-1 decode step streams them but for the
    untied input embedding (a step looks up one of its 128,256 rows): 15.01e9 bytes, so at the raw 3.35 TB/s the
    roofline is ~223 tokens/s. Counting every weight (the usual 16 GB / 3.35 TB/s figure) gives ~209; the plan, at
    the measured share of the bandwidth, ~135."""
    args = FLAVORS["8B"]
    weights = weight_bytes(args, 1, "bfloat16")
    assert weights == pytest.approx(16.06e9, rel=1e-3)
    assert 190 < H100.hbm_tbps * 1e12 / weights < 210  # every weight read once per token
    raw = decode_step(args, 1, 1, H100, hbm_share=1.0)
    embedding = args.vocab_size * args.dim * 2
    assert raw.weight_bytes == pytest.approx(weights - embedding + args.dim * 2)
    assert 215 < 1 / raw.seconds < 230
    assert raw.bound == "memory" and raw.roofline_s == raw.seconds
    assert 155 < 1 / decode_time_per_token(args, 1, 1024, "H100") < 170  # at DECODE_HBM_SHARE


def test_decode_plan_against_the_measured_h100_run():
    """The plan of the 8B shape's decode steps against bench/results/generate_8b_h100.json (prompt 128, 128 new:
    the mean context 192): batch 1 (what DECODE_HBM_SHARE was read from) within 2%, batches 8 and 64 (what
    DECODE_HBM_SHARE_BATCHED was fitted to) within 5%."""
    import json
    import os

    with open(
        os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results", "generate_8b_h100.json")
    ) as fh:
        doc = json.load(fh)
    loom = next(r for r in doc["results"] if r.get("system") == "loom")
    assert [row["batch"] for row in loom["decode"]] == [1, 8, 64]
    for row, tol in zip(loom["decode"], (0.02, 0.05, 0.05)):
        planned = decode_time_per_token(FLAVORS["8B"], row["batch"], 192, "H100")
        assert planned == pytest.approx(row["step_ms"] / 1e3, rel=tol), row["batch"]


def test_tensor_parallel_halves_weights_and_cache_and_adds_collectives():
    args = FLAVORS["8B"]
    one, two = (plan_generation(args, 4, 512, 64, H100, tp=tp) for tp in (1, 2))
    assert two.memory.weights == pytest.approx(
        one.memory.weights / 2, rel=1e-4
    )  # but for the replicated norms
    assert two.memory.kv_cache == one.memory.kv_cache / 2
    assert one.first.tp_s == 0 < two.first.tp_s and one.prefill.tp_s == 0 < two.prefill.tp_s
    assert two.first.weight_bytes == pytest.approx(one.first.weight_bytes / 2, rel=1e-3)
    assert two.first.memory_s < one.first.memory_s < two.first.seconds * 2


def test_decode_grows_with_the_context_and_turns_compute_bound_at_large_batch():
    args = FLAVORS["8B"]
    plan = plan_generation(args, 8, 1000, 3001, H100)
    assert plan.first.context == 1001 and plan.last.context == 4000
    grew = plan.last.kv_bytes - plan.first.kv_bytes
    assert grew == kv_cache_bytes(args, 8, 2999, "bfloat16")  # every sequence reads 2999 more positions
    assert plan.first.seconds < plan.mean_step_s < plan.last.seconds
    # memory-bound throughout: the mean step is the step at the mean context
    assert plan.mean_step_s == pytest.approx(decode_step(args, 8, 2500.5, H100).seconds)
    big = decode_step(args, 4096, 1, H100)
    assert big.bound == "compute" and decode_step(args, 1, 1, H100).bound == "memory"
    # the exact sum across the bound's change equals a step-by-step sum
    steps = range(1, 800)

    def step(c):
        return decode_step(args, 1100, c, H100)

    assert step(1).bound != step(799).bound
    assert decode_seconds(step, 1, 799) == pytest.approx(sum(step(c).seconds for c in steps), rel=1e-12)


def test_generation_memory_fits_and_the_largest_batch():
    args = FLAVORS["8B"]
    plan = plan_generation(args, 1, 1024, 1024, H100)
    assert plan.fits and plan.memory.activations > 0 and plan.prefill.bound == "compute"
    at_max = plan_generation(args, plan.max_batch, 1024, 1024, H100)
    over = plan_generation(args, plan.max_batch + 1, 1024, 1024, H100)
    assert at_max.fits and not over.fits
    assert not plan_generation(FLAVORS["70B"], 1, 1024, 1024, H100).fits  # 140 GB of bf16 weights


def test_moe_decode_reads_the_experts_its_tokens_go_to():
    args = FLAVORS["debug_moe"].with_(vocab_size=256)
    one, many = decode_step(args, 1, 16, H100), decode_step(args, 4096, 16, H100)
    expert = 3 * args.dim * args.expert_ffn_dim * 2
    rows = 4095 * args.dim * 2  # the embedding rows of the other tokens
    # one token: its top 2 of 4 experts; thousands of tokens: all 4
    assert many.weight_bytes - one.weight_bytes - rows == pytest.approx(args.n_layers * 2 * expert, rel=1e-6)
    table = args.vocab_size * args.dim * 2  # held, but only the batch's rows are read
    assert many.weight_bytes - 4096 * args.dim * 2 == pytest.approx(weight_bytes(args, 1, "bfloat16") - table)


def test_moe_families_plan_generation_in_float32():
    """The MoE families' generation is planned in float32 too (its experts' prefill traced through the grouped
    GEMM's shapes), with a block that has experts: DeepSeek-V3's and Qwen3-MoE's first blocks are dense."""
    from loom.plan.activations import forward_peak

    for flavor in ("deepseek_v3_debug", "qwen3_moe_debug"):
        cfg = build_config(None, {"model.flavor": flavor})
        args = generation_args(cfg, 1, "float32", 80)
        plan = plan_generation(args, 1, 64, 16, H100, dtype="float32")
        assert plan.fits and plan.memory.activations > 0
        wide = args.with_(moe_ffn_dim=1024)  # experts wide enough that their hidden states set the peak
        dense = forward_peak(
            wide.with_(moe_experts=0), 1, 64, "float32"
        )  # (before: the dense block 0 crashed)
        assert forward_peak(wide, 1, 64, "float32") > dense  # k slots a token through 1024-wide experts


def test_generation_args_check_tensor_parallelism():
    from loom.config.errors import ConfigError

    cfg = build_config(None, {"model.flavor": "debug"})
    args = generation_args(cfg, 2, "bfloat16", 300)
    assert args.max_seq_len == 300 and args.vocab_size > 0
    with pytest.raises(ConfigError, match="--gpus = 4: must divide the model's KV heads"):
        generation_args(cfg, 4, "bfloat16", 300)


def _loom(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = loom_main(["plan", *argv])
    except SystemExit as exit:
        code = exit.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_generate_prints_and_writes_json(tmp_path, capsys):
    out = tmp_path / "gen.json"
    code, stdout, err = _loom(
        capsys,
        "--generate",
        "--model.flavor",
        "8B",
        "--batch",
        "2",
        "--prompt-len",
        "512",
        "--output-len",
        "128",
        "--gpus",
        "2",
        "--dtype",
        "bf16",
        "--json",
        str(out),
    )
    assert code == 0, err
    for text in (
        "on 2 x H100 (tensor parallel 2)",
        "memory per GPU, GiB: weights 7.48",
        "KV cache (gqa): 128.0 KiB",
        "time to first token",
        "decode, ms per step",
        "tokens/s at batch 2",
        "65 all-reduces",
        "HBM 3.35 TB/s",
    ):
        assert text in stdout, stdout
    report = json.loads(out.read_text())["generate"]
    assert report["tp"] == 2 and report["kv_bytes_per_token"] == 131072 and report["fits"]
    assert report["decode_first"]["context"] == 513 and report["decode_last"]["context"] == 639
    assert report["decode_first"]["ms"] <= report["decode_mean_ms"] <= report["decode_last"]["ms"]


@pytest.mark.parametrize(
    "argv,expect",
    [
        (["--batch", "2"], "--batch = '2': only with --generate"),
        (["--generate", "--output-len", "8"], "--prompt-len: required with --generate"),
        (
            ["--generate", "--prompt-len", "8", "--output-len", "8", "--search"],
            "--search: not with --generate",
        ),
        (
            ["--generate", "--prompt-len", "0", "--output-len", "8"],
            "--prompt-len = 0: expected a positive integer",
        ),
        (
            ["--generate", "--prompt-len", "8", "--output-len", "8", "--dtype", "int4"],
            "--dtype = 'int4': allowed",
        ),
        (["--generate", "--prompt-len", "8", "--output-len", "8", "--gpus", "3"], "--gpus = 3: must divide"),
    ],
)
def test_cli_generate_errors_are_one_line(capsys, argv, expect):
    code, _, err = _loom(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expect in lines[0], err

"""``loom plan --roofline``: ops placed on the roofline against hand-computed cases (a square matmul, a norm, a
collective), the step's op list against the model's shape (matmul and attention FLOPs, ring CP's sends), a run's
measured step from its metrics.jsonl, and the CLI's table, JSON and plot."""

from __future__ import annotations

import json

import pytest

from loom.config import ConfigError, build_config
from loom.plan.hardware import GPUS
from loom.plan.roofline import Op, collective, matmul, measured_step, roofline
from loom.plan.shapes import attention_params
from loom.plan.timing import attention_flops

H100 = GPUS["H100"]  # 989 TFLOP/s bf16, 3.35 TB/s: machine balance 295.2 FLOP/B


def test_a_square_matmul_is_compute_bound_at_peak():
    op = matmul("mm", 1, 4096, 4096, 4096, 2)
    assert op.flops == 6 * 4096**3  # forward, input gradient, weight gradient
    assert op.hbm_bytes == 3 * 3 * 4096**2 * 2  # each of the three reads two operands and writes one, bf16
    assert op.intensity == pytest.approx(4096 / 3)
    assert op.bound(H100, "bfloat16") == "compute" and op.ceiling(H100, "bfloat16") == pytest.approx(989e12)
    assert op.seconds(H100, "bfloat16") == pytest.approx(6 * 4096**3 / 989e12)


def test_a_thin_matmul_and_a_norm_are_hbm_bound():
    thin = matmul("mm", 1, 16, 4096, 4096, 2)  # decode-like: 16 tokens
    # 6 x 16 x 4096² FLOPs over 3 x (2 x 16 x 4096 + 4096²) x 2 bytes
    want = 6 * 16 * 4096**2 / (3 * (2 * 16 * 4096 + 4096**2) * 2)
    assert thin.intensity == pytest.approx(want) and want < 16
    assert thin.bound(H100, "bfloat16") == "HBM"
    assert thin.ceiling(H100, "bfloat16") == pytest.approx(want * 3.35e12)
    norm = Op("rmsnorm", 1, 12 * 1000, 5 * 1000 * 2)  # 12 FLOPs and 5 bf16 elements per element
    assert norm.intensity == pytest.approx(1.2) and norm.bound(H100, "bfloat16") == "HBM"
    assert norm.ceiling(H100, "bfloat16") == pytest.approx(1.2 * 3.35e12)


def test_a_collective_is_network_bound_with_no_flops():
    op = collective("all-gather", 2, 1e9, 4, 100.0)  # each sends 3/4 of 1 GB, twice, at 100 GB/s
    assert op.comm_bytes == pytest.approx(1.5e9) and op.flops == 0 and op.ceiling(H100, "bfloat16") == 0.0
    assert op.bound(H100, "bfloat16") == "network" and op.seconds(H100, "bfloat16") == pytest.approx(0.015)
    reduce = collective("all-reduce", 1, 1e9, 4, 100.0, all_reduce=True)
    assert reduce.comm_bytes == pytest.approx(1.5e9)


def _cfg(**over):
    base = {
        "model.flavor": "1B",
        "training.dtype": "bfloat16",
        "training.seq_len": "4096",
        "training.global_batch_size": "2",
        "training.micro_batch_size": "1",
    }
    return build_config(None, {**base, **{k: str(v) for k, v in over.items()}})


def test_the_step_counts_the_models_matmuls_attention_and_ring_sends():
    ops, what = roofline(_cfg(**{"parallel.cp": 2, "parallel.cp_method": "ring"}), 2, H100)
    by = {op.name: op for op in ops}
    from loom.models.llama.flavors import FLAVORS

    a = FLAVORS["1B"]
    tokens, calls = (
        4096 / 2,
        16 * 2,
    )  # seq / cp per micro-batch; 16 blocks x 2 micro-batches (global 2 / dp 1)
    assert what["tokens_per_micro_batch"] == tokens and what["blocks"] * what["micro_batches"] == calls
    block = sum(by[n].flops for n in ("wq", "wk", "wv", "wo", "w1 (gate)", "w3 (up)", "w2 (down)"))
    assert block == pytest.approx(6 * (attention_params(a) + 3 * a.dim * a.ffn_dim) * tokens * calls)
    assert by["head"].flops == pytest.approx(6 * a.vocab_size * a.dim * tokens * 2)
    assert by["attention"].flops == pytest.approx(
        calls * attention_flops(1, a.n_heads, a.head_dim, 4096, tokens)
    )
    kv = 4096 * 2 * a.n_kv_heads * a.head_dim * 2  # the whole sequence's K and V, bf16 (micro-batch 1)
    assert by["cp ring K/V sends"].comm_bytes == pytest.approx(calls * (1 + 1) * kv / 2)  # cp - 1 each way
    assert by["cp ring dK/dV sends"].comm_bytes == pytest.approx(
        calls * 2 * kv / 2 * 2
    )  # cp fp32 accumulators
    assert (
        by["attention"].bound(H100, "bfloat16") == "compute"
        and by["rmsnorm"].bound(H100, "bfloat16") == "HBM"
    )
    assert what["machine_balance"] == pytest.approx(989e12 / 3.35e12)


def test_a_moe_block_counts_its_router_experts_and_all_to_alls():
    """qwen3_moe_debug (3 blocks, the first dense; 8 experts of width 32, top 2) with ep 2 on 2 GPUs."""
    cfg = _cfg(**{"model.flavor": "qwen3_moe_debug", "parallel.ep": 2, "training.seq_len": 256})
    ops, what = roofline(cfg, 2, H100)
    by = {op.name: op for op in ops}
    m = what["micro_batches"]  # global 2 over dp 2: 1
    tokens, moe_calls, e, w = 256, 2 * m, 64, 32
    slots = tokens * 2  # top 2, balanced over the ep ranks
    assert by["router"].flops == pytest.approx(moe_calls * 6 * tokens * e * 8)
    assert by["experts w1 (gate)"].flops == pytest.approx(moe_calls * 6 * slots * e * w)
    # each grouped GEMM reads (and writes the gradient of) its 4 local experts' weights once
    assert by["experts w2 (down)"].hbm_bytes == pytest.approx(
        moe_calls * 3 * (slots * w + 4 * w * e + slots * e) * 2
    )
    assert by["w1 (gate)"].count == m  # the dense first block
    a2a = by["ep all-to-all (dispatch, combine)"]  # 4 exchanges a block, each sends half its slots away
    assert a2a.count == 4 * moe_calls and a2a.comm_bytes == pytest.approx(4 * moe_calls * slots * e * 2 / 2)
    assert a2a.bound(H100, "bfloat16") == "network" and a2a.comm_gbps == H100.link_gbps


def test_latent_attention_matmuls_are_the_models_attention_weights():
    """deepseek_v3_debug: MLA's matmul FLOPs are 6 x its attention weights x tokens; its one shared expert."""
    from loom.metrics.flops import attention_matmul_params
    from loom.models.registry import all_flavors

    a = all_flavors()["deepseek_v3_debug"]
    ops, what = roofline(_cfg(**{"model.flavor": "deepseek_v3_debug", "training.seq_len": 256}), 1, H100)
    by = {op.name: op for op in ops}
    calls = 3 * what["micro_batches"]
    mla = sum(by[n].flops for n in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo"))
    assert mla == pytest.approx(6 * attention_matmul_params(a) * 256 * calls)
    qk, v = a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim
    assert by["attention"].flops == pytest.approx(
        calls * attention_flops(1, a.n_heads, (qk + v) / 2, 256, 256)
    )
    assert by["shared w1 (gate)"].count == 2 * what["micro_batches"]  # first_k_dense 1 of 3 blocks


def test_cli_roofline_prints_the_table_and_writes_json(tmp_path, capsys):
    """The table, the JSON, and with --metrics the run's measured step (8 x 256 tokens at 2000 tokens/s)."""
    from loom.cli.plan import main

    out = tmp_path / "plan.json"
    metrics = _metrics(tmp_path / "metrics.jsonl", [100.0, 2000.0, 2000.0])
    args = [
        "--model.flavor",
        "debug",
        "--gpus",
        "2",
        "--parallel.tp",
        "2",
        "--training.global_batch_size",
        "8",
    ]
    assert (
        main([*args, "--training.seq_len", "256", "--roofline", "--metrics", metrics, "--json", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert (
        "roofline of one step" in text
        and "| tp all-gather / reduce-scatter |" in text
        and "| adamw |" in text
        and "measured (" in text
    )
    report = json.loads(out.read_text())["roofline"]
    ops = {row["op"]: row for row in report["ops"]}
    assert ops["tp all-gather / reduce-scatter"]["bound"] == "network" and ops["wq"]["intensity"] > 0
    assert ops["tp all-gather / reduce-scatter"]["comm_gbps"] == H100.link_gbps
    assert (
        report["measured"]["step_s"] == pytest.approx(8 * 256 / 2000.0) and report["measured"]["records"] == 2
    )
    with pytest.raises(ConfigError, match="--roofline"):
        main(["--roofline", "--params", "1B"])
    with pytest.raises(ConfigError, match="only with --roofline"):
        main([*args, "--metrics", metrics])


def test_roofline_plot_points_and_png(tmp_path):
    from loom.cli.plan import main
    from loom.plan.plot import roofline_points

    ops = [
        matmul("mm", 1, 4096, 4096, 4096, 2),
        Op("norm", 1, 12e3, 10e3),
        collective("ag", 1, 1e9, 2, 100.0),
    ]
    points = dict((name, (i, c)) for name, i, c in roofline_points(ops, H100, "bfloat16"))
    assert set(points) == {"mm", "norm", "step"}  # the collective has no FLOPs to place
    assert points["norm"] == pytest.approx((1.2, 1.2 * 3.35e12))
    flops = 6 * 4096**3 + 12e3
    seconds = 6 * 4096**3 / 989e12 + 10e3 / 3.35e12 + 0.5e9 / 100e9
    assert points["step"] == pytest.approx((flops / (3 * 3 * 4096**2 * 2 + 10e3), flops / seconds))
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    assert main(["--model.flavor", "debug", "--roofline", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _metrics(path, tokens_per_s: list[float]) -> str:
    """A metrics.jsonl of training records at these rates, with a validation-only line between them."""
    lines = [
        json.dumps({"step": i + 1, "loss": 2.0, "tokens_per_s": r, "mfu": 0.1 * (i + 1)})
        for i, r in enumerate(tokens_per_s)
    ]
    lines.insert(1, json.dumps({"step": 1, "val_loss": 2.5}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_measured_step_from_a_runs_metrics(tmp_path):
    ops = [matmul("mm", 1, 4096, 4096, 4096, 2), Op("norm", 1, 12e3, 10e3)]
    # 8192 tokens a step; the first record (warm-up) is left out: steps of 8192 / 4096 = 2 s, 1 s and 4 s
    path = _metrics(tmp_path / "metrics.jsonl", [10.0, 4096.0, 8192.0, 2048.0])
    m = measured_step(path, ops, 8192, H100, "bfloat16")
    flops = 6 * 4096**3 + 12e3
    assert m["records"] == 3 and m["first_step"] == 2 and m["step_s"] == pytest.approx(2.0)
    assert m["flops_per_s"] == pytest.approx(flops / 2.0) and m["mfu"] == pytest.approx(0.3)
    assert m["intensity"] == pytest.approx(flops / (3 * 3 * 4096**2 * 2 + 10e3))
    bound = 6 * 4096**3 / 989e12 + 10e3 / 3.35e12
    assert m["roofline_bound_s"] == pytest.approx(bound) and m["of_bound"] == pytest.approx(bound / 2.0)
    from loom.plan.plot import roofline_points

    points = {name: (i, c) for name, i, c in roofline_points(ops, H100, "bfloat16", m)}
    assert points["measured"] == pytest.approx((m["intensity"], flops / 2.0))


@pytest.mark.parametrize(
    "text, says",
    [
        (None, "cannot be read"),
        ("{}\n", "no training record"),
        ('{"step": 1}\nnot json\n', "line 2 is not JSON"),
    ],
)
def test_a_metrics_file_that_is_not_a_runs_is_one_line(tmp_path, text, says):
    path = tmp_path / "metrics.jsonl"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=says) as err:
        measured_step(str(path), [Op("norm", 1, 12e3, 10e3)], 8192, H100, "bfloat16")
    assert err.value.field == "--metrics" and "\n" not in str(err.value)


def test_cli_roofline_says_how_float8_differs_from_its_table(capsys):
    from loom.cli.plan import main

    base = ["--model.flavor", "debug", "--training.dtype", "bfloat16", "--training.global_batch_size", "8"]
    assert main([*base, "--training.seq_len", "256", "--roofline"]) == 0
    assert "float8" not in capsys.readouterr().out
    assert main([*base, "--training.seq_len", "256", "--roofline", "--training.float8", "tensorwise"]) == 0
    assert (
        "training.float8 tensorwise: the block linears' matmuls run on float8 tensor cores"
        in capsys.readouterr().out
    )

"""bench.diag.floor: the step's linears (LoRA's adapters and frozen base told apart), the GEMM pass's FLOPs, the byte
floor of the rest, and the floors set against a peer's step, in sequence and by energy."""

import json
import sys

import pytest
import torch

from bench.diag import floor
from loom.config import build_config
from loom.models.common.lora import apply_lora
from loom.models.llama.flavors import LlamaArgs
from loom.models.llama.model import Llama

ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)


def lora_model():
    with torch.device("meta"):
        model = Llama(ARGS)
    cfg = build_config(None, {"lora.rank": "16", "lora.targets": "all", "lora.base_dtype": "bfloat16"})
    apply_lora(model, cfg.lora, torch.bfloat16)
    return model


def test_linears_gemm_flops_and_the_adapters_reread():
    with torch.device("meta"):
        dense = Llama(ARGS)
    shapes = floor.linear_shapes(dense)
    assert len(shapes) == 7 * 2 + 1 and shapes[-1] == (64, 256, True, False)  # the head trains
    assert all(trains and not adapter for _, _, trains, adapter in shapes)
    lora = floor.linear_shapes(lora_model())
    assert len(lora) == 3 * 7 * 2 + 1
    base = [s for s in lora if not s[3]]
    assert len(base) == 15 and not any(s[2] for s in base)  # the frozen base and head take no weight gradient
    assert all(s[2] for s in lora if s[3]) and (64, 16, True, True) in lora and (16, 128, True, True) in lora
    # one backward read of each distinct adapted input: attention's (q/k/v share it), wo's, the FFN's, w2's
    assert floor.adapter_reread_bytes(lora_model(), 8) == 2 * 8 * (64 + 64 + 64 + 128) * 2
    run, flops = floor.gemm_pass(base + [s for s in lora if s[3]][:2], 8, device="cpu")
    run()
    frozen = sum(4 * 8 * i * o for i, o, *_ in base)
    assert flops == frozen + 6 * 8 * (64 * 16 + 16 * 64)


def test_rest_bytes_by_the_stream_dtype():
    fp32, bf16 = floor.rest_bytes(ARGS, 10, 1000, 4), floor.rest_bytes(ARGS, 10, 1000, 2)
    assert fp32["norm_add_fwd"] == 2 * 12 * 64 * 10 * 2 and bf16["norm_add_fwd"] == 2 * 8 * 64 * 10 * 2
    assert fp32["swiglu_bwd"] == bf16["swiglu_bwd"] == 10 * 128 * 10 * 2  # activations are bf16 either way
    assert fp32["rope_fwd_bwd"] == 2 * 4 * (4 + 2) * 16 * 10 * 2 and fp32["grad_norm"] == 4000
    assert fp32["loss_softmax"] == 4 * 256 * 10


def test_floors_against_the_peer(tmp_path, monkeypatch, capsys):
    peer = tmp_path / "peer.json"
    peer.write_text(
        json.dumps(
            {
                "results": [
                    {"variant": "hf_peft_compile", "step_s_median": 0.26},
                    {"variant": "loom_lora_graphs", "step_s_median": 0.22},
                    {"variant": "loom_lora", "error": "out of memory"},
                ]
            }
        )
    )
    out = {
        "workload": "lora_8b",
        "power_limit_w": 700.0,
        "gemms_attention": {"ms": 150.0, "j": 105.0},
        "optimizer": {"ms": 5.0, "j": None},  # launch-bound: no steady power read
        "rest_floor": {"ms": 20.0, "j": 14.0},
    }
    res = floor.against_peer(out, str(peer), 1.3, 700.0)
    assert res["step_needed_ms"] == pytest.approx(200.0) and res["joules_allowed"] == pytest.approx(140.0)
    assert res["loom_step_ms_in_that_run"] == pytest.approx(220.0) and set(res["runs"]) == {
        "hf_peft_compile",
        "loom_lora_graphs",
    }
    f = res["floor"]
    assert f["ms_in_sequence"] == 175.0 and f["ratio_in_sequence"] == pytest.approx(260 / 175)
    assert f["j"] == 119.0 and f["j_leaves_out"] == ["optimizer"]  # counted as 0 J: a lower bound
    assert f["ms_at_the_limit"] == pytest.approx(170.0) and "floor_fused_adapters" not in res
    out["base_gemms_attention"] = {"ms": 130.0, "j": 91.0}
    out.update(
        gemm_tflop=10.0, base_gemm_tflop=9.5, gemms={"ms": 40.0, "j": 28.0}
    )  # adapters: 5% of the FLOPs
    out["rest_floor_fused_adapters"] = {"ms": 22.0, "j": 15.4}
    doc = tmp_path / "floor.json"
    doc.write_text(json.dumps({"environment": {}, "floor": out}))
    monkeypatch.setattr(sys, "argv", ["floor", "--reread", str(doc), "--peer", str(peer)])
    floor.main()
    fused = json.loads(doc.read_text())["floor"]["against_peer"]["floor_fused_adapters"]
    assert fused["ms_in_sequence"] == pytest.approx(157.0 + 2.0) and fused["j"] == pytest.approx(106.4 + 1.4)
    assert '"floor_fused_adapters"' in capsys.readouterr().out

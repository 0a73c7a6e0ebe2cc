"""bench/generate.py's --quick mode (the debug model on the CPU, in-process): every job runs, the JSON has what the
GPU run reports (decode rates per batch for both systems, prefill, ratios, the speculative runs), and speculation
keeps the plain run's tokens."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_quick_mode_writes_every_figure(tmp_path):
    from bench.generate import main

    out = tmp_path / "generate.json"
    main(["--quick", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["environment"]["command"].startswith("python -m bench.")
    results = {r.get("system", "speculative"): r for r in doc["results"]}
    assert not [r for r in doc["results"] if "error" in r]
    for system in ("loom", "hf_static"):
        assert [d["batch"] for d in results[system]["decode"]] == [1, 2]
        assert all(isinstance(d["decode_tokens_per_s"], float) for d in results[system]["decode"])  # no timing claims
    assert [(p["batch"], p["seq"]) for p in results["loom"]["prefill"]] == [(1, 32), (2, 16)]
    assert set(doc["ratios"]) == {f"debug_batch{b}_{what}" for b in (1, 2)
                                  for what in ("decode_loom_vs_hf", "ttft_hf_vs_loom")}
    runs = results["speculative"]["runs"]
    assert [r["proposer"] for r in runs] == ["prompt_lookup", "oracle_0.5", "oracle_1.0"]
    assert all(r["same_tokens_as_plain"] for r in runs)
    assert runs[-1]["acceptance"] > runs[1]["acceptance"]

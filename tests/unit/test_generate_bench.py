"""bench/generate.py's --quick mode (the debug model on the CPU, in-process): every job runs, the JSON has what the
GPU run reports (decode rates per batch for both systems, prefill, ratios, a decode step's profile, the speculative
runs), speculation keeps the reference run's tokens, and the oracle's acceptance follows its guess rate."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_quick_mode_writes_every_figure(tmp_path):
    from bench.generate import main

    out = tmp_path / "generate.json"
    main(["--quick", "--profile", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["environment"]["command"].startswith("python -m bench.")
    results = {r.get("system", "speculative"): r for r in doc["results"]}
    assert not [r for r in doc["results"] if "error" in r]
    for system in ("loom", "hf_static"):
        assert [d["batch"] for d in results[system]["decode"]] == [1, 2]
        assert all(
            isinstance(d["decode_tokens_per_s"], float) for d in results[system]["decode"]
        )  # no timing claims
    assert [(p["batch"], p["seq"]) for p in results["loom"]["prefill"]] == [(1, 32), (2, 16)]
    assert set(doc["ratios"]) == {
        f"debug_batch{b}_{what}" for b in (1, 2) for what in ("decode_loom_vs_hf", "ttft_hf_vs_loom")
    }
    profiles = results["loom"]["profile"]
    assert [p["batch"] for p in profiles] == [1, 2] and all(
        p["top"] and p["kernels_per_step"] > 0 for p in profiles
    )
    spec = results["speculative"]
    runs = {r["proposer"]: r for r in spec["runs"]}
    assert list(runs) == ["none", "prompt_lookup", "oracle_0.5", "oracle_1.0"]
    assert all(r["same_tokens_as_reference"] for r in runs.values())
    assert spec["fit"]["output_follows_source"] >= 0.9  # the fitted target repeats its prompt's source
    assert runs["oracle_1.0"]["tokens_per_target_step"] > 4  # k = 4: nearly every guess kept
    assert runs["none"]["acceptance"] < runs["oracle_0.5"]["acceptance"] < runs["oracle_1.0"]["acceptance"]

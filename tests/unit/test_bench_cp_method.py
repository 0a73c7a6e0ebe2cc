"""bench's ``--cp-method``: throughput runs each context-parallel layout once per cp method (other layouts once)
and names the rows by method; layouts puts the method on its context-parallel layouts only."""

from __future__ import annotations

import pytest

from bench import layouts, throughput


def test_throughput_runs_cp_layouts_once_per_method_and_names_their_rows():
    methods = throughput.cp_methods("allgather,ring")
    got = throughput.jobs(["fsdp2", "cp2", "fsdp2_cp2"], methods)
    assert got == [
        ("fsdp2", None),
        ("cp2", "allgather"),
        ("cp2", "ring"),
        ("fsdp2_cp2", "allgather"),
        ("fsdp2_cp2", "ring"),
    ]
    assert [throughput.label(*j) for j in got[:3]] == ["fsdp2", "cp2 (allgather)", "cp2 (ring)"]
    for bad in ("ulysses", "ring,ring", ""):
        with pytest.raises(SystemExit, match="--cp-method"):
            throughput.cp_methods(bad)


def test_layouts_put_the_ring_on_context_parallel_layouts_only():
    table = layouts.layouts(4)
    assert layouts.with_cp_method(table, "allgather") == table
    ring = layouts.with_cp_method(table, "ring")
    assert ring["fsdp2_cp2+ring"] == {"dp_shard": 2, "cp": 2, "cp_method": "ring"}
    assert ring["fsdp4"] == table["fsdp4"] and "fsdp2_cp2" not in ring and len(ring) == len(table)


def test_throughput_reports_the_allocated_peak_beside_the_reserved_one():
    """Near the card's capacity the reserved peak reads the capacity for either cp method (136.3 and 135.9 GiB at
    64k tokens on 2 H200s, where the plan put the ring 2.9 GiB lower): the allocated peak, when the run logged it,
    goes into the row and the table."""
    recs = [
        {
            "step": 3,
            "tokens_per_s_per_device": 10.0,
            "mfu": 0.1,
            "mem_gib": 130.0,
            "mem_gib_max_rank": 136.0,
            "mem_alloc_gib": 110.0,
            "mem_alloc_gib_max_rank": 121.5,
            "loss": 5.0,
        },
        {
            "step": 6,
            "tokens_per_s_per_device": 20.0,
            "mfu": 0.2,
            "mem_gib": 131.0,
            "mem_gib_max_rank": 136.3,
            "mem_alloc_gib": 111.0,
            "mem_alloc_gib_max_rank": 120.0,
            "loss": 4.0,
        },
    ]
    row = throughput.summarize(recs)
    assert row["peak_gib_max_rank"] == 136.3 and row["peak_alloc_gib_max_rank"] == 121.5
    assert row["losses"] == {3: 5.0, 6: 4.0}
    assert "peak_alloc_gib_max_rank" not in throughput.summarize(
        [{k: v for k, v in r.items() if "alloc" not in k} for r in recs]
    )
    doc = {
        "environment": {"device": "H200", "torch": "2.11", "commit": "c"},
        "settings": {"flavor": "8B", "seq": 65536, "global_batch": 1},
        "invocations": ["python -m bench.throughput"],
        "references": [],
        "results": [{"layout": "cp2", "cp_method": "ring", "gpus": 2, **row}],
    }
    assert "| cp2 (ring) | 2 | 20 | 20.0% | 136.3, 121.5 |" in throughput.markdown(doc)

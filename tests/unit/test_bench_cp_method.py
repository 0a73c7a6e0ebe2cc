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

"""Rank placement (loom.parallel.placement): the rank groups of each mesh axis follow ParallelDims' mesh, and tp /
cp groups that span hosts are named, from synthetic hostnames per rank and on 2 gloo ranks."""

from __future__ import annotations

import pytest

from loom.parallel.placement import axis_groups, placement_warnings, spanning_groups


def test_axis_groups_follow_the_device_mesh():
    """The groups equal those of a DeviceMesh built over AXIS_ORDER (the layout ParallelDims builds)."""
    torch = pytest.importorskip("torch")
    sizes = {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2}
    ranks = torch.arange(16).reshape(
        2, 1, 2, 2, 2
    )  # init_device_mesh's layout: arange(world) over AXIS_ORDER
    for i, axis in enumerate(("pp", "dp_replicate", "dp_shard", "cp", "tp")):
        want = sorted(ranks.movedim(i, -1).reshape(-1, ranks.shape[i]).tolist())
        assert sorted(axis_groups(sizes, axis)) == want, axis
    assert axis_groups(sizes, "tp")[:2] == [[0, 1], [2, 3]]  # tp innermost: consecutive ranks
    assert axis_groups(sizes, "pp")[0] == [0, 8]  # pp outermost: stages are contiguous halves


def test_tp_within_hosts_passes_and_pipeline_may_cross():
    hosts = ["a"] * 4 + ["b"] * 4  # 2 hosts x 4 ranks
    assert spanning_groups(hosts, {"pp": 2, "tp": 4}) == []  # each stage on one host, tp within it
    assert spanning_groups(hosts, {"dp_shard": 2, "cp": 2, "tp": 2}) == []


def test_a_tp_group_across_hosts_is_named():
    hosts = ["a", "a", "a", "b", "b", "b"]  # 3 ranks per host, tp 2 does not divide it
    bad = spanning_groups(hosts, {"dp_shard": 3, "tp": 2})
    assert bad == [("tp", [2, 3], ["a", "b"])]
    lines = placement_warnings(hosts, {"dp_shard": 3, "tp": 2})
    assert lines == [
        "warning: the tp group of ranks 2,3 spans hosts a, b: its collectives (every layer) leave the "
        "host; keep tp x the axes inside it within the ranks per host"
    ]


def test_a_cp_group_across_hosts_and_the_count_beyond_four():
    hosts = [f"h{r}" for r in range(16)]  # one rank per host: every cp group spans hosts
    lines = placement_warnings(hosts, {"dp_shard": 8, "cp": 2})
    assert lines[0].startswith("warning: the cp group of ranks 0,1 spans hosts h0, h1")
    assert len(lines) == 5 and lines[-1] == "warning: 4 more tp/cp group(s) span hosts"


def _gloo_check(rank: int, world: int):
    from loom.config.sections import ParallelConfig
    from loom.parallel.dims import ParallelDims
    from loom.parallel.placement import check_placement

    dims = ParallelDims.from_config(ParallelConfig(tp=2, dp_shard=1), world)
    return {"same_host": check_placement(dims), "two_hosts": check_placement(dims, hostname=f"node{rank}")}


def test_two_gloo_ranks(tmp_path):
    from tests.distributed.harness import run_fn

    got = run_fn(2, _gloo_check, str(tmp_path))
    assert got["same_host"] == []
    assert len(got["two_hosts"]) == 1 and "ranks 0,1 spans hosts node0, node1" in got["two_hosts"][0]

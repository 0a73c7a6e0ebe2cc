"""Topology-aware placement on recorded ``nvidia-smi topo -m`` matrices (tests/data/topology): the parser, the
order of local ranks per layout (tp / cp groups on NVLink, pp on the slow links, one line where no order can
keep them), the NUMA CPUs a rank is bound to, a launched rank's device and the doctor's topology lines."""

from __future__ import annotations

import os
import pathlib

import pytest

from loom.cluster import doctor, hostinfo
from loom.cluster.doctor import OK, WARN, Report
from loom.config.sections import ParallelConfig
from loom.parallel.placement import axis_groups
from loom.runtime.topology import Topology, apply_placement, numa_cpus, place, read_topology

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "topology"
DGX, FOUR, TWO = "dgx_h100_8gpu.txt", "pcie_4gpu_nvbridge.txt", "pcie_2gpu.txt"


def text(name: str) -> str:
    return (DATA / name).read_text()


def topo(name: str) -> Topology:
    return Topology.from_text(text(name))


def groups_on(order: list[int], sizes: dict[str, int], axis: str, base: int = 0) -> list[list[int]]:
    """The GPUs of each group of ``axis`` among local ranks base.. (the placement's order applied)."""
    n = len(order)
    return [[order[r - base] for r in g if base <= r < base + n] for g in axis_groups(sizes, axis)]


def test_the_recorded_matrices_parse():
    d = topo(DGX)
    assert d.gpus == tuple(range(8)) and {d.links[(a, b)] for a in range(8) for b in range(8) if a != b} == {
        "NV18"
    }
    assert (
        d.nic_links[(5, "NIC5")] == "PIX"
        and d.nic_links[(5, "NIC1")] == "SYS"
        and d.nic_names["NIC7"] == "mlx5_7"
    )
    assert d.numa == {g: g // 4 for g in range(8)} and d.cpus[6] == frozenset(
        [*range(56, 112), *range(168, 224)]
    )
    assert d.domains() == [list(range(8))] and d.nearest_nic(3) == ("mlx5_3", "PIX")
    f = topo(FOUR)
    assert f.links[(0, 2)] == "NV4" and f.links[(1, 0)] == "SYS" and f.domains() == [[0, 2], [1, 3]]
    assert f.numa == {0: 0, 1: 1, 2: 0, 3: 1} and f.nearest_nic(2) == ("mlx5_0", "NODE")
    assert f.cost(0, 2) == 1 and f.cost(0, 1) == 7
    t = topo(TWO)
    assert t.links[(0, 1)] == "PHB" and t.domains() == [[0], [1]] and t.nearest_nic(0) is None
    assert t.cpus[1] == frozenset(range(16))
    # CUDA_VISIBLE_DEVICES=3,2 renumbers: visible 0 is GPU3, visible 1 is GPU2
    r = f.restrict([3, 2])
    assert r.gpus == (0, 1) and r.links[(0, 1)] == "SYS" and r.numa == {0: 1, 1: 0}


def test_without_nvidia_smi_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert read_topology() == (None, "nvidia-smi is not on PATH: no GPU topology")


@pytest.mark.parametrize(
    "sizes", [{"tp": 8}, {"tp": 2, "dp_shard": 4}, {"pp": 2, "tp": 4}, {"tp": 2, "cp": 2, "dp_shard": 2}]
)
def test_nvswitch_host_keeps_the_identity(sizes):
    # every GPU pair is NV18: no order is better, so auto changes nothing on an HGX box
    assert place(topo(DGX), sizes, 0, 8).order == list(range(8))
    assert place(topo(DGX), sizes, 0, 8).lines == []


def test_bridged_pairs_get_the_tp_groups_and_pp_the_slow_links():
    f = topo(FOUR)
    sizes = {"tp": 2, "dp_shard": 2}
    p = place(f, sizes, 0, 4)
    assert p.order == [0, 2, 1, 3] and p.lines == []
    assert all(f.nvlinked(a, b) for a, b in groups_on(p.order, sizes, "tp"))
    pp = {"pp": 2, "tp": 2}
    p = place(f, pp, 0, 4)
    assert all(f.nvlinked(a, b) for a, b in groups_on(p.order, pp, "tp"))
    assert all(not f.nvlinked(a, b) for a, b in groups_on(p.order, pp, "pp"))
    # the second host of a job (global ranks 4-7) gets the same order; 2 ranks on the 4 GPUs take a bridged pair
    assert place(f, sizes | {"dp_replicate": 2}, 4, 4).order == [0, 2, 1, 3]
    assert place(f, {"tp": 2}, 0, 2).order == [0, 2]


def test_no_order_keeps_tp_inside_a_domain_says_so():
    (line,) = place(topo(FOUR), {"tp": 4}, 0, 4).lines
    assert line == (
        "placement: no order keeps every tp group inside one NVLink domain on this host (GPU0-GPU1 is SYS; "
        "NVLink domains: GPU0,GPU2 | GPU1,GPU3): make tp x the axes inside it at most the domain's size"
    )
    (line,) = place(topo(FOUR), {"tp": 2, "cp": 2}, 0, 4).lines
    assert line.startswith("placement: no order keeps every cp group inside one NVLink domain")
    assert len(place(topo(TWO), {"tp": 2}, 0, 2).lines) == 1 and place(topo(TWO), {"pp": 2}, 0, 2).lines == []


def test_numa_cpus():
    d = topo(DGX)
    assert numa_cpus(d, 5, set(range(224))) == {*range(56, 112), *range(168, 224)}
    assert numa_cpus(d, 5, {0, 1, 60}) == {60}
    assert numa_cpus(d, 5, {0, 1}) is None  # none of the node's CPUs is ours: not bound
    mine = os.sched_getaffinity(0)  # this machine's CPUs
    assert numa_cpus(d, 0, mine) == (set(range(56)) | set(range(112, 168))) & mine or None


@pytest.fixture
def affinity():
    before = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, before)


def test_a_launched_rank_gets_its_gpu_and_cpus(affinity):
    cfg = ParallelConfig(tp=2, placement="auto")
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    gpu, lines = apply_placement(cfg, "cuda", env, topo_text=text(FOUR))
    assert gpu == 2 and lines == [] and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    mine = os.sched_getaffinity(0)
    assert mine <= set(range(32)) | set(range(64, 96)) or not (set(range(32)) | set(range(64, 96))) & mine
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "1,0,3,2"}
    gpu, lines = apply_placement(cfg, "cuda", env, topo_text=text(FOUR))
    # visible 0..3 = GPU1, GPU0, GPU3, GPU2: the bridged pairs are visible (0, 2) and (1, 3)
    assert gpu == 0 and lines == ["placement: local rank -> GPU 0->0 1->2 2->1 3->3"]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "GPU-8f2e"}
    assert apply_placement(cfg, "cuda", env, topo_text=text(FOUR)) == (
        None,
        [
            "placement off: CUDA_VISIBLE_DEVICES=GPU-8f2e names devices by UUID or MIG: placement needs indices"
        ],
    )
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    assert apply_placement(cfg, "cuda", env, topo_text=text(FOUR))[0] is None
    # off (the default), the CPU, or one process: nothing read, nothing bound
    assert apply_placement(ParallelConfig(tp=2), "cuda", {"WORLD_SIZE": "4"}, topo_text=text(FOUR)) == (
        None,
        [],
    )
    assert apply_placement(cfg, "cpu", {"WORLD_SIZE": "4"}, topo_text=text(FOUR)) == (None, [])
    assert apply_placement(cfg, "cuda", {}, topo_text=text(FOUR)) == (None, [])


def _doctor_lines(name: str, rdma: set[str], netdevs: dict) -> list[tuple[str, str]]:
    r = Report()
    doctor._topology_checks(r, hostinfo.parse_topo_matrix(text(name)), rdma, netdevs)
    return [(c.status, c.what) for c in r.checks]


def test_doctor_topology_lines():
    dgx = _doctor_lines(DGX, {f"mlx5_{i}" for i in range(8)}, {"mlx5_0": ["ibp26s0"], "mlx5_1": ["ibp60s0"]})
    assert (OK, "NVLink domains: GPU0-7 (8 GPUs)") in dgx and not any(s == WARN for s, _ in dgx)
    assert (OK, "suggested: NCCL_IB_HCA==" + ",".join(f"mlx5_{i}" for i in range(8))) in dgx
    assert (OK, "suggested: NCCL_SOCKET_IFNAME==ibp26s0,ibp60s0") in dgx
    four = _doctor_lines(FOUR, {"mlx5_0", "mlx5_1"}, {})
    assert (OK, "NVLink domains: GPU0,GPU2 (2 GPUs) | GPU1,GPU3 (2 GPUs)") in four
    assert (WARN, "tp = 2 with local rank i on GPU i puts GPU0-GPU1 (SYS) in one tp group") in four
    assert (WARN, "tp = 4 would cross a SYS link (GPU0-GPU1) whatever the order of ranks") in four
    assert (
        OK,
        "nearest RDMA NIC per GPU: GPU0 mlx5_0 (PXB), GPU1 mlx5_1 (PXB), GPU2 mlx5_0 (NODE), GPU3 mlx5_1 (NODE)",
    ) in four
    two = _doctor_lines(TWO, set(), {})
    assert (WARN, "tp = 2 would cross a PHB link (GPU0-GPU1) whatever the order of ranks") in two
    assert not any("NCCL_IB_HCA" in w for _, w in two)


def test_usable_cpus_follow_the_cgroup_quota(tmp_path):
    """A container limited by CPU quota shows every host CPU to os.cpu_count: the launchers size OMP_NUM_THREADS
    from the quota (cgroup v2's cpu.max, v1's cfs files), never above the affinity."""
    from loom.runtime.topology import usable_cpus

    mine = len(os.sched_getaffinity(0))
    assert usable_cpus(str(tmp_path)) == mine  # no cgroup files: the affinity
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(str(tmp_path)) == mine
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # one CPU's worth
    assert usable_cpus(str(tmp_path)) == 1
    (tmp_path / "cpu.max").write_text(f"{(mine + 8) * 100000} 100000\n")  # a quota above the affinity
    assert usable_cpus(str(tmp_path)) == mine
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(str(v1)) == 1
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cpus(str(v1)) == mine

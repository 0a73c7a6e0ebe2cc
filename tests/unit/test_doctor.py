"""``loom doctor``: the parsers of ``nvidia-smi`` output and InfiniBand / network sysfs (sample text, tmp trees),
the variable explanations and their warnings, nccl-tests' bus bandwidth, the slow-GPU flagging from given
numbers, and the command's exit codes and JSON on this CPU machine."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from loom.cli.doctor import parse_size
from loom.cli.main import main as loom_main
from loom.cluster import commbench, doctor, hostinfo, nccl_vars
from loom.cluster.doctor import FAIL, OK, SKIP, WARN, Options, Report
from loom.cluster.nccl_vars import HostContext

ROOT = pathlib.Path(__file__).resolve().parents[2]

# nvidia-smi topo -m on an 8 x H100 SXM host with 4 RDMA NICs: tab-separated, the header underlined (ANSI)
DGX = (
    "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tNIC2\tNIC3\tCPU Affinity\t"
    "NUMA Affinity\tGPU NUMA ID\x1b[0m\n"
)
_NICS = {
    0: "PIX PXB SYS SYS",
    1: "PXB PIX SYS SYS",
    2: "NODE NODE SYS SYS",
    3: "NODE NODE SYS SYS",
    4: "SYS SYS PIX PXB",
    5: "SYS SYS PXB PIX",
    6: "SYS SYS NODE NODE",
    7: "SYS SYS NODE NODE",
}
for _g in range(8):
    _cells = ["X" if _h == _g else "NV18" for _h in range(8)] + _NICS[_g].split()
    DGX += (
        f"GPU{_g}\t " + "\t".join(_cells) + f"\t{'0-55,112-167' if _g < 4 else '56-111,168-223'}\t"
        f"{0 if _g < 4 else 1}\t\tN/A\n"
    )
for _n, _row in enumerate(
    [
        "PIX PXB NODE NODE SYS SYS SYS SYS X PXB SYS SYS",
        "PXB PIX NODE NODE SYS SYS SYS SYS PXB X SYS SYS",
        "SYS SYS SYS SYS PIX PXB NODE NODE SYS SYS X PXB",
        "SYS SYS SYS SYS PXB PIX NODE NODE SYS SYS PXB X",
    ]
):
    DGX += f"NIC{_n}\t " + "\t".join(_row.split()) + "\n"
DGX += """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
  NIC2: mlx5_2
  NIC3: mlx5_3
"""

# 4 GPUs, NVLink in pairs only (two 2-GPU bridges), PCIe across: spaces instead of tabs
MIXED = """        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity
GPU0     X      NV4     SYS     SYS     0-31    0
GPU1    NV4      X      SYS     SYS     0-31    0
GPU2    SYS     SYS      X      NV4     32-63   1
GPU3    SYS     SYS     NV4      X      32-63   1

Legend:
"""


def test_topology_of_an_nvswitch_host():
    topo = hostinfo.parse_topo_matrix(DGX)
    assert topo["devices"][:8] == [f"GPU{i}" for i in range(8)] and topo["devices"][8:] == [
        f"NIC{i}" for i in range(4)
    ]
    assert topo["links"]["GPU3"]["GPU5"] == "NV18" and topo["links"]["GPU5"]["NIC3"] == "PIX"
    assert topo["cpu_affinity"]["GPU6"] == "56-111,168-223" and topo["numa"]["GPU1"] == "0"
    assert topo["nic_names"]["NIC2"] == "mlx5_2"
    s = hostinfo.summarize_topology(topo)
    assert s["summary"] == "8 GPUs, all pairs NV18 (NVSwitch)" and s["all_nvlink"] and not s["slow_pairs"]
    assert s["pairs"] == {"NV18": 28}
    assert s["nearest_nic"]["GPU1"] == {"nic": "mlx5_1", "link": "PIX"}
    assert s["nearest_nic"]["GPU6"] == {"nic": "mlx5_2", "link": "NODE"}


def test_topology_with_pcie_pairs_warns_and_far_nics_are_named():
    s = hostinfo.summarize_topology(hostinfo.parse_topo_matrix(MIXED))
    assert s["summary"] == "4 GPUs: NV4 x 2 pairs, SYS x 4 pairs" and s["nvlink"] and not s["all_nvlink"]
    assert sorted(s["slow_pairs"])[:2] == ["GPU0-GPU2 SYS", "GPU0-GPU3 SYS"]
    r = Report()
    doctor._topology_checks(r, hostinfo.parse_topo_matrix(MIXED), set())
    assert [c.status for c in r.checks] == [
        OK,
        WARN,
        OK,
        WARN,
    ] and "4 GPU pair(s) without NVLink" in r.checks[1].what
    # the NVLink domains; tp = 2 keeps to the bridged pairs as they are numbered, tp = 4 cannot (test_topology)
    assert r.checks[2].what == "NVLink domains: GPU0,GPU1 (2 GPUs) | GPU2,GPU3 (2 GPUs)"
    assert r.checks[3].what.startswith("tp = 4 would cross a SYS link")
    r = Report()
    doctor._topology_checks(
        r, hostinfo.parse_topo_matrix(DGX), {"mlx5_0", "mlx5_2"}
    )  # two of the NICs are RDMA
    far = [c for c in r.checks if c.status == WARN]
    assert len(far) == 1 and far[0].what.startswith("4 GPU(s)") and "GPU2 (mlx5_0, NODE)" in far[0].what
    assert "GPU0" not in far[0].what and "GPU5" not in far[0].what


def test_topology_of_one_gpu_and_four_direct_links():
    one = hostinfo.summarize_topology(
        hostinfo.parse_topo_matrix(
            "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-23\t0\t\tN/A\n\nLegend:\n"
        )
    )
    assert one["summary"] == "1 GPU" and not one["nvlink"]
    mesh = "\tGPU0\tGPU1\tGPU2\tGPU3\n" + "".join(
        f"GPU{i}\t" + "\t".join("X" if i == j else "NV4" for j in range(4)) + "\n" for i in range(4)
    )
    assert hostinfo.summarize_topology(hostinfo.parse_topo_matrix(mesh))["summary"] == "4 GPUs, all pairs NV4"


def test_nvidia_smi_gpu_query():
    text = (
        "0, NVIDIA H100 80GB HBM3, GPU-aaaa, 00000000:18:00.0, 570.86.15, 81559, 3, 34, 0, Disabled\n"
        "1, NVIDIA H100 80GB HBM3, GPU-bbbb, 00000000:2A:00.0, 570.86.15, 81559, 12000, 88, 2, [N/A]\n"
    )
    gpus = hostinfo.parse_smi_gpus(text)
    assert gpus[0] == {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": "GPU-aaaa",
        "bus_id": "00000000:18:00.0",
        "driver": "570.86.15",
        "memory_total_mib": 81559,
        "memory_used_mib": 3,
        "temperature_c": 34,
        "ecc_uncorrected": 0,
        "mig": "Disabled",
    }
    assert gpus[1]["mig"] is None and gpus[1]["ecc_uncorrected"] == 2
    facts = {
        "software": {
            "python": "3.11",
            "torch": "2.13",
            "loom": "0",
            "cuda_runtime": "12.8",
            "cuda_available": False,
            "cuda_devices": 0,
            "driver_cuda": None,
            "nccl": "2.27.5",
            "nccl_available": True,
            "gloo": True,
        },
        "gpu": {"source": "nvidia-smi", "gpus": gpus, "driver": "570.86.15", "driver_cuda": "12.8"},
        "topology": {"error": "not run"},
        "ib": [],
        "interfaces": {},
        "env": {},
    }
    checks = doctor.local_checks(facts)
    bad = {(c.status, c.what.split(":")[0]) for c in checks if c.status in (WARN, FAIL)}
    # torch cannot use the GPUs the driver lists; GPU1 is busy, hot and has uncorrectable ECC errors
    assert bad == {
        (FAIL, "torch sees no CUDA device, but this host has 2 GPU(s)"),
        (WARN, "GPU1"),
        (FAIL, "GPU1"),
    }
    assert sum(c.what.startswith("GPU1") and c.status != OK for c in checks) == 3


def _port(root, dev, port, state, rate, layer, gids=(), netdev=None):
    base = root / dev / "ports" / str(port)
    base.mkdir(parents=True)
    (base / "state").write_text(state + "\n")
    (base / "phys_state").write_text("5: LinkUp\n" if "ACTIVE" in state else "3: Disabled\n")
    (base / "rate").write_text(rate + "\n")
    (base / "link_layer").write_text(layer + "\n")
    (base / "gids").mkdir()
    (base / "gid_attrs" / "types").mkdir(parents=True)
    (base / "gid_attrs" / "ndevs").mkdir()
    for i in range(4):  # empty entries read as zeros; their type files are unreadable in sysfs (absent here)
        (base / "gids" / str(i)).write_text("0000:0000:0000:0000:0000:0000:0000:0000\n")
    for i, gid, kind in gids:
        (base / "gids" / str(i)).write_text(gid + "\n")
        (base / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")
        (base / "gid_attrs" / "ndevs" / str(i)).write_text((netdev or "") + "\n")
    if netdev:
        (root / dev / "device" / "net" / netdev).mkdir(parents=True)
    (root / dev / "fw_ver").write_text("28.39.1002\n")


@pytest.fixture
def sysfs(tmp_path):
    ib = tmp_path / "infiniband"
    _port(
        ib,
        "mlx5_0",
        1,
        "4: ACTIVE",
        "400 Gb/sec (4X NDR)",
        "InfiniBand",
        [(0, "fe80:0000:0000:0000:a088:c203:0012:3456", "IB/RoCE v1")],
    )
    _port(ib, "mlx5_1", 1, "1: DOWN", "10 Gb/sec (4X SDR)", "InfiniBand")
    _port(
        ib,
        "mlx5_2",
        1,
        "4: ACTIVE",
        "200 Gb/sec (4X HDR)",
        "Ethernet",
        [
            (0, "fe80:0000:0000:0000:1e34:daff:fe5a:0001", "IB/RoCE v1"),
            (1, "fe80:0000:0000:0000:1e34:daff:fe5a:0001", "RoCE v2"),
            (2, "0000:0000:0000:0000:0000:ffff:0a00:0105", "IB/RoCE v1"),
            (3, "0000:0000:0000:0000:0000:ffff:0a00:0105", "RoCE v2"),
        ],
        netdev="eth2",
    )
    net = tmp_path / "net"
    for name, state, speed in (
        ("eth0", "up", "25000"),
        ("eth2", "up", "200000"),
        ("lo", "unknown", None),
        ("docker0", "down", "-1"),
    ):
        (net / name).mkdir(parents=True)
        (net / name / "operstate").write_text(state + "\n")
        (net / name / "mtu").write_text("1500\n")
        if speed:
            (net / name / "speed").write_text(speed + "\n")
    return hostinfo.read_ib_devices(str(ib)), hostinfo.read_interfaces(str(net))


def test_infiniband_and_roce_ports_from_sysfs(sysfs):
    ports, ifs = sysfs
    assert [(p["device"], p["port"], p["state"], p["link_layer"]) for p in ports] == [
        ("mlx5_0", 1, "ACTIVE", "InfiniBand"),
        ("mlx5_1", 1, "DOWN", "InfiniBand"),
        ("mlx5_2", 1, "ACTIVE", "Ethernet"),
    ]
    assert (
        ports[0]["rate_gbps"] == 400.0
        and ports[1]["phys_state"] == "Disabled"
        and ports[2]["netdevs"] == ["eth2"]
    )
    assert [g["index"] for g in ports[2]["gids"]] == [0, 1, 2, 3] and ports[2]["gids"][3]["netdev"] == "eth2"
    assert hostinfo.roce_v2_ipv4_gid(ports[2]) == 3 and hostinfo.roce_v2_ipv4_gid(ports[0]) is None
    assert ifs["eth2"] == {"operstate": "up", "mtu": 1500, "speed_mbps": 200000}
    assert ifs["docker0"]["speed_mbps"] is None and ifs["lo"]["speed_mbps"] is None
    assert hostinfo.read_ib_devices("/nonexistent/infiniband") == []
    r = Report()
    doctor._network_checks(r, {"interfaces": ifs, "ib": ports, "env": {}}, nnodes=2)
    by_port = {c.what.split(":")[0]: c for c in r.checks}
    assert by_port["mlx5_1 port 1"].status == WARN and "not ACTIVE (Disabled)" in by_port["mlx5_1 port 1"].why
    assert "RoCE v2 IPv4 GID index 3" in by_port["mlx5_2 port 1"].what
    r = Report()
    doctor._network_checks(r, {"interfaces": ifs, "ib": ports, "env": {"NCCL_IB_HCA": "=mlx5_0,mlx5_2"}}, 2)
    assert all(c.status == OK for c in r.checks)  # the DOWN port is left out by NCCL_IB_HCA


def test_host_limits_and_nccl_conf(sysfs, tmp_path):
    ports, ifs = sysfs
    conf = tmp_path / "nccl.conf"
    conf.write_text("# site settings\nNCCL_DEBUG=WARN\nNCCL_SOCKET_IFNAME==eth9  # a comment\n\n")
    assert hostinfo.read_nccl_conf(str(conf)) == {"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "=eth9"}
    assert hostinfo.read_nccl_conf(str(tmp_path / "none.conf")) == {}
    facts = {
        "software": {
            "python": "3",
            "torch": "2",
            "loom": "0",
            "cuda_runtime": "12.8",
            "cuda_available": True,
            "cuda_devices": 8,
            "driver_cuda": "12.8",
            "nccl": "2.27.5",
            "nccl_available": True,
            "gloo": True,
        },
        "gpu": {
            "source": "nvml",
            "driver": "570",
            "driver_cuda": "12.8",
            "gpus": [
                {"index": i, "name": "NVIDIA H100", "memory_total_mib": 81559, "bus_id": "x"}
                for i in range(8)
            ],
        },
        "topology": {"error": "not run"},
        "ib": ports,
        "interfaces": ifs,
        "limits": {"memlock_bytes": 64 << 10, "shm_bytes": 64 << 20},
        "env": {"NCCL_DEBUG": "INFO"},
        "nccl_conf": {str(conf): hostinfo.read_nccl_conf(str(conf))},
    }
    checks = doctor.local_checks(facts)
    limits = [(c.status, c.what) for c in checks if c.section == "limits"]
    assert limits == [(WARN, "locked memory limited to 64 KiB (ulimit -l)"), (WARN, "/dev/shm is 64 MiB")]
    env = {c.what: c.status for c in checks if c.section == "environment"}
    # the environment's NCCL_DEBUG wins over the file's; the file's interface names none of this host's
    assert env == {"NCCL_DEBUG=INFO": OK, f"NCCL_SOCKET_IFNAME==eth9 (in {conf})": FAIL}
    facts["limits"] = {"memlock_bytes": None, "shm_bytes": 32 << 30}
    assert {c.status for c in doctor.local_checks(facts) if c.section == "limits"} == {OK}


def test_nccl_filter_syntax():
    match = nccl_vars.filter_matches
    assert match("eth", "eth0") and match("eth", "eth10") and not match("eth", "ib0")
    assert match("=eth0", "eth0") and not match("=eth0", "eth01")
    assert not match("^docker,lo", "docker0") and match("^docker,lo", "eth0") and not match("^=lo", "lo")
    assert match("mlx5_0:1,mlx5_1:1", "mlx5_0", 1) and not match("mlx5_0:1", "mlx5_0", 2)
    assert match("^mlx5_1", "mlx5_0", 1) and not match("^mlx5_1", "mlx5_1", 1)


def _explain(env: dict, **host) -> dict[str, dict]:
    return {row["name"]: row for row in nccl_vars.explain(env, HostContext(**host))}


def test_variables_explained_and_risky_values_warned(sysfs):
    ports, ifs = sysfs
    here = dict(interfaces=ifs, ib_ports=ports, nvlink=True, gpu_count=8, uses_nccl=True, nnodes=2)
    rows = _explain(
        {
            "NCCL_SOCKET_IFNAME": "ens",
            "NCCL_P2P_DISABLE": "1",
            "NCCL_IB_HCA": "mlx5_1",
            "NCCL_IB_GID_INDEX": "1",
            "NCCL_PROTO": "^LL128",
            "NCCL_ALGO": "Ring,Treee",
            "NCCL_DEBUG": "INFO",
            "GLOO_SOCKET_IFNAME": "eth0,ib0",
            "NCCL_SOCKET_IFNAMES": "eth0",
            "CUDA_VISIBLE_DEVICES": "0,1,9",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
            "HOME": "/root",
            "TORCH_HOME": "/cache",
        },
        **here,
    )
    assert "HOME" not in rows and rows["TORCH_HOME"]["status"] == OK
    status = {n: r["status"] for n, r in rows.items()}
    assert status == {
        "NCCL_SOCKET_IFNAME": FAIL,
        "NCCL_P2P_DISABLE": WARN,
        "NCCL_IB_HCA": WARN,
        "NCCL_IB_GID_INDEX": OK,
        "NCCL_PROTO": OK,
        "NCCL_ALGO": WARN,
        "NCCL_DEBUG": OK,
        "GLOO_SOCKET_IFNAME": FAIL,
        "NCCL_SOCKET_IFNAMES": WARN,
        "CUDA_VISIBLE_DEVICES": WARN,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": WARN,
        "TORCH_HOME": OK,
    }
    assert "no socket interface found" in rows["NCCL_SOCKET_IFNAME"]["note"]
    assert "NVLink" in rows["NCCL_P2P_DISABLE"]["note"] and rows["NCCL_P2P_DISABLE"]["does"]
    assert "not ACTIVE: mlx5_1:1" in rows["NCCL_IB_HCA"]["note"]
    assert "treee" in rows["NCCL_ALGO"]["note"] and "ib0" in rows["GLOO_SOCKET_IFNAME"]["note"]
    assert "did you mean NCCL_SOCKET_IFNAME?" in rows["NCCL_SOCKET_IFNAMES"]["note"]
    assert "9: beyond this host's 8 GPUs" in rows["CUDA_VISIBLE_DEVICES"]["note"]
    # the same values where they are harmless: no NVLink, one host, CPU only
    calm = _explain(
        {
            "NCCL_SOCKET_IFNAME": "^docker,lo",
            "NCCL_P2P_DISABLE": "1",
            "NCCL_IB_GID_INDEX": "3",
            "NCCL_IB_HCA": "=mlx5_0",
            "NCCL_ALGO": "Ring",
            "GLOO_SOCKET_IFNAME": "eth0",
        },
        interfaces=ifs,
        ib_ports=ports,
        nvlink=False,
    )
    assert {n: r["status"] for n, r in calm.items()} == {
        "NCCL_SOCKET_IFNAME": OK,
        "NCCL_P2P_DISABLE": OK,
        "NCCL_IB_GID_INDEX": OK,
        "NCCL_IB_HCA": OK,
        "NCCL_ALGO": WARN,
        "GLOO_SOCKET_IFNAME": OK,
    }
    assert calm["NCCL_SOCKET_IFNAME"]["note"] == "selects eth0, eth2"
    # RoCE v1
    assert _explain({"NCCL_IB_GID_INDEX": "2"}, ib_ports=ports)["NCCL_IB_GID_INDEX"]["status"] == WARN
    # no GPU
    assert _explain({"NCCL_SOCKET_IFNAME": "ens"}, interfaces=ifs)["NCCL_SOCKET_IFNAME"]["status"] == WARN
    assert (
        _explain({"NCCL_SOCKET_IFNAME": "lo"}, interfaces=ifs, nnodes=2)["NCCL_SOCKET_IFNAME"]["status"]
        == WARN
    )


def test_the_docs_carry_the_variable_table():
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## `loom doctor`", 1)[1].split("\n## ", 1)[0]
    assert nccl_vars.markdown_table() in section, (
        "regenerate: python -c 'from loom.cluster.nccl_vars import markdown_table; print(markdown_table())'"
    )


def test_bus_bandwidth_as_nccl_tests_defines_it():
    # 1 GB in 10 ms on 8 ranks: algbw 100 GB/s; all-reduce moves 2(n-1)/n of it per rank, all-gather (n-1)/n
    assert commbench.bandwidth("all_reduce", 10**9, 0.01, 8) == pytest.approx((100.0, 175.0))
    assert commbench.bandwidth("all_gather", 10**9, 0.01, 8) == pytest.approx((100.0, 87.5))
    assert commbench.bandwidth("all_reduce", 10**9, 0.01, 2) == pytest.approx((100.0, 100.0))
    assert commbench.bandwidth("all_gather", 10**9, 0.01, 1)[1] == 0.0


def _ranks(tflops: list[float]) -> list[dict]:
    return [
        {
            "rank": i,
            "host": f"node-{i // 4}",
            "local_rank": i % 4,
            "gpu": str(i % 4),
            "name": "NVIDIA H100",
            "tflops": t,
            "dtype": "bfloat16",
            "size": 8192,
            "finite": True,
        }
        for i, t in enumerate(tflops)
    ]


def test_a_slow_gpu_is_named_by_rank_host_and_index():
    results = _ranks([700, 705, 698, 560, 702, 699, 701, 703])
    median, slow = commbench.flag_slow(results, 0.1)
    assert median == 700.5 and [s["rank"] for s in slow] == [3]
    assert commbench.flag_slow(results, 0.25)[1] == []
    r = Report()
    doctor.job_checks(r, {"world_size": 8, "backend": "nccl", "matmul": results}, Options(), nhosts=2)
    warns = [c for c in r.checks if c.status == WARN]
    assert len(warns) == 1 and warns[0].what.startswith("rank 3 (node-0, GPU 3): 560.0 TFLOP/s, 20% below")
    assert [c.status for c in r.checks if c.section == "collectives"] == [SKIP]
    assert "node-1" in r.tables["matmul"]


def test_collective_rows_become_checks_and_min_busbw_fails():
    rows = {
        op: [
            {
                "op": op,
                "bytes": 1 << 30,
                "time_us": 5000.0,
                "algbw_gbps": 214.7,
                "busbw_gbps": 375.8,
                "wrong": 0,
            }
        ]
        for op in ("all_reduce", "all_gather")
    }
    rows["all_gather"][0]["wrong"] = 3
    r = Report()
    job = {"world_size": 8, "backend": "nccl", "collectives": rows, "matmul": _ranks([700] * 8)}
    doctor.job_checks(r, job, Options(min_busbw=400), nhosts=1)
    coll = [(c.status, c.what) for c in r.checks if c.section == "collectives"]
    assert coll[0] == (OK, "all-reduce: busbw 375.8 GB/s at 1 GiB (algbw 214.7; 8 ranks on 1 host, nccl)")
    assert [s for s, _ in coll] == [OK, FAIL, OK, FAIL, FAIL] and "wrong results at 1 GiB" in coll[3][1]
    assert r.exit_code == 1 and "all_gather" in r.tables["collectives"]


def test_hosts_that_differ_are_named():
    def host(nccl, hca):
        return {
            "software": {"torch": "2.13", "nccl": nccl},
            "gpu": {"driver": "570", "gpus": [{"name": "H100"}]},
            "env": {"NCCL_IB_HCA": hca} if hca else {},
        }

    checks = doctor.host_consistency({"a": host("2.27.5", "mlx5"), "b": host("2.26.2", None)})
    assert [(c.status, c.what.split(" differs")[0]) for c in checks if c.status != OK] == [
        (FAIL, "NCCL"),
        (WARN, "NCCL_IB_HCA"),
    ]
    assert doctor.host_consistency({"a": host("2.27.5", None)}) == []


def test_sizes_parse():
    assert [parse_size(s) for s in ("64K", "1M", "1G", "4096", "2MiB", "0.5M")] == [
        65536,
        1 << 20,
        1 << 30,
        4096,
        2 << 20,
        1 << 19,
    ]


# ---- the command on this machine ----------------------------------------------------------------


def test_doctor_on_this_machine_writes_json(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert loom_main(["doctor", "--local", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for title in ("Software", "Network", "Variables", "OK: 0 FAIL"):
        assert title in text
    data = json.loads(out.read_text())
    assert data["exit_code"] == 0 and data["world_size"] == 1 and data["job"] is None
    (host,) = data["hosts"].values()
    assert set(host) == {"software", "gpu", "ib", "interfaces", "topology", "env", "limits", "nccl_conf"}
    assert {c["status"] for c in data["checks"]} <= {OK, WARN, SKIP}
    assert all(c["what"] for c in data["checks"])


def test_doctor_runs_the_matmul_alone_and_exits_1_on_a_fail(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")
    assert loom_main(["doctor", "--matmul-size", "64", "--iters", "1"]) == 1
    text = capsys.readouterr().out
    assert "FAIL  GLOO_SOCKET_IFNAME=no-such-if0" in text and "Matmul per rank" in text
    assert "one rank: no collective test" in text and text.rstrip().splitlines()[-1].startswith(
        "FAIL: 1 FAIL"
    )


@pytest.mark.parametrize(
    "argv,field",
    [
        (["--bogus"], "--bogus"),
        (["--sizes", "1Q"], "--sizes"),
        (["--nproc-per-node", "0"], "--nproc-per-node"),
        (["--slow-fraction", "1.5"], "--slow-fraction"),
        (["--json"], "--json"),
    ],
)
def test_bad_options_exit_2_with_one_line(capsys, argv, field):
    with pytest.raises(SystemExit) as exc:
        loom_main(["doctor", *argv])
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"loom: error: {field}")


def test_help_lists_the_options(capsys):
    assert loom_main(["doctor", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: loom doctor") and all(
        o in out for o in ("--nproc-per-node", "--json", "--sizes", "--slow-fraction", "--min-busbw")
    )


def test_json_into_a_folder_is_a_user_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        loom_main(["doctor", "--local", "--json", str(tmp_path)])
    assert exc.value.code == 2 and "is a folder" in capsys.readouterr().err
    assert not os.listdir(tmp_path)

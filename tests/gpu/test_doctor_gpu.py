"""``loom doctor`` on one GPU: the driver's inventory (NVML or nvidia-smi) and topology are read, the bf16 GEMM
reaches a plausible rate, a one-rank NCCL group runs the bandwidth tests, and the whole doctor finds no FAIL on a
healthy machine. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from loom.cluster import commbench, doctor, hostinfo
from loom.cluster.doctor import Options, Report

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FAST = ("H100", "H200", "B200", "GH200")  # bf16 dense peak near 1000 TFLOP/s or more


def test_driver_inventory_and_topology():
    facts = hostinfo.local_facts()
    gpu = facts["gpu"]
    assert gpu["source"] in ("nvml", "nvidia-smi"), gpu
    assert len(gpu["gpus"]) >= torch.cuda.device_count() >= 1
    assert all(g["name"] and g["memory_total_mib"] and g["driver"] for g in gpu["gpus"])
    assert gpu["driver_cuda"], gpu
    sw = facts["software"]
    assert sw["cuda_available"] and sw["nccl"] and sw["nccl_available"]
    topo = facts["topology"]
    assert "error" not in topo, topo
    assert len([d for d in topo["devices"] if d.startswith("GPU")]) == len(gpu["gpus"])
    checks = doctor.local_checks(facts)
    assert not [c for c in checks if c.status == "FAIL"], [c for c in checks if c.status == "FAIL"]
    assert any(c.section == "topology" and c.status == "OK" for c in checks)


def test_bf16_matmul_rate():
    device = torch.device("cuda", 0)
    result = commbench.matmul_tflops(device, 8192, iters=10)
    assert result["finite"] and result["dtype"] == "bfloat16"
    name = torch.cuda.get_device_name(device)
    assert result["tflops"] > (100 if any(k in name for k in FAST) else 1), (name, result)


def test_one_rank_nccl_group_runs_the_collective_tests():
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        assert dist.get_backend() == "nccl"
        for op in ("all_reduce", "all_gather"):
            (row,) = commbench.collective_test(op, [64 << 20], iters=5, device=device)
            assert row["wrong"] == 0 and row["time_us"] > 0 and row["algbw_gbps"] > 0
            # one rank moves nothing over a link: factor 2(n-1)/n = (n-1)/n = 0
            assert row["busbw_gbps"] == 0.0
        job = doctor.job_tests(Options(iters=3, matmul_size=4096), device, 0, 0, 1)
        r = Report()
        doctor.job_checks(r, job, Options(), nhosts=1)
        assert job["matmul"][0]["gpu"] is not None and r.exit_code == 0
    finally:
        dist.destroy_process_group()


def test_the_whole_doctor_on_this_gpu():
    report = doctor.run(Options(matmul_size=4096, iters=5))
    fails = [c for c in report.checks if c.status == "FAIL"]
    assert report.exit_code == 0, fails
    assert any(c.section == "gpus" and c.what.startswith("GPU") for c in report.checks)
    assert "Matmul per rank" in doctor.render(report)

"""GPU kinds the planner knows: memory, bandwidths, GPUs per node. Peak FLOP/s come from
loom.metrics.flops (one table shared with MFU).

Memory is what PyTorch reports as the device's total (nvidia-smi's figure less the driver's reserve).
``link_gbps`` is the bus bandwidth NCCL's all-gather / reduce-scatter reach within a node (NVLink, NVLS
multicast off) and ``network_gbps`` the per-GPU bandwidth between nodes (8 x 400 Gb/s InfiniBand for the
8-GPU HGX kinds): vendor-class figures, assumptions until a run measures them, and printed with every plan.
``hbm_tbps`` is the datasheet's memory bandwidth (TB/s = 1e12 bytes/s), the roof of every memory-bound term (the
optimizer, MoE copies, each decode step of ``loom plan --generate``); what a kernel reaches of it is a share stated
where it is used (loom.plan.timing).
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.metrics.flops import peak_flops


@dataclass(frozen=True)
class GPU:
    name: str  # matched against loom.metrics.flops.PEAK_TFLOPS
    memory_gib: float
    hbm_tbps: float
    link_gbps: float
    network_gbps: float
    gpus_per_node: int = 8
    major: int = 9  # compute capability major (which kernels run: FlashAttention-4 on 9.x-11.x)

    def peak(self, dtype: str) -> float:
        flops = peak_flops(self.name, dtype)
        assert flops is not None, f"no peak throughput for {self.name}"
        return flops


# hbm_tbps, from NVIDIA's datasheets: H100 Tensor Core GPU (SXM column, "GPU memory bandwidth 3.35TB/s");
# H200 Tensor Core GPU (SXM, 4.8TB/s); A100 Tensor Core GPU (A100 80GB SXM, 2,039GB/s); HGX B200 (8TB/s per GPU).
GPUS: dict[str, GPU] = {
    "H100": GPU("H100 SXM", memory_gib=79.2, hbm_tbps=3.35, link_gbps=360.0, network_gbps=50.0),
    "H200": GPU("H200 SXM", memory_gib=139.8, hbm_tbps=4.8, link_gbps=360.0, network_gbps=50.0),
    "A100": GPU("A100 SXM", memory_gib=79.2, hbm_tbps=2.04, link_gbps=230.0, network_gbps=25.0, major=8),
    "B200": GPU("B200", memory_gib=178.4, hbm_tbps=8.0, link_gbps=720.0, network_gbps=50.0, major=10),
}


def gpu_named(name: str) -> GPU:
    """The table entry whose key is ``name`` (case-insensitive); KeyError otherwise."""
    for key, gpu in GPUS.items():
        if key.lower() == name.strip().lower():
            return gpu
    raise KeyError(name)

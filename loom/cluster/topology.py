"""What ``loom doctor`` says about one host's GPU topology beyond its summary.

The NVLink domains, the tensor-parallel degrees whose groups would cross a PCIe / SYS link (with local rank i on
GPU i, and with ``parallel.placement = auto``), and the NICs NCCL should use: each GPU's nearest RDMA NIC, as
``NCCL_IB_HCA`` and ``NCCL_SOCKET_IFNAME`` suggestions. The matrix is read by loom.runtime.topology, which
placement shares."""

from __future__ import annotations

from loom.runtime.topology import Topology, place

OK, WARN = "OK", "WARN"


def _gpus(gpus: list[int]) -> str:
    if len(gpus) > 2 and gpus == list(range(gpus[0], gpus[-1] + 1)):
        return f"GPU{gpus[0]}-{gpus[-1]}"
    return ",".join(f"GPU{g}" for g in gpus)


def domain_line(topo: Topology) -> str:
    doms = topo.domains()
    if all(len(d) == 1 for d in doms):
        return f"no NVLink between the {len(topo.gpus)} GPUs: every GPU pair goes over PCIe or the CPUs"
    return "NVLink domains: " + " | ".join(f"{_gpus(d)} ({len(d)} GPU{'s' * (len(d) > 1)})" for d in doms)


def tp_findings(topo: Topology) -> list[tuple[str, str, str]]:
    """(status, what, why) per tensor-parallel degree (2, 4, .. up to the GPUs, dividing them) whose groups
    cross a link that is not NVLink: with local rank i on GPU i, and whether placement = auto avoids it."""
    n = len(topo.gpus)
    out = []
    tp = 2
    while tp <= n:
        if n % tp == 0:
            sizes = {"tp": tp, "dp_shard": n // tp}
            plain = [
                (a, b)
                for start in range(0, n, tp)
                for a in range(start, start + tp)
                for b in range(a + 1, start + tp)
                if not topo.nvlinked(topo.gpus[a], topo.gpus[b])
            ]
            if plain:
                a, b = topo.gpus[plain[0][0]], topo.gpus[plain[0][1]]
                link = topo.links.get((a, b), "?")
                placed = place(topo, sizes, 0, n)
                if placed.lines:
                    out.append(
                        (
                            WARN,
                            f"tp = {tp} would cross a {link} link (GPU{a}-GPU{b}) whatever the order of ranks",
                            "its all-reduces in every layer run at PCIe / CPU speed: keep tp within an NVLink "
                            "domain",
                        )
                    )
                else:
                    order = " ".join(map(str, placed.order))
                    out.append(
                        (
                            WARN,
                            f"tp = {tp} with local rank i on GPU i puts GPU{a}-GPU{b} ({link}) in one tp group",
                            f"parallel.placement = auto keeps every tp group on NVLink (GPUs in order {order})",
                        )
                    )
        tp *= 2
    return out


def nic_suggestions(
    topo: Topology, rdma: set[str], netdevs: dict[str, list[str]]
) -> list[tuple[str, str, str]]:
    """Each GPU's nearest RDMA NIC and the variables that name them (only where the host has RDMA NICs in
    the matrix): NCCL finds these itself on bare metal; a VM or container that hides the PCIe tree needs them."""
    nearest = {g: topo.nearest_nic(g, rdma) for g in topo.gpus}
    if not rdma or not any(nearest.values()):
        return []
    per_gpu = ", ".join(f"GPU{g} {v[0]} ({v[1]})" for g, v in nearest.items() if v)
    hcas = list(dict.fromkeys(v[0] for v in nearest.values() if v))
    out = [
        (OK, f"nearest RDMA NIC per GPU: {per_gpu}", "NCCL sends each GPU's traffic between hosts through it")
    ]
    why = "NCCL detects these on bare metal; set them where a VM or container hides the PCIe tree"
    out.append((OK, "suggested: NCCL_IB_HCA==" + ",".join(hcas), why + " ('=': exact names, not prefixes)"))
    ifs = list(dict.fromkeys(d for h in hcas for d in netdevs.get(h, [])))
    if ifs:
        out.append(
            (
                OK,
                "suggested: NCCL_SOCKET_IFNAME==" + ",".join(ifs),
                "the nearest NICs' interfaces, for NCCL's bootstrap",
            )
        )
    return out

"""``loom doctor``: checks and explains the environment a job would run in. On each host: Python / torch / CUDA /
NCCL versions, GPUs and driver (NVML, else nvidia-smi), GPU topology (``nvidia-smi topo -m``), InfiniBand / RoCE
ports (sysfs), network interfaces and the communication variables set. Across a job's ranks: all-reduce and
all-gather bandwidth as nccl-tests reports it, and a matmul per GPU that names a slow one. Every finding is a
``Check``: OK / WARN / FAIL / SKIP (what could not be checked here) with a short reason."""

from __future__ import annotations

import json
import os
import socket
from collections import Counter
from dataclasses import asdict, dataclass, field

from loom.cluster import nccl_vars
from loom.cluster.commbench import collective_test, default_sizes, flag_slow, matmul_tflops, physical_gpu
from loom.cluster.hostinfo import MIB, local_facts, roce_v2_ipv4_gid, summarize_topology
from loom.cluster.topology import domain_line, nic_suggestions, tp_findings
from loom.runtime.topology import Topology

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"
SECTIONS = {
    "software": "Software",
    "gpus": "GPUs and driver",
    "topology": "Topology",
    "network": "Network",
    "limits": "Host limits",
    "environment": "Variables",
    "hosts": "Across hosts",
    "collectives": "Collectives",
    "matmul": "Matmul per rank",
}
BUSY_MIB = (
    2048  # memory in use on a GPU before the job starts that is worth a warning (a CUDA context is ~0.5 GiB)
)
HOT_C = 85  # a GPU this hot is near its slowdown temperature
MIN_PEAK_SHARE = 0.4  # a fixed large bf16 GEMM below this share of the device's peak is worth a warning


@dataclass
class Check:
    section: str
    status: str
    what: str
    why: str = ""


@dataclass
class Options:
    """What the job-wide tests run; None picks the device's default (GPU: larger, bf16; CPU: small, fp32)."""

    sizes: list[int] | None = None  # collective sizes in bytes (nccl-tests' size column)
    iters: int | None = None
    matmul_size: int | None = None
    slow_fraction: float = 0.1  # a GPU slower than the median by more than this is named
    min_busbw: float | None = None  # GB/s: FAIL when the largest size's bus bandwidth is below it
    local_only: bool = False  # skip the collectives and the matmul
    timeout_s: float = 300.0


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    tables: dict[str, str] = field(default_factory=dict)  # section -> preformatted table
    is_main: bool = True

    @property
    def exit_code(self) -> int:
        return 1 if any(c.status == FAIL for c in self.checks) else 0

    def add(self, section: str, status: str, what: str, why: str = "") -> None:
        self.checks.append(Check(section, status, what, why))

    def to_json(self) -> dict:
        return {**self.facts, "checks": [asdict(c) for c in self.checks], "exit_code": self.exit_code}


# ---- local checks ---------------------------------------------------------------------------------


def local_checks(facts: dict, nnodes: int = 1) -> list[Check]:
    """The checks of one host's facts."""
    r = Report()
    sw, gpu = facts["software"], facts["gpu"]
    _software_checks(r, sw, gpu)
    _gpu_checks(r, sw, gpu, facts["env"])
    topo = _topology_checks(
        r,
        facts["topology"],
        {p["device"] for p in facts["ib"]},
        {p["device"]: p["netdevs"] for p in facts["ib"]},
    )
    _network_checks(r, facts, nnodes)
    host = nccl_vars.HostContext(
        interfaces=facts["interfaces"],
        ib_ports=facts["ib"],
        nvlink=topo["nvlink"] if topo else None,
        gpu_count=len(gpu["gpus"]),
        uses_nccl=sw["cuda_available"],
        nnodes=nnodes,
    )
    _limit_checks(r, facts.get("limits") or {}, facts, len(gpu["gpus"]))
    _env_checks(r, facts["env"], host, facts.get("nccl_conf") or {})
    return r.checks


def _software_checks(r: Report, sw: dict, gpu: dict) -> None:
    r.add("software", OK, f"Python {sw['python']}, torch {sw['torch']}, loom {sw['loom']}")
    n_gpus = len(gpu["gpus"])
    if sw["cuda_available"]:
        driver = f" (the driver supports CUDA {sw['driver_cuda'] or gpu.get('driver_cuda') or '?'})"
        r.add(
            "software",
            OK,
            f"CUDA {sw['cuda_runtime']}: {sw['cuda_devices']} device(s) visible to torch",
            "the CUDA torch was built with" + driver,
        )
        rt, drv = _version(sw["cuda_runtime"]), _version(sw["driver_cuda"] or gpu.get("driver_cuda"))
        if rt and drv and drv < rt:
            r.add(
                "software",
                WARN,
                f"driver's CUDA {'.'.join(map(str, drv))} is older than torch's CUDA {sw['cuda_runtime']}",
                "runs by CUDA minor-version compatibility; kernels shipped only as PTX "
                "for the newer CUDA cannot load: update the driver",
            )
    elif n_gpus:
        why = (
            "torch is a CPU build (torch.version.cuda is None): install the CUDA build"
            if not sw["cuda_runtime"]
            else f"torch's CUDA {sw['cuda_runtime']} needs a newer driver than {gpu.get('driver')}, or "
            "CUDA_VISIBLE_DEVICES hides the GPUs"
        )
        r.add("software", FAIL, f"torch sees no CUDA device, but this host has {n_gpus} GPU(s)", why)
    else:
        r.add(
            "software",
            SKIP,
            "no CUDA device: the GPU checks are skipped",
            "collectives run on gloo and the matmul check in fp32 on the CPU",
        )
    if sw["cuda_available"] and not sw["nccl_available"]:
        r.add(
            "software", FAIL, "this torch has no NCCL", "multi-GPU jobs need torch.distributed's NCCL backend"
        )
    elif sw["nccl"]:
        r.add("software", OK, f"NCCL {sw['nccl']}", "the NCCL torch ships or was built with: GPU collectives")
    else:
        r.add("software", SKIP, "no NCCL in this torch build", "a CPU build: collectives run on gloo")
    r.add(
        "software",
        OK if sw["gloo"] else WARN,
        f"gloo {'available' if sw['gloo'] else 'missing'}",
        "CPU collectives: CPU jobs, CPU offload's gradient norm, monitored barriers",
    )


def _version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(".")[:2])
    except ValueError:
        return None


def _gpu_checks(r: Report, sw: dict, gpu: dict, env: dict) -> None:
    if not gpu["gpus"]:
        r.add("gpus", SKIP, "no NVIDIA GPU found", gpu.get("error") or "NVML and nvidia-smi list none")
        return
    src = gpu["source"]
    note = "" if src == "nvml" else f" ({gpu.get('nvml_error', 'no NVML')})"
    r.add(
        "gpus",
        OK,
        f"driver {gpu.get('driver')} (CUDA up to {gpu.get('driver_cuda') or '?'}): "
        f"{len(gpu['gpus'])} GPU(s), read through {src}{note}",
    )
    for g in gpu["gpus"]:
        mem = f"{g['memory_total_mib'] / 1024:.0f} GiB" if g.get("memory_total_mib") else "? GiB"
        temp = f", {g['temperature_c']} C" if g.get("temperature_c") is not None else ""
        r.add("gpus", OK, f"GPU{g['index']}: {g['name']}, {mem}{temp}, bus {g.get('bus_id')}")
        if (g.get("memory_used_mib") or 0) > BUSY_MIB:
            r.add(
                "gpus",
                WARN,
                f"GPU{g['index']}: {g['memory_used_mib'] / 1024:.1f} GiB already in use",
                "another process holds memory on it: a job sized for the whole GPU runs out (nvidia-smi lists "
                "the processes)",
            )
        if (g.get("ecc_uncorrected") or 0) > 0:
            r.add(
                "gpus",
                FAIL,
                f"GPU{g['index']}: {g['ecc_uncorrected']} uncorrectable ECC error(s) since the driver loaded",
                "its memory is failing or a row remap is pending: reset or replace the GPU; "
                "jobs on it can crash (Xid 48/94/95) or compute wrong values",
            )
        if (g.get("temperature_c") or 0) >= HOT_C:
            r.add(
                "gpus",
                WARN,
                f"GPU{g['index']}: {g['temperature_c']} C",
                "near its slowdown temperature: clocks drop and every rank waits for it (cooling, airflow)",
            )
        if g.get("mig") == "Enabled":
            r.add(
                "gpus",
                WARN,
                f"GPU{g['index']}: MIG is on",
                "CUDA sees MIG instances, not the whole GPU: a "
                "training job expects whole GPUs (nvidia-smi -i N -mig 0)",
            )
    if sw["cuda_available"] and "CUDA_VISIBLE_DEVICES" not in env and sw["cuda_devices"] != len(gpu["gpus"]):
        r.add(
            "gpus",
            WARN,
            f"torch sees {sw['cuda_devices']} device(s), the driver lists {len(gpu['gpus'])}",
            "some GPUs are hidden (a container's device list) or failed to initialize",
        )


def _topology_checks(
    r: Report, topo_facts: dict, rdma: set[str], netdevs: dict[str, list[str]] | None = None
) -> dict | None:
    """The topology's summary, NVLink domains, tp degrees that would cross slow links and the NICs to name;
    ``rdma``: the host's InfiniBand / RoCE device names (NICs that matter), ``netdevs``: their interfaces."""
    if "error" in topo_facts:
        r.add("topology", SKIP, "no GPU topology", topo_facts["error"])
        return None
    topo = summarize_topology(topo_facts, rdma)
    topo_facts["summary"] = topo
    r.add(
        "topology",
        OK,
        topo["summary"],
        "NV# = # bonded NVLinks; PIX / PXB = through PCIe switches; PHB = "
        "through the CPU's host bridge; NODE / SYS = between host bridges / CPU sockets",
    )
    if topo["slow_pairs"]:
        shown = ", ".join(topo["slow_pairs"][:6]) + (" ..." if len(topo["slow_pairs"]) > 6 else "")
        r.add(
            "topology",
            WARN,
            f"{len(topo['slow_pairs'])} GPU pair(s) without NVLink: {shown}",
            "tensor parallelism across them runs at PCIe speed: keep parallel.tp within an NVLink group",
        )
    graph = Topology.from_matrix(topo_facts)
    if len(graph.gpus) > 1:
        r.add("topology", OK, domain_line(graph), "tp and cp groups belong inside one NVLink domain")
    for status, what, why in tp_findings(graph) + nic_suggestions(graph, rdma, netdevs or {}):
        r.add("topology", status, what, why)
    far = {g: v for g, v in topo["nearest_nic"].items() if v["link"] in ("NODE", "SYS")}
    if far:
        shown = ", ".join(f"{g} ({v['nic']}, {v['link']})" for g, v in sorted(far.items()))
        r.add(
            "topology",
            WARN,
            f"{len(far)} GPU(s) have no RDMA NIC nearer than NODE / SYS: {shown}",
            "GPUDirect RDMA is not used that far by default (NCCL_NET_GDR_LEVEL): their traffic between hosts "
            "goes through host memory",
        )
    return topo


def _network_checks(r: Report, facts: dict, nnodes: int) -> None:
    ifs = facts["interfaces"]
    if ifs:
        shown = ", ".join(
            f"{n} {v['operstate']}" + (f" {v['speed_mbps'] // 1000} Gb/s" if v["speed_mbps"] else "")
            for n, v in ifs.items()
        )
        r.add("network", OK, f"interfaces: {shown}", "what NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME can name")
    ports = facts["ib"]
    if not ports:
        status = WARN if nnodes > 1 else SKIP
        r.add(
            "network",
            status,
            "no InfiniBand / RoCE device (/sys/class/infiniband)",
            "traffic between hosts goes over TCP sockets"
            + (
                ": a fraction of RDMA bandwidth"
                if nnodes > 1
                else " (one host: NVLink / PCIe / shared memory inside it)"
            ),
        )
        return
    hca = facts["env"].get("NCCL_IB_HCA")
    for p in ports:
        name = f"{p['device']} port {p['port']}"
        kind = "RoCE (Ethernet)" if p["link_layer"] == "Ethernet" else (p["link_layer"] or "?")
        extra = f", netdev {', '.join(p['netdevs'])}" if p["netdevs"] else ""
        if p["link_layer"] == "Ethernet":
            gid = roce_v2_ipv4_gid(p)
            extra += f", RoCE v2 IPv4 GID index {gid}" if gid is not None else ", no RoCE v2 IPv4 GID"
        line = f"{name}: {p['state']}, {p['rate'] or '? rate'}, {kind}{extra}"
        if hca and not nccl_vars.filter_matches(hca, p["device"], p["port"]):
            r.add("network", OK, line, "left out by NCCL_IB_HCA")
        elif p["state"] != "ACTIVE":
            r.add(
                "network",
                WARN,
                line,
                f"not ACTIVE ({p['phys_state']}): NCCL skips it, and the GPUs near it "
                "send through a farther NIC",
            )
        else:
            r.add(
                "network",
                OK,
                line,
                "NCCL's IB transport uses ACTIVE ports"
                + (
                    "; RoCE needs a lossless (PFC/ECN) Ethernet fabric"
                    if p["link_layer"] == "Ethernet"
                    else ""
                ),
            )


def _limit_checks(r: Report, limits: dict, facts: dict, n_gpus: int) -> None:
    active = [p for p in facts["ib"] if p.get("state") == "ACTIVE"]
    if active and limits.get("memlock_bytes") is not None:
        r.add(
            "limits",
            WARN,
            f"locked memory limited to {_size(limits['memlock_bytes'])} (ulimit -l)",
            "RDMA registers NCCL's buffers as locked memory: 'ibv_reg_mr failed' / 'Unable to register memory'; "
            "set it unlimited (a container's --ulimit memlock=-1)",
        )
    elif active:
        r.add("limits", OK, "locked memory unlimited", "RDMA can register NCCL's buffers")
    shm = limits.get("shm_bytes")
    if shm is not None and n_gpus > 1 and shm < 1 << 30:
        r.add(
            "limits",
            WARN,
            f"/dev/shm is {_size(shm)}",
            "NCCL's shared-memory transport and data loader "
            "workers need more: a container's default 64 MiB fails with bus errors (--shm-size / --ipc=host)",
        )
    elif shm is not None:
        r.add(
            "limits",
            OK,
            f"/dev/shm {_size(shm)}",
            "shared memory for NCCL's SHM transport and loader workers",
        )


def _env_checks(r: Report, env: dict, host: nccl_vars.HostContext, confs: dict[str, dict]) -> None:
    rows = nccl_vars.explain(env, host)
    for path, conf in confs.items():  # NCCL reads these files; a variable set in the environment wins
        rows += [{**row, "source": path} for row in nccl_vars.explain(conf, host) if row["name"] not in env]
    if not rows:
        r.add(
            "environment",
            OK,
            "no NCCL_*, GLOO_*, TORCH_* or CUDA_VISIBLE_DEVICES variable set",
            "NCCL and PyTorch use their defaults",
        )
    for row in rows:
        why = "; ".join(x for x in (row["does"], row["note"]) if x)
        where = f" (in {row['source']})" if row.get("source") else ""
        r.add("environment", row["status"], f"{row['name']}={row['value']}{where}", why)


# ---- across hosts ---------------------------------------------------------------------------------


def host_consistency(per_host: dict[str, dict]) -> list[Check]:
    """Versions, GPU models and communication variables that differ between the job's hosts."""
    r = Report()
    if len(per_host) < 2:
        return []

    def differ(label, get, status, why):
        values = {h: get(f) for h, f in per_host.items()}
        if len(set(map(str, values.values()))) > 1:
            shown = "; ".join(f"{h}: {v}" for h, v in sorted(values.items()))
            r.add("hosts", status, f"{label} differs: {shown}", why)
        else:
            r.add("hosts", OK, f"{label}: {next(iter(values.values()))} on all {len(values)} hosts")

    differ("torch", lambda f: f["software"]["torch"], WARN, "ranks may disagree on collectives' behaviour")
    differ("NCCL", lambda f: f["software"]["nccl"], FAIL, "NCCL needs the same version on every rank")
    differ("driver", lambda f: f["gpu"].get("driver"), WARN, "one image per job avoids surprises")
    differ(
        "GPUs",
        lambda f: sorted(Counter(g["name"] for g in f["gpu"]["gpus"]).items()),
        WARN,
        "the job runs at the slowest GPU's pace",
    )
    names = sorted({n for f in per_host.values() for n in f["env"] if n not in ("CUDA_VISIBLE_DEVICES",)})
    for n in names:
        values = {h: f["env"].get(n) for h, f in per_host.items()}
        if len(set(values.values())) > 1:
            shown = "; ".join(f"{h}: {v if v is not None else '(unset)'}" for h, v in sorted(values.items()))
            r.add(
                "hosts",
                WARN,
                f"{n} differs: {shown}",
                "set it alike on every host (the launcher's environment)",
            )
    return r.checks


# ---- across the job: collectives and matmul -------------------------------------------------------


def job_tests(options: Options, device, rank: int, local_rank: int, world: int) -> dict:
    """Run on every rank: the collective tests (with several ranks) and the matmul; rank 0 gets everything."""
    import torch.distributed as dist

    on_gpu = device.type == "cuda"
    out: dict = {"world_size": world, "backend": dist.get_backend() if dist.is_initialized() else None}
    if world > 1:
        sizes = options.sizes or default_sizes(device.type)
        iters = options.iters or (20 if on_gpu else 5)
        out["collectives"] = {
            op: collective_test(op, sizes, iters, device) for op in ("all_reduce", "all_gather")
        }
    size = options.matmul_size or (8192 if on_gpu else 512)
    mine = matmul_tflops(device, size, options.iters or (20 if on_gpu else 5))
    name = "cpu"
    if on_gpu:
        import torch

        name = torch.cuda.get_device_name(device)
    mine.update(
        rank=rank,
        host=socket.gethostname(),
        local_rank=local_rank,
        name=name,
        gpu=physical_gpu(device.index or 0) if on_gpu else None,
    )
    if world > 1:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    out["matmul"] = everyone
    return out


def job_checks(r: Report, job: dict, options: Options, nhosts: int) -> None:
    """Checks and tables of ``job_tests``'s results (rank 0)."""
    world = job["world_size"]
    if "collectives" not in job:
        r.add(
            "collectives",
            SKIP,
            "one rank: no collective test",
            "start several: loom doctor --nproc-per-node N "
            "(or torchrun --nproc-per-node N -m loom doctor, srun python -m loom doctor)",
        )
    else:
        lines = [f"  {'op':<11}{'size':>10}{'time (us)':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}  wrong"]
        for op, rows in job["collectives"].items():
            for row in rows:
                lines.append(
                    f"  {op:<11}{_size(row['bytes']):>10}{row['time_us']:>12.1f}"
                    f"{row['algbw_gbps']:>12.2f}{row['busbw_gbps']:>12.2f}  {row['wrong']}"
                )
            last = rows[-1]
            label = op.replace("_", "-")
            where = f"{world} ranks on {nhosts} host{'s' * (nhosts > 1)}, {job['backend']}"
            r.add(
                "collectives",
                OK,
                f"{label}: busbw {last['busbw_gbps']:.1f} GB/s at {_size(last['bytes'])} "
                f"(algbw {last['algbw_gbps']:.1f}; {where})",
                f"nccl-tests' bus bandwidth: algbw x {'2(n-1)/n' if op == 'all_reduce' else '(n-1)/n'}, "
                "comparable with a link's peak whatever n",
            )
            wrong = [row for row in rows if row["wrong"]]
            if wrong:
                r.add(
                    "collectives",
                    FAIL,
                    f"{label}: wrong results at {', '.join(_size(w['bytes']) for w in wrong)}",
                    "the collective returned wrong values: a broken transport (set NCCL_DEBUG=INFO and rerun)",
                )
            if options.min_busbw is not None and last["busbw_gbps"] < options.min_busbw:
                r.add(
                    "collectives",
                    FAIL,
                    f"{label}: busbw {last['busbw_gbps']:.1f} GB/s < --min-busbw {options.min_busbw:g}",
                    "below the bandwidth this cluster should reach",
                )
        r.tables["collectives"] = "\n".join(lines)
    results = job["matmul"]
    first = results[0]
    median, slow = flag_slow(results, options.slow_fraction)
    lo = min(results, key=lambda x: x["tflops"])
    what = f"{first['dtype']} {first['size']}^3 GEMM"
    if len(results) == 1:
        r.add(
            "matmul", OK, f"{_who(first)}: {_rate(first['tflops'])} ({what})", "one rank: nothing to compare"
        )
    else:
        r.add(
            "matmul",
            OK,
            f"{len(results)} ranks: median {_rate(median)}, slowest {_who(lo)} at "
            f"{_rate(lo['tflops'])}; {what}",
            ""
            if first["name"] == "cpu"
            else f"a rank more than {options.slow_fraction:.0%} below the median is named",
        )
    if first["name"] == "cpu" and len(results) > 1:
        slow = []
        r.add(
            "matmul",
            SKIP,
            "CPU ranks are not compared",
            "they share this host's cores, so their speeds differ by scheduling, not by hardware",
        )
    for s in slow:
        r.add(
            "matmul",
            WARN,
            f"{_who(s)}: {_rate(s['tflops'])}, {1 - s['tflops'] / median:.0%} below the median",
            "every step waits for the slowest GPU: throttling (power, heat), clocks set low, another process on "
            "it (nvidia-smi -q -d PERFORMANCE,CLOCK)",
        )
    for x in results:
        if not x["finite"]:
            r.add("matmul", FAIL, f"{_who(x)}: the GEMM returned NaN / inf", "the GPU computes wrong values")
    from loom.metrics.flops import peak_flops

    if first["name"] != "cpu":
        for x in results:
            peak = peak_flops(x["name"], x["dtype"])
            if peak and x["tflops"] * 1e12 < MIN_PEAK_SHARE * peak:
                r.add(
                    "matmul",
                    WARN,
                    f"{_who(x)}: {x['tflops']:.1f} TFLOP/s is {x['tflops'] * 1e12 / peak:.0%} of "
                    f"the {x['name']}'s {peak / 1e12:.0f} TFLOP/s peak",
                    "a large GEMM reaches well over half: throttled clocks, or a smaller --matmul-size",
                )
    lines = [f"  {'rank':>4}  {'host':<20}{'gpu':>4}  {'TFLOP/s':>9}  device"]
    for x in results:
        lines.append(
            f"  {x['rank']:>4}  {x['host'][:20]:<20}{x['gpu'] or '-':>4}  {x['tflops']:>9.3f}  {x['name']}"
        )
    r.tables["matmul"] = "\n".join(lines)


def _rate(tflops: float) -> str:
    return f"{tflops:.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.1f} GFLOP/s"


def _who(x: dict) -> str:
    gpu = f", GPU {x['gpu']}" if x.get("gpu") is not None else ""
    return f"rank {x['rank']} ({x['host']}{gpu})"


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}" if nbytes % scale == 0 else f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


# ---- the whole run --------------------------------------------------------------------------------


def run(options: Options) -> Report:
    """The doctor on this process: alone, or as one rank of a job (torchrun / elastic / SLURM / mpirun variables), where
    rank 0 gets every host's facts and every rank's results."""
    from loom.runtime.env import env_from_launcher

    os.environ.update(env_from_launcher(dict(os.environ)))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    facts = local_facts() if local_rank == 0 else None
    env = {n: os.environ[n] for n in nccl_vars.listed(dict(os.environ))}
    report = Report(is_main=rank == 0)
    try:
        device, joined = _join(world, local_rank, options.timeout_s)
    except Exception as err:
        if facts is not None:
            report.checks += local_checks(facts)
        report.add(
            "collectives",
            FAIL,
            f"rank {rank}: the process group did not start: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}",
            "see the FAIL / WARN lines above (interfaces, variables); NCCL_DEBUG=INFO says more",
        )
        report.facts = {"hosts": {socket.gethostname(): facts}} if facts else {}
        return report
    try:
        gathered = _gather((socket.gethostname(), facts, env), world)
        per_host = {h: f for h, f, _ in gathered if f is not None}
        job = None if options.local_only else job_tests(options, device, rank, local_rank, world)
    finally:
        if joined:
            _leave()
    if rank != 0:
        return report
    main_host = socket.gethostname()
    report.checks += local_checks(per_host[main_host], nnodes=len(per_host))
    for host, f in per_host.items():
        if host != main_host:  # other hosts: their problems only (the full facts are in the JSON)
            report.checks += [
                Check(c.section, c.status, f"{host}: {c.what}", c.why)
                for c in local_checks(f, nnodes=len(per_host))
                if c.status in (WARN, FAIL)
            ]
    if len(per_host) > 1:
        report.checks += host_consistency(per_host)
    _rank_env_differences(report, gathered)
    if job is not None:
        job_checks(report, job, options, len(per_host))
    report.facts = {"world_size": world, "hosts": per_host, "job": job}
    return report


def _join(world: int, local_rank: int, timeout_s: float):
    """This process's device, after joining the job's process group when there is one (NCCL on GPUs), and
    whether this call started the group (a caller's group stays up)."""
    import datetime

    import torch
    import torch.distributed as dist

    from loom.runtime.env import pick_device

    device = pick_device("auto", local_rank)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
        return device, True
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device, False


def _gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _leave() -> None:
    from loom.runtime.env import destroy_distributed

    destroy_distributed()


def _rank_env_differences(r: Report, gathered: list) -> None:
    """Variables that differ between ranks of one host (CUDA_VISIBLE_DEVICES per rank is normal under SLURM)."""
    by_host: dict[str, list[dict]] = {}
    for host, _, env in gathered:
        by_host.setdefault(host, []).append(env)
    for host, envs in by_host.items():
        for n in sorted({k for e in envs for k in e} - {"CUDA_VISIBLE_DEVICES"}):
            values = {e.get(n) for e in envs}
            if len(values) > 1:
                r.add(
                    "hosts",
                    WARN,
                    f"{host}: {n} differs between its ranks: {', '.join(sorted(str(v) for v in values))}",
                    "ranks of one job should agree",
                )


# ---- output ---------------------------------------------------------------------------------------


def render(report: Report) -> str:
    """Sections of OK / WARN / FAIL / SKIP lines, each with its reason below it, then a verdict."""
    out = []
    world = report.facts.get("world_size", 1)
    hosts = report.facts.get("hosts") or {}
    names = (
        ", ".join(sorted(hosts)[:4]) + (" ..." if len(hosts) > 4 else "") if hosts else socket.gethostname()
    )
    out.append(
        f"loom doctor: {world} rank{'s' * (world > 1)} on {len(hosts) or 1} host{'s' * (len(hosts) > 1)} "
        f"({names})"
    )
    for key, title in SECTIONS.items():
        checks = [c for c in report.checks if c.section == key]
        if not checks and key not in report.tables:
            continue
        out.append(f"\n{title}")
        for c in checks:
            out.append(f"  {c.status:<5} {c.what}")
            if c.why:
                out.append(f"        {c.why}")
        if key in report.tables:
            out.append(report.tables[key])
    counts = Counter(c.status for c in report.checks)
    verdict = "FAIL" if counts[FAIL] else "OK"
    out.append(f"\n{verdict}: {counts[FAIL]} FAIL, {counts[WARN]} WARN, {counts[SKIP]} SKIP, {counts[OK]} OK")
    return "\n".join(out)


def write_json(report: Report, path: str) -> None:
    facts = report.to_json()
    for f in (facts.get("hosts") or {}).values():
        if f and "topology" in f:
            f["topology"].pop("raw", None)
    with open(path, "w") as fh:
        json.dump(facts, fh, indent=1, default=str)
        fh.write("\n")

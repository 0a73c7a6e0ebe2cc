"""``loom doctor``: checks and explains the environment a job would run in. On each host: Python / torch / CUDA /
NCCL versions, GPUs and driver (NVML, else nvidia-smi), GPU topology (``nvidia-smi topo -m``), InfiniBand / RoCE
ports (sysfs), network interfaces and the communication variables set. Across a job's ranks: all-reduce and
all-gather bandwidth as nccl-tests reports it, and a matmul per GPU that names a slow one. Every finding is a
``Check``: OK / WARN / FAIL / SKIP (what could not be checked here) with a short reason."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from loom.ops import nccl_vars

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"
SECTIONS = {"software": "Software", "gpus": "GPUs and driver", "topology": "Topology", "network": "Network",
            "limits": "Host limits", "environment": "Variables", "hosts": "Across hosts", "collectives": "Collectives",
            "matmul": "Matmul per rank"}
MIB = 1 << 20
BUSY_MIB = 2048  # memory in use on a GPU before the job starts that is worth a warning (a CUDA context is ~0.5 GiB)
HOT_C = 85  # a GPU this hot is near its slowdown temperature
MIN_PEAK_SHARE = 0.4  # a fixed large bf16 GEMM below this share of the device's peak is worth a warning
NVLINKS_PER_GPU = 18  # H100 / H200 / B200: a pair with more links than a GPU has per peer goes through NVSwitch


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


# ---- probes (what this host has) ------------------------------------------------------------------

def run_tool(args: list[str], timeout: float = 30.0) -> tuple[bool, str]:
    """(True, stdout) or (False, why it did not run)."""
    if shutil.which(args[0]) is None:
        return False, f"{args[0]} is not on PATH"
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, f"{' '.join(args)}: {err}"
    if out.returncode != 0:
        first = (out.stdout.strip() or out.stderr.strip() or f"exit code {out.returncode}").splitlines()[0]
        return False, f"{' '.join(args)} failed: {first}"
    return True, out.stdout


def software_facts() -> dict:
    import platform

    import torch
    import torch.distributed as dist

    from loom import version

    cuda = torch.cuda.is_available()
    driver_cuda = None
    if torch.version.cuda is not None:
        try:
            code = torch._C._cuda_getDriverVersion()  # e.g. 12080: the newest CUDA the driver supports
            driver_cuda = f"{code // 1000}.{code % 1000 // 10}" if code else None
        except (AttributeError, RuntimeError):
            pass
    return {"host": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__,
            "loom": version(), "cuda_runtime": torch.version.cuda, "cuda_available": cuda,
            "cuda_devices": torch.cuda.device_count() if cuda else 0, "driver_cuda": driver_cuda,
            "nccl": nccl_version(), "nccl_available": dist.is_nccl_available(), "gloo": dist.is_gloo_available()}


def nccl_version() -> str | None:
    """The NCCL torch is built with (``torch.cuda.nccl.version()``), or None on a build without it."""
    try:
        import torch.cuda.nccl as nccl

        v = nccl.version()
    except (AttributeError, RuntimeError, ImportError):
        return None
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


SMI_FIELDS = ("index", "name", "uuid", "pci.bus_id", "driver_version", "memory.total", "memory.used",
              "temperature.gpu", "ecc.errors.uncorrected.volatile.total", "mig.mode.current")
_SMI_KEYS = ("index", "name", "uuid", "bus_id", "driver", "memory_total_mib", "memory_used_mib", "temperature_c",
             "ecc_uncorrected", "mig")
_INT_KEYS = {"index", "memory_total_mib", "memory_used_mib", "temperature_c", "ecc_uncorrected"}


def _value(text: str):
    text = text.strip()
    return None if text.strip("[]") in ("N/A", "Not Supported", "Unknown Error", "") else text


def parse_smi_gpus(text: str) -> list[dict]:
    """``nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits`` -> one dict per GPU."""
    gpus = []
    for line in text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(_SMI_KEYS):
            continue
        gpu = {}
        for key, cell in zip(_SMI_KEYS, cells):
            val = _value(cell)
            if key in _INT_KEYS and val is not None:
                try:
                    val = int(float(val))
                except ValueError:
                    val = None
            gpu[key] = val
        gpus.append(gpu)
    return gpus


def gpu_facts() -> dict:
    """The host's GPUs (all of them, whatever CUDA_VISIBLE_DEVICES says) from NVML, else nvidia-smi."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    nvml_error = "pynvml is not installed (pip install nvidia-ml-py)"
    if pynvml is not None:
        try:
            return _nvml_facts(pynvml)
        except Exception as err:  # noqa: BLE001 - any NVML error means: try nvidia-smi
            nvml_error = f"NVML: {err}"
    ok, out = run_tool(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"])
    if not ok:
        return {"source": None, "gpus": [], "error": f"{nvml_error}; {out}"}
    gpus = parse_smi_gpus(out)
    driver_cuda = None
    ok, head = run_tool(["nvidia-smi"])
    if ok and (m := re.search(r"CUDA Version:\s*([\d.]+)", head)):
        driver_cuda = m.group(1)
    return {"source": "nvidia-smi", "gpus": gpus, "driver": gpus[0]["driver"] if gpus else None,
            "driver_cuda": driver_cuda, "nvml_error": nvml_error}


def _nvml_facts(nv) -> dict:
    nv.nvmlInit()
    try:
        def text(x):
            return x.decode() if isinstance(x, bytes) else x

        def maybe(fn, *args):
            try:
                return fn(*args)
            except Exception:  # noqa: BLE001 - a field this GPU does not support
                return None

        gpus = []
        driver = text(nv.nvmlSystemGetDriverVersion())
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            mig = maybe(nv.nvmlDeviceGetMigMode, h)
            gpus.append({
                "index": i, "name": text(nv.nvmlDeviceGetName(h)), "uuid": text(nv.nvmlDeviceGetUUID(h)),
                "bus_id": text(nv.nvmlDeviceGetPciInfo(h).busId), "driver": driver,
                "memory_total_mib": mem.total // MIB, "memory_used_mib": mem.used // MIB,
                "temperature_c": maybe(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                "ecc_uncorrected": maybe(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                         nv.NVML_VOLATILE_ECC),
                "mig": None if mig is None else ("Enabled" if mig[0] else "Disabled")})
        code = maybe(nv.nvmlSystemGetCudaDriverVersion)
        return {"source": "nvml", "gpus": gpus, "driver": driver,
                "driver_cuda": f"{code // 1000}.{code % 1000 // 10}" if code else None}
    finally:
        nv.nvmlShutdown()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LINK_RANK = {"X": 0, "PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5}


def parse_topo_matrix(text: str) -> dict:
    """``nvidia-smi topo -m`` -> {"devices": [...], "links": {row: {col: link}}, "cpu_affinity": {gpu: ...},
    "numa": {gpu: ...}, "nic_names": {"NIC0": "mlx5_0"}}. Columns are found by name (tabs or spaces)."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    rows: dict[str, list[str]] = {}
    header: list[str] | None = None
    nic_names: dict[str, str] = {}
    for ln in lines:
        tokens = ln.split()
        if header is None:
            if "GPU0" in tokens:  # the header comes first; the rows follow it up to a blank line or the legend
                header = tokens
            continue
        if not tokens or tokens[0].startswith("Legend"):
            break
        rows[tokens[0]] = tokens[1:]
    header = header or []
    for ln in lines:
        if m := re.match(r"\s*(NIC\d+):\s*(\S+)\s*$", ln):
            nic_names[m.group(1)] = m.group(2)
    devices = [t for t in header if t in rows]
    links, cpu, numa = {}, {}, {}
    for name in devices:
        cells = rows[name]
        links[name] = dict(zip(devices, cells[:len(devices)]))
        rest = cells[len(devices):]
        if name.startswith("GPU") and rest:
            cpu[name] = rest[0]
            if len(rest) > 1:
                numa[name] = rest[1]
    return {"devices": devices, "links": links, "cpu_affinity": cpu, "numa": numa, "nic_names": nic_names}


def _link_order(link: str) -> tuple[int, int]:
    """Best first: more NVLinks, then the PCIe / CPU paths from nearest to farthest."""
    if m := re.fullmatch(r"NV(\d+)", link):
        return (0, -int(m.group(1)))
    return (1, _LINK_RANK.get(link, 9))


def summarize_topology(topo: dict, rdma: set[str] | None = None) -> dict:
    """GPU pairs by link ({"NV18": 28}), whether any / all pairs use NVLink, a one-line summary, the pairs that do
    not when some do, and each GPU's nearest NIC (among the ``rdma`` device names when given)."""
    gpus = [d for d in topo["devices"] if d.startswith("GPU")]
    nics = [d for d in topo["devices"] if not d.startswith("GPU")
            and (rdma is None or topo["nic_names"].get(d, d) in rdma)]
    pairs = {(a, b): topo["links"][a].get(b, "?") for i, a in enumerate(gpus) for b in gpus[i + 1:]}
    counts = Counter(pairs.values())
    nvlink = [p for p, link in pairs.items() if link.startswith("NV")]
    n = len(gpus)
    if n <= 1:
        text = f"{n} GPU" if n == 1 else "no GPU in the matrix"
    elif len(counts) == 1:
        (link,) = counts
        text = f"{n} GPUs, all pairs {link}"
        if link.startswith("NV") and int(link[2:] or 0) * (n - 1) > NVLINKS_PER_GPU:
            text += " (NVSwitch)"
    else:
        text = f"{n} GPUs: " + ", ".join(f"{link} x {c} pair{'s' * (c > 1)}"
                                         for link, c in sorted(counts.items(), key=lambda kv: _link_order(kv[0])))
    nearest = {}
    for g in gpus:
        if nics:
            nic = min(nics, key=lambda x: _link_order(topo["links"][g].get(x, "SYS")))
            nearest[g] = {"nic": topo["nic_names"].get(nic, nic), "link": topo["links"][g].get(nic, "?")}
    return {"gpus": n, "pairs": dict(counts), "nvlink": bool(nvlink), "all_nvlink": bool(pairs) and
            len(nvlink) == len(pairs), "summary": text,
            "slow_pairs": [f"{a}-{b} {pairs[(a, b)]}" for (a, b) in pairs if nvlink and (a, b) not in nvlink],
            "nearest_nic": nearest}


def _sysfs(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def read_ib_devices(root: str = "/sys/class/infiniband") -> list[dict]:
    """One dict per HCA port: device, port, state (ACTIVE, DOWN, ...), phys_state, rate ("400 Gb/sec (4X NDR)"),
    rate_gbps, link_layer (InfiniBand / Ethernet = RoCE), netdevs and the non-empty GIDs with their RoCE type."""
    if not os.path.isdir(root):
        return []
    ports = []
    for dev in sorted(os.listdir(root)):
        netdevs = sorted(os.listdir(os.path.join(root, dev, "device", "net"))) \
            if os.path.isdir(os.path.join(root, dev, "device", "net")) else []
        ports_dir = os.path.join(root, dev, "ports")
        if not os.path.isdir(ports_dir):
            continue
        for port in sorted(os.listdir(ports_dir), key=lambda p: int(p) if p.isdigit() else 0):
            base = os.path.join(ports_dir, port)
            rate = _sysfs(os.path.join(base, "rate"))
            m = re.match(r"([\d.]+)\s*Gb/sec", rate or "")
            ports.append({
                "device": dev, "port": int(port) if port.isdigit() else port,
                "state": _strip_code(_sysfs(os.path.join(base, "state"))),
                "phys_state": _strip_code(_sysfs(os.path.join(base, "phys_state"))),
                "rate": rate, "rate_gbps": float(m.group(1)) if m else None,
                "link_layer": _sysfs(os.path.join(base, "link_layer")), "netdevs": netdevs,
                "fw_ver": _sysfs(os.path.join(root, dev, "fw_ver")), "gids": _gids(base)})
    return ports


def _strip_code(text: str | None) -> str | None:
    """sysfs states read ``4: ACTIVE``; the name is what matters."""
    return None if text is None else text.split(":", 1)[-1].strip()


def _gids(port_dir: str) -> list[dict]:
    gid_dir = os.path.join(port_dir, "gids")
    if not os.path.isdir(gid_dir):
        return []
    out = []
    for name in sorted(os.listdir(gid_dir), key=lambda x: int(x) if x.isdigit() else -1):
        gid = _sysfs(os.path.join(gid_dir, name))
        if not gid or set(gid.replace(":", "")) == {"0"}:
            continue
        out.append({"index": int(name), "gid": gid,
                    "type": _sysfs(os.path.join(port_dir, "gid_attrs", "types", name)),
                    "netdev": _sysfs(os.path.join(port_dir, "gid_attrs", "ndevs", name))})
    return out


def roce_v2_ipv4_gid(port: dict) -> int | None:
    """The index of a port's RoCE v2 GID that carries an IPv4 address (``::ffff:a.b.c.d``), the usual choice."""
    for g in port.get("gids", []):
        if g.get("type") == "RoCE v2" and g["gid"].replace(":", "").startswith("0" * 20 + "ffff"):
            return g["index"]
    return None


def read_interfaces(root: str = "/sys/class/net") -> dict[str, dict]:
    """name -> {"operstate", "mtu", "speed_mbps"} of this host's network interfaces."""
    if not os.path.isdir(root):
        return {}
    out = {}
    for name in sorted(os.listdir(root)):
        speed = _sysfs(os.path.join(root, name, "speed"))
        mtu = _sysfs(os.path.join(root, name, "mtu"))
        out[name] = {"operstate": _sysfs(os.path.join(root, name, "operstate")),
                     "mtu": int(mtu) if mtu and mtu.isdigit() else None,
                     "speed_mbps": int(speed) if speed and speed.lstrip("-").isdigit() and int(speed) > 0 else None}
    return out


def read_nccl_conf(path: str) -> dict[str, str]:
    """``KEY=VALUE`` lines of an NCCL configuration file (/etc/nccl.conf, $NCCL_CONF_FILE); {} when absent."""
    out = {}
    try:
        with open(path) as fh:
            for line in fh:
                line = line.split("#", 1)[0].strip()
                name, eq, value = line.partition("=")
                if eq and name.strip():
                    out[name.strip()] = value.strip()
    except OSError:
        pass
    return out


def host_limits() -> dict:
    """Limits that break NCCL in containers: locked memory (RDMA registers buffers) and /dev/shm's size (the
    shared-memory transport)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    try:
        st = os.statvfs("/dev/shm")
        shm = st.f_blocks * st.f_frsize
    except OSError:
        shm = None
    return {"memlock_bytes": None if soft == resource.RLIM_INFINITY else soft, "shm_bytes": shm}


def local_facts(environ: dict[str, str] | None = None) -> dict:
    """Everything the doctor reads on this host (one process per host gathers it)."""
    environ = dict(os.environ if environ is None else environ)
    facts = {"software": software_facts(), "gpu": gpu_facts(), "ib": read_ib_devices(),
             "interfaces": read_interfaces(), "limits": host_limits()}
    ok, out = run_tool(["nvidia-smi", "topo", "-m"])
    facts["topology"] = {"raw": out, **parse_topo_matrix(out)} if ok else {"error": out}
    facts["env"] = {n: environ[n] for n in nccl_vars.listed(environ)}
    confs = ["/etc/nccl.conf"] + ([environ["NCCL_CONF_FILE"]] if environ.get("NCCL_CONF_FILE") else [])
    facts["nccl_conf"] = {p: conf for p in confs if (conf := read_nccl_conf(p))}
    return facts


# ---- local checks ---------------------------------------------------------------------------------

def local_checks(facts: dict, nnodes: int = 1) -> list[Check]:
    """The checks of one host's facts."""
    r = Report()
    sw, gpu = facts["software"], facts["gpu"]
    _software_checks(r, sw, gpu)
    _gpu_checks(r, sw, gpu, facts["env"])
    topo = _topology_checks(r, facts["topology"], {p["device"] for p in facts["ib"]})
    _network_checks(r, facts, nnodes)
    host = nccl_vars.HostContext(interfaces=facts["interfaces"], ib_ports=facts["ib"],
                                 nvlink=topo["nvlink"] if topo else None, gpu_count=len(gpu["gpus"]),
                                 uses_nccl=sw["cuda_available"], nnodes=nnodes)
    _limit_checks(r, facts.get("limits") or {}, facts, len(gpu["gpus"]))
    _env_checks(r, facts["env"], host, facts.get("nccl_conf") or {})
    return r.checks


def _software_checks(r: Report, sw: dict, gpu: dict) -> None:
    r.add("software", OK, f"Python {sw['python']}, torch {sw['torch']}, loom {sw['loom']}")
    n_gpus = len(gpu["gpus"])
    if sw["cuda_available"]:
        driver = f" (the driver supports CUDA {sw['driver_cuda'] or gpu.get('driver_cuda') or '?'})"
        r.add("software", OK, f"CUDA {sw['cuda_runtime']}: {sw['cuda_devices']} device(s) visible to torch",
              "the CUDA torch was built with" + driver)
        rt, drv = _version(sw["cuda_runtime"]), _version(sw["driver_cuda"] or gpu.get("driver_cuda"))
        if rt and drv and drv < rt:
            r.add("software", WARN, f"driver's CUDA {'.'.join(map(str, drv))} is older than torch's CUDA "
                  f"{sw['cuda_runtime']}", "runs by CUDA minor-version compatibility; kernels shipped only as PTX "
                  "for the newer CUDA cannot load: update the driver")
    elif n_gpus:
        why = ("torch is a CPU build (torch.version.cuda is None): install the CUDA build" if not sw["cuda_runtime"]
               else f"torch's CUDA {sw['cuda_runtime']} needs a newer driver than {gpu.get('driver')}, or "
                    "CUDA_VISIBLE_DEVICES hides the GPUs")
        r.add("software", FAIL, f"torch sees no CUDA device, but this host has {n_gpus} GPU(s)", why)
    else:
        r.add("software", SKIP, "no CUDA device: the GPU checks are skipped",
              "collectives run on gloo and the matmul check in fp32 on the CPU")
    if sw["cuda_available"] and not sw["nccl_available"]:
        r.add("software", FAIL, "this torch has no NCCL", "multi-GPU jobs need torch.distributed's NCCL backend")
    elif sw["nccl"]:
        r.add("software", OK, f"NCCL {sw['nccl']}", "the NCCL torch ships or was built with: GPU collectives")
    else:
        r.add("software", SKIP, "no NCCL in this torch build", "a CPU build: collectives run on gloo")
    r.add("software", OK if sw["gloo"] else WARN, f"gloo {'available' if sw['gloo'] else 'missing'}",
          "CPU collectives: CPU jobs, CPU offload's gradient norm, monitored barriers")


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
    note = "" if src == "nvml" else f" ({gpu.get('nvml_error', 'no NVML')}, so nvidia-smi)"
    r.add("gpus", OK, f"driver {gpu.get('driver')}, CUDA {gpu.get('driver_cuda') or '?'} at most; "
          f"{len(gpu['gpus'])} GPU(s) read through {src}{note}")
    for g in gpu["gpus"]:
        mem = f"{g['memory_total_mib'] / 1024:.0f} GiB" if g.get("memory_total_mib") else "? GiB"
        temp = f", {g['temperature_c']} C" if g.get("temperature_c") is not None else ""
        r.add("gpus", OK, f"GPU{g['index']}: {g['name']}, {mem}{temp}, bus {g.get('bus_id')}")
        if (g.get("memory_used_mib") or 0) > BUSY_MIB:
            r.add("gpus", WARN, f"GPU{g['index']}: {g['memory_used_mib'] / 1024:.1f} GiB already in use",
                  "another process holds memory on it: a job sized for the whole GPU runs out (nvidia-smi lists "
                  "the processes)")
        if (g.get("ecc_uncorrected") or 0) > 0:
            r.add("gpus", FAIL, f"GPU{g['index']}: {g['ecc_uncorrected']} uncorrectable ECC error(s) since the "
                  "driver loaded", "its memory is failing or a row remap is pending: reset or replace the GPU; "
                  "jobs on it can crash (Xid 48/94/95) or compute wrong values")
        if (g.get("temperature_c") or 0) >= HOT_C:
            r.add("gpus", WARN, f"GPU{g['index']}: {g['temperature_c']} C", "near its slowdown temperature: "
                  "clocks drop and every rank waits for it (cooling, airflow)")
        if g.get("mig") == "Enabled":
            r.add("gpus", WARN, f"GPU{g['index']}: MIG is on", "CUDA sees MIG instances, not the whole GPU: a "
                  "training job expects whole GPUs (nvidia-smi -i N -mig 0)")
    if sw["cuda_available"] and "CUDA_VISIBLE_DEVICES" not in env and \
            sw["cuda_devices"] != len(gpu["gpus"]):
        r.add("gpus", WARN, f"torch sees {sw['cuda_devices']} device(s), the driver lists {len(gpu['gpus'])}",
              "some GPUs are hidden (a container's device list) or failed to initialize")


def _topology_checks(r: Report, topo_facts: dict, rdma: set[str]) -> dict | None:
    """The topology's summary; ``rdma``: the host's InfiniBand / RoCE device names (NICs that matter)."""
    if "error" in topo_facts:
        r.add("topology", SKIP, "no GPU topology", topo_facts["error"])
        return None
    topo = summarize_topology(topo_facts, rdma)
    topo_facts["summary"] = topo
    r.add("topology", OK, topo["summary"], "NV# = # bonded NVLinks; PIX / PXB = through PCIe switches; PHB = "
          "through the CPU's host bridge; NODE / SYS = between host bridges / CPU sockets")
    if topo["slow_pairs"]:
        shown = ", ".join(topo["slow_pairs"][:6]) + (" ..." if len(topo["slow_pairs"]) > 6 else "")
        r.add("topology", WARN, f"{len(topo['slow_pairs'])} GPU pair(s) without NVLink: {shown}",
              "tensor parallelism across them runs at PCIe speed: keep parallel.tp within an NVLink group")
    far = {g: v for g, v in topo["nearest_nic"].items() if v["link"] in ("NODE", "SYS")}
    if far:
        shown = ", ".join(f"{g} ({v['nic']}, {v['link']})" for g, v in sorted(far.items()))
        r.add("topology", WARN, f"{len(far)} GPU(s) have no RDMA NIC nearer than NODE / SYS: {shown}",
              "GPUDirect RDMA is not used that far by default (NCCL_NET_GDR_LEVEL): their traffic between hosts "
              "goes through host memory")
    return topo


def _network_checks(r: Report, facts: dict, nnodes: int) -> None:
    ifs = facts["interfaces"]
    if ifs:
        shown = ", ".join(f"{n} {v['operstate']}" + (f" {v['speed_mbps'] // 1000} Gb/s" if v["speed_mbps"] else "")
                          for n, v in ifs.items())
        r.add("network", OK, f"interfaces: {shown}", "what NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME can name")
    ports = facts["ib"]
    if not ports:
        status = WARN if nnodes > 1 else SKIP
        r.add("network", status, "no InfiniBand / RoCE device (/sys/class/infiniband)",
              "traffic between hosts goes over TCP sockets" + (": a fraction of RDMA bandwidth" if nnodes > 1 else
                                                              " (one host: NVLink / PCIe / shared memory inside it)"))
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
            r.add("network", WARN, line, f"not ACTIVE ({p['phys_state']}): NCCL skips it, and the GPUs near it "
                  "send through a farther NIC")
        else:
            r.add("network", OK, line, "NCCL's IB transport uses ACTIVE ports" +
                  ("; RoCE needs a lossless (PFC/ECN) Ethernet fabric" if p["link_layer"] == "Ethernet" else ""))


def _limit_checks(r: Report, limits: dict, facts: dict, n_gpus: int) -> None:
    active = [p for p in facts["ib"] if p.get("state") == "ACTIVE"]
    if active and limits.get("memlock_bytes") is not None:
        r.add("limits", WARN, f"locked memory limited to {_size(limits['memlock_bytes'])} (ulimit -l)",
              "RDMA registers NCCL's buffers as locked memory: 'ibv_reg_mr failed' / 'Unable to register memory'; "
              "set it unlimited (a container's --ulimit memlock=-1)")
    elif active:
        r.add("limits", OK, "locked memory unlimited", "RDMA can register NCCL's buffers")
    shm = limits.get("shm_bytes")
    if shm is not None and n_gpus > 1 and shm < 1 << 30:
        r.add("limits", WARN, f"/dev/shm is {_size(shm)}", "NCCL's shared-memory transport and data loader "
              "workers need more: a container's default 64 MiB fails with bus errors (--shm-size / --ipc=host)")
    elif shm is not None:
        r.add("limits", OK, f"/dev/shm {_size(shm)}", "shared memory for NCCL's SHM transport and loader workers")


def _env_checks(r: Report, env: dict, host: nccl_vars.HostContext, confs: dict[str, dict]) -> None:
    rows = nccl_vars.explain(env, host)
    for path, conf in confs.items():  # NCCL reads these files; a variable set in the environment wins
        rows += [{**row, "source": path}
                 for row in nccl_vars.explain(conf, host) if row["name"] not in env]
    if not rows:
        r.add("environment", OK, "no NCCL_*, GLOO_*, TORCH_* or CUDA_VISIBLE_DEVICES variable set",
              "NCCL and PyTorch use their defaults")
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
    differ("GPUs", lambda f: sorted(Counter(g["name"] for g in f["gpu"]["gpus"]).items()), WARN,
           "the job runs at the slowest GPU's pace")
    names = sorted({n for f in per_host.values() for n in f["env"] if n not in ("CUDA_VISIBLE_DEVICES",)})
    for n in names:
        values = {h: f["env"].get(n) for h, f in per_host.items()}
        if len(set(values.values())) > 1:
            shown = "; ".join(f"{h}: {v if v is not None else '(unset)'}" for h, v in sorted(values.items()))
            r.add("hosts", WARN, f"{n} differs: {shown}", "set it alike on every host (the launcher's environment)")
    return r.checks


# ---- across the job: collectives and matmul -------------------------------------------------------

BUS_FACTOR = {
    # nccl-tests, doc/PERFORMANCE.md: busbw = algbw x factor, so it compares with the hardware's link bandwidth
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
}


def bandwidth(op: str, nbytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes) as nccl-tests defines them. ``nbytes`` is nccl-tests' size: the buffer
    of an all-reduce, the gathered output (n x each rank's part) of an all-gather."""
    algbw = nbytes / 1e9 / seconds
    return algbw, algbw * BUS_FACTOR[op](n)


def default_sizes(device_type: str) -> list[int]:
    return [1 * MIB, 32 * MIB, 256 * MIB, 1024 * MIB] if device_type == "cuda" else [64 << 10, 1 * MIB, 8 * MIB]


def collective_test(op: str, sizes: list[int], iters: int, device, warmup: int = 2) -> list[dict]:
    """Time ``op`` (all_reduce / all_gather, float32 as nccl-tests by default) at each size over the default
    group; each rank's mean time per call is averaged over ranks (nccl-tests' default), then the results are
    checked once with known data. Every rank gets the same rows."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rows = []
    for size in sizes:
        per_rank = max(1, size // 4 // n) if op == "all_gather" else max(1, size // 4)
        nbytes = per_rank * 4 * (n if op == "all_gather" else 1)
        inp = torch.zeros(per_rank, dtype=torch.float32, device=device)  # (per_rank,)
        out = torch.empty(per_rank * n, dtype=torch.float32, device=device) if op == "all_gather" else inp

        def call():
            if op == "all_reduce":
                dist.all_reduce(inp)
            else:
                gather(out, inp)

        for _ in range(warmup):
            call()
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        _sync(device)
        seconds = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(seconds)
        t = float(seconds) / n
        algbw, busbw = bandwidth(op, nbytes, t, n)
        rows.append({"op": op, "bytes": nbytes, "time_us": t * 1e6, "algbw_gbps": algbw, "busbw_gbps": busbw,
                     "wrong": _verify(op, inp, out, rank, n, gather)})
    return rows


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _verify(op, inp, out, rank, n, gather) -> int:
    """Wrong elements after one call with known data (rank r contributes r + 1), agreed over ranks."""
    import torch
    import torch.distributed as dist

    inp.fill_(rank + 1)
    if op == "all_reduce":
        dist.all_reduce(inp)
        wrong = (inp != n * (n + 1) / 2).sum()
    else:
        gather(out, inp)
        expect = torch.arange(1, n + 1, dtype=out.dtype, device=out.device).repeat_interleave(inp.numel())
        wrong = (out != expect).sum()
    wrong = wrong.to(torch.int64).reshape(1)
    dist.all_reduce(wrong)
    return int(wrong)


def matmul_tflops(device, size: int, iters: int, warmup: int = 2) -> dict:
    """TFLOP/s of a fixed square GEMM (size^3, 2 size^3 FLOPs): bf16 on a GPU, fp32 on the CPU."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)  # (size, size)
    b = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)  # (size, size)
    for _ in range(warmup):
        c = a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        c = a @ b  # (size, size)
    _sync(device)
    seconds = (time.perf_counter() - start) / iters
    return {"tflops": 2 * size ** 3 / seconds / 1e12, "dtype": str(dtype).removeprefix("torch."), "size": size,
            "finite": bool(torch.isfinite(c).all())}


def flag_slow(results: list[dict], fraction: float) -> tuple[float, list[dict]]:
    """(median TFLOP/s, the results more than ``fraction`` below it)."""
    median = statistics.median(r["tflops"] for r in results)
    return median, [r for r in results if r["tflops"] < median * (1 - fraction)]


def physical_gpu(local_index: int) -> str:
    """The host's GPU index behind this process's CUDA device (CUDA_VISIBLE_DEVICES renumbers them)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        items = [s.strip() for s in visible.split(",")]
        if local_index < len(items):
            return items[local_index]
    return str(local_index)


def job_tests(options: Options, device, rank: int, local_rank: int, world: int) -> dict:
    """Run on every rank: the collective tests (with several ranks) and the matmul; rank 0 gets everything."""
    import torch.distributed as dist

    on_gpu = device.type == "cuda"
    out: dict = {"world_size": world, "backend": dist.get_backend() if dist.is_initialized() else None}
    if world > 1:
        sizes = options.sizes or default_sizes(device.type)
        iters = options.iters or (20 if on_gpu else 5)
        out["collectives"] = {op: collective_test(op, sizes, iters, device) for op in ("all_reduce", "all_gather")}
    size = options.matmul_size or (8192 if on_gpu else 512)
    mine = matmul_tflops(device, size, options.iters or (20 if on_gpu else 5))
    name = "cpu"
    if on_gpu:
        import torch

        name = torch.cuda.get_device_name(device)
    mine.update(rank=rank, host=socket.gethostname(), local_rank=local_rank, name=name,
                gpu=physical_gpu(device.index or 0) if on_gpu else None)
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
        r.add("collectives", SKIP, "one rank: no collective test", "start several: loom doctor --nproc-per-node N "
              "(or torchrun --nproc-per-node N -m loom doctor, srun python -m loom doctor)")
    else:
        lines = [f"  {'op':<11}{'size':>10}{'time (us)':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}  wrong"]
        for op, rows in job["collectives"].items():
            for row in rows:
                lines.append(f"  {op:<11}{_size(row['bytes']):>10}{row['time_us']:>12.1f}"
                             f"{row['algbw_gbps']:>12.2f}{row['busbw_gbps']:>12.2f}  {row['wrong']}")
            last = rows[-1]
            label = op.replace("_", "-")
            where = f"{world} ranks on {nhosts} host{'s' * (nhosts > 1)}, {job['backend']}"
            r.add("collectives", OK, f"{label}: busbw {last['busbw_gbps']:.1f} GB/s at {_size(last['bytes'])} "
                  f"(algbw {last['algbw_gbps']:.1f}; {where})",
                  f"nccl-tests' bus bandwidth: algbw x {'2(n-1)/n' if op == 'all_reduce' else '(n-1)/n'}, "
                  "comparable with a link's peak whatever n")
            wrong = [row for row in rows if row["wrong"]]
            if wrong:
                r.add("collectives", FAIL, f"{label}: wrong results at {', '.join(_size(w['bytes']) for w in wrong)}",
                      "the collective returned wrong values: a broken transport (set NCCL_DEBUG=INFO and rerun)")
            if options.min_busbw is not None and last["busbw_gbps"] < options.min_busbw:
                r.add("collectives", FAIL, f"{label}: busbw {last['busbw_gbps']:.1f} GB/s < --min-busbw "
                      f"{options.min_busbw:g}", "below the bandwidth this cluster should reach")
        r.tables["collectives"] = "\n".join(lines)
    results = job["matmul"]
    first = results[0]
    median, slow = flag_slow(results, options.slow_fraction)
    lo = min(results, key=lambda x: x["tflops"])
    what = f"{first['dtype']} {first['size']}^3 GEMM"
    if len(results) == 1:
        r.add("matmul", OK, f"{_who(first)}: {_rate(first['tflops'])} ({what})", "one rank: nothing to compare")
    else:
        r.add("matmul", OK, f"{len(results)} ranks: median {_rate(median)}, slowest {_who(lo)} at "
              f"{_rate(lo['tflops'])}; {what}", "" if first["name"] == "cpu" else
              f"a rank more than {options.slow_fraction:.0%} below the median is named")
    if first["name"] == "cpu" and len(results) > 1:
        slow = []
        r.add("matmul", SKIP, "CPU ranks are not compared", "they share this host's cores, so their speeds differ "
              "by scheduling, not by hardware")
    for s in slow:
        r.add("matmul", WARN, f"{_who(s)}: {_rate(s['tflops'])}, {1 - s['tflops'] / median:.0%} below the median",
              "every step waits for the slowest GPU: throttling (power, heat), clocks set low, another process on "
              "it (nvidia-smi -q -d PERFORMANCE,CLOCK)")
    for x in results:
        if not x["finite"]:
            r.add("matmul", FAIL, f"{_who(x)}: the GEMM returned NaN / inf", "the GPU computes wrong values")
    from loom.metrics.flops import peak_flops

    if first["name"] != "cpu":
        for x in results:
            peak = peak_flops(x["name"], x["dtype"])
            if peak and x["tflops"] * 1e12 < MIN_PEAK_SHARE * peak:
                r.add("matmul", WARN, f"{_who(x)}: {x['tflops']:.1f} TFLOP/s is {x['tflops'] * 1e12 / peak:.0%} of "
                      f"the {x['name']}'s {peak / 1e12:.0f} TFLOP/s peak", "a large GEMM reaches well over half: "
                      "throttled clocks, or a smaller --matmul-size")
    lines = [f"  {'rank':>4}  {'host':<20}{'gpu':>4}  {'TFLOP/s':>9}  device"]
    for x in results:
        lines.append(f"  {x['rank']:>4}  {x['host'][:20]:<20}{x['gpu'] or '-':>4}  {x['tflops']:>9.3f}  {x['name']}")
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
    """The doctor on this process: alone, or as one rank of a job (torchrun / elastic / SLURM variables), where
    rank 0 gets every host's facts and every rank's results."""
    from loom.parallel.env import env_from_slurm

    os.environ.update(env_from_slurm(dict(os.environ)))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    facts = local_facts() if local_rank == 0 else None
    env = {n: os.environ[n] for n in nccl_vars.listed(dict(os.environ))}
    report = Report(is_main=rank == 0)
    try:
        device, joined = _join(world, local_rank, options.timeout_s)
    except Exception as err:  # noqa: BLE001 - the reason the job could not start is the finding
        if facts is not None:
            report.checks += local_checks(facts)
        report.add("collectives", FAIL, f"rank {rank}: the process group did not start: {type(err).__name__}: "
                   f"{str(err).splitlines()[0] if str(err) else ''}",
                   "see the FAIL / WARN lines above (interfaces, variables); NCCL_DEBUG=INFO says more")
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
            report.checks += [Check(c.section, c.status, f"{host}: {c.what}", c.why)
                              for c in local_checks(f, nnodes=len(per_host)) if c.status in (WARN, FAIL)]
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

    from loom.parallel.env import pick_device

    device = pick_device("auto", local_rank)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
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
    from loom.parallel.env import destroy_distributed

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
                r.add("hosts", WARN, f"{host}: {n} differs between its ranks: "
                      f"{', '.join(sorted(str(v) for v in values))}", "ranks of one job should agree")


# ---- output ---------------------------------------------------------------------------------------

def render(report: Report) -> str:
    """Sections of OK / WARN / FAIL / SKIP lines, each with its reason below it, then a verdict."""
    out = []
    world = report.facts.get("world_size", 1)
    hosts = report.facts.get("hosts") or {}
    names = ", ".join(sorted(hosts)[:4]) + (" ..." if len(hosts) > 4 else "") if hosts else socket.gethostname()
    out.append(f"loom doctor: {world} rank{'s' * (world > 1)} on {len(hosts) or 1} host{'s' * (len(hosts) > 1)} "
               f"({names})")
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

"""What a host has, read without changing anything: software versions, the GPUs and driver (NVML, else
nvidia-smi), the GPU topology (``nvidia-smi topo -m``), InfiniBand / RoCE ports and network interfaces (sysfs),
limits and NCCL configuration files. The parsers take text or a sysfs root, so tests feed them samples."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections import Counter

from loom.cluster import nccl_vars
from loom.runtime.topology import parse_matrix

MIB = 1 << 20
NVLINKS_PER_GPU = (
    18  # H100 / H200 / B200: a pair with more links than a GPU has per peer goes through NVSwitch
)


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
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loom": version(),
        "cuda_runtime": torch.version.cuda,
        "cuda_available": cuda,
        "cuda_devices": torch.cuda.device_count() if cuda else 0,
        "driver_cuda": driver_cuda_version(),
        "nccl": nccl_version(),
        "nccl_available": dist.is_nccl_available(),
        "gloo": dist.is_gloo_available(),
    }


def driver_cuda_version() -> str | None:
    """The newest CUDA the installed driver supports (``cuDriverGetVersion``, e.g. "12.8"), or None without one."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        code = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(code)) != 0 or not code.value:
            return None
    except (OSError, AttributeError):
        return None
    return f"{code.value // 1000}.{code.value % 1000 // 10}"


def nccl_version() -> str | None:
    """The NCCL torch is built with (``torch.cuda.nccl.version()``), or None on a build without it."""
    try:
        import torch.cuda.nccl as nccl

        v = nccl.version()
    except (AttributeError, RuntimeError, ImportError):
        return None
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


SMI_FIELDS = (
    "index",
    "name",
    "uuid",
    "pci.bus_id",
    "driver_version",
    "memory.total",
    "memory.used",
    "temperature.gpu",
    "ecc.errors.uncorrected.volatile.total",
    "mig.mode.current",
)
_SMI_KEYS = (
    "index",
    "name",
    "uuid",
    "bus_id",
    "driver",
    "memory_total_mib",
    "memory_used_mib",
    "temperature_c",
    "ecc_uncorrected",
    "mig",
)
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
        except Exception as err:
            nvml_error = f"NVML: {err}"
    ok, out = run_tool(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"])
    if not ok:
        return {"source": None, "gpus": [], "error": f"{nvml_error}; {out}"}
    gpus = parse_smi_gpus(out)
    driver_cuda = None
    ok, head = run_tool(["nvidia-smi"])
    if ok and (m := re.search(r"CUDA Version:\s*([\d.]+)", head)):
        driver_cuda = m.group(1)
    return {
        "source": "nvidia-smi",
        "gpus": gpus,
        "driver": gpus[0]["driver"] if gpus else None,
        "driver_cuda": driver_cuda,
        "nvml_error": nvml_error,
    }


def _nvml_facts(nv) -> dict:
    nv.nvmlInit()
    try:

        def text(x):
            return x.decode() if isinstance(x, bytes) else x

        def maybe(fn, *args):
            try:
                return fn(*args)
            except Exception:
                return None

        gpus = []
        driver = text(nv.nvmlSystemGetDriverVersion())
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            mig = maybe(nv.nvmlDeviceGetMigMode, h)
            gpus.append(
                {
                    "index": i,
                    "name": text(nv.nvmlDeviceGetName(h)),
                    "uuid": text(nv.nvmlDeviceGetUUID(h)),
                    "bus_id": text(nv.nvmlDeviceGetPciInfo(h).busId),
                    "driver": driver,
                    "memory_total_mib": mem.total // MIB,
                    "memory_used_mib": mem.used // MIB,
                    "temperature_c": maybe(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                    "ecc_uncorrected": maybe(
                        nv.nvmlDeviceGetTotalEccErrors,
                        h,
                        nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                        nv.NVML_VOLATILE_ECC,
                    ),
                    "mig": None if mig is None else ("Enabled" if mig[0] else "Disabled"),
                }
            )
        code = maybe(nv.nvmlSystemGetCudaDriverVersion)
        return {
            "source": "nvml",
            "gpus": gpus,
            "driver": driver,
            "driver_cuda": f"{code // 1000}.{code % 1000 // 10}" if code else None,
        }
    finally:
        nv.nvmlShutdown()


_LINK_RANK = {"X": 0, "PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5}
parse_topo_matrix = (
    parse_matrix  # the one parser of the matrix (loom.runtime.topology: placement reads it too)
)


def _link_order(link: str) -> tuple[int, int]:
    """Best first: more NVLinks, then the PCIe / CPU paths from nearest to farthest."""
    if m := re.fullmatch(r"NV(\d+)", link):
        return (0, -int(m.group(1)))
    return (1, _LINK_RANK.get(link, 9))


def summarize_topology(topo: dict, rdma: set[str] | None = None) -> dict:
    """GPU pairs by link ({"NV18": 28}), whether any / all pairs use NVLink, a one-line summary, the pairs that do
    not when some do, and each GPU's nearest NIC (among the ``rdma`` device names when given)."""
    gpus = [d for d in topo["devices"] if d.startswith("GPU")]
    nics = [
        d
        for d in topo["devices"]
        if not d.startswith("GPU") and (rdma is None or topo["nic_names"].get(d, d) in rdma)
    ]
    pairs = {(a, b): topo["links"][a].get(b, "?") for i, a in enumerate(gpus) for b in gpus[i + 1 :]}
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
        text = f"{n} GPUs: " + ", ".join(
            f"{link} x {c} pair{'s' * (c > 1)}"
            for link, c in sorted(counts.items(), key=lambda kv: _link_order(kv[0]))
        )
    nearest = {}
    for g in gpus:
        if nics:
            nic = min(nics, key=lambda x: _link_order(topo["links"][g].get(x, "SYS")))
            nearest[g] = {"nic": topo["nic_names"].get(nic, nic), "link": topo["links"][g].get(nic, "?")}
    return {
        "gpus": n,
        "pairs": dict(counts),
        "nvlink": bool(nvlink),
        "all_nvlink": bool(pairs) and len(nvlink) == len(pairs),
        "summary": text,
        "slow_pairs": [f"{a}-{b} {pairs[(a, b)]}" for (a, b) in pairs if nvlink and (a, b) not in nvlink],
        "nearest_nic": nearest,
    }


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
        netdevs = (
            sorted(os.listdir(os.path.join(root, dev, "device", "net")))
            if os.path.isdir(os.path.join(root, dev, "device", "net"))
            else []
        )
        ports_dir = os.path.join(root, dev, "ports")
        if not os.path.isdir(ports_dir):
            continue
        for port in sorted(os.listdir(ports_dir), key=lambda p: int(p) if p.isdigit() else 0):
            base = os.path.join(ports_dir, port)
            rate = _sysfs(os.path.join(base, "rate"))
            m = re.match(r"([\d.]+)\s*Gb/sec", rate or "")
            ports.append(
                {
                    "device": dev,
                    "port": int(port) if port.isdigit() else port,
                    "state": _strip_code(_sysfs(os.path.join(base, "state"))),
                    "phys_state": _strip_code(_sysfs(os.path.join(base, "phys_state"))),
                    "rate": rate,
                    "rate_gbps": float(m.group(1)) if m else None,
                    "link_layer": _sysfs(os.path.join(base, "link_layer")),
                    "netdevs": netdevs,
                    "fw_ver": _sysfs(os.path.join(root, dev, "fw_ver")),
                    "gids": _gids(base),
                }
            )
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
        out.append(
            {
                "index": int(name),
                "gid": gid,
                "type": _sysfs(os.path.join(port_dir, "gid_attrs", "types", name)),
                "netdev": _sysfs(os.path.join(port_dir, "gid_attrs", "ndevs", name)),
            }
        )
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
        out[name] = {
            "operstate": _sysfs(os.path.join(root, name, "operstate")),
            "mtu": int(mtu) if mtu and mtu.isdigit() else None,
            "speed_mbps": int(speed) if speed and speed.lstrip("-").isdigit() and int(speed) > 0 else None,
        }
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
    facts = {
        "software": software_facts(),
        "gpu": gpu_facts(),
        "ib": read_ib_devices(),
        "interfaces": read_interfaces(),
        "limits": host_limits(),
    }
    ok, out = run_tool(["nvidia-smi", "topo", "-m"])
    facts["topology"] = {"raw": out, **parse_topo_matrix(out)} if ok else {"error": out}
    facts["env"] = {n: environ[n] for n in nccl_vars.listed(environ)}
    confs = ["/etc/nccl.conf"] + ([environ["NCCL_CONF_FILE"]] if environ.get("NCCL_CONF_FILE") else [])
    facts["nccl_conf"] = {p: conf for p in confs if (conf := read_nccl_conf(p))}
    return facts

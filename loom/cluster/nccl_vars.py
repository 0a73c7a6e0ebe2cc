"""The NCCL / gloo / PyTorch-distributed / CUDA variables a job's communication depends on: what each does, and
checks of risky values against this host (its interfaces, InfiniBand/RoCE ports, NVLink). Pure functions of the
environment and a ``HostContext``, so they are tested without the hardware."""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

OK, WARN, FAIL = "OK", "WARN", "FAIL"
# the prefixes whose variables the doctor lists (and CUDA_VISIBLE_DEVICES & co. by name, in VARS)
PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCH_")
_NVLINK_NOTE = "this host's GPUs are connected by NVLink"


@dataclass
class HostContext:
    """What the checks compare a value with; ``None`` where the doctor could not find out."""

    interfaces: dict[str, dict] = field(default_factory=dict)  # /sys/class/net: name -> {"operstate": ...}
    ib_ports: list[dict] = field(default_factory=list)  # read_ib_devices() ports
    nvlink: bool | None = None  # any GPU pair over NVLink (nvidia-smi topo -m)
    gpu_count: int = 0  # GPUs NVML / nvidia-smi list on this host
    uses_nccl: bool = False  # CUDA is usable here, so a job's collectives run on NCCL
    nnodes: int = 1


@dataclass(frozen=True)
class Var:
    name: str
    does: str
    check: Callable[[str, HostContext, dict], tuple[str, str]] | None = (
        None  # value, host, environ -> (status, note)
    )


# ---- name filters (NCCL_SOCKET_IFNAME, NCCL_IB_HCA) -----------------------------------------------


def parse_filter(spec: str) -> tuple[bool, bool, list[tuple[str, int | None]]]:
    """NCCL's interface / HCA list syntax: ``[^][=]name[:port],...``: ``^`` excludes the listed, ``=`` matches
    names exactly (else as prefixes), ``:port`` picks one port of an HCA. Returns (exclude, exact, entries)."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    entries = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, port = item.partition(":")
        entries.append((name, int(port) if port.isdigit() else None))
    return exclude, exact, entries


def filter_matches(spec: str, name: str, port: int | None = None) -> bool:
    """Whether NCCL's filter ``spec`` selects interface / HCA ``name`` (and ``port`` when given)."""
    exclude, exact, entries = parse_filter(spec)
    hit = any(
        (name == want if exact else name.startswith(want)) and (p is None or port is None or p == port)
        for want, p in entries
    )
    return hit != exclude


def selected(spec: str, names: list[str]) -> list[str]:
    return [n for n in names if filter_matches(spec, n)]


# ---- checks of one variable ----------------------------------------------------------------------


def _flag(value: str) -> bool:
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def _socket_ifname(value: str, host: HostContext, env: dict) -> tuple[str, str]:
    names = sorted(host.interfaces)
    if not names:
        return OK, "this host's interfaces could not be read (no /sys/class/net)"
    chosen = selected(value, names)
    if not chosen:
        severity = FAIL if host.uses_nccl else WARN
        extra = "" if host.uses_nccl else " (no GPU here: NCCL is not used on this host)"
        return severity, (
            f"selects no interface of this host (it has {', '.join(names)}): NCCL's bootstrap fails "
            f"with 'no socket interface found'{extra}"
        )
    if host.nnodes > 1 and all(n == "lo" for n in chosen):
        return WARN, "selects only the loopback interface: other hosts cannot reach this one"
    down = [n for n in chosen if host.interfaces[n].get("operstate") == "down"]
    note = f"selects {', '.join(chosen)}"
    if down:
        return WARN, f"{note}; {', '.join(down)} down"
    return OK, note


def _gloo_ifname(value: str, host: HostContext, env: dict) -> tuple[str, str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not host.interfaces:
        return OK, "this host's interfaces could not be read (no /sys/class/net)"
    missing = [n for n in names if n not in host.interfaces]
    if missing:
        have = ", ".join(sorted(host.interfaces))
        return FAIL, (
            f"{', '.join(missing)}: no such interface on this host (it has {have}); gloo takes exact "
            "names and its process group fails to start"
        )
    if host.nnodes > 1 and all(n == "lo" for n in names):
        return WARN, "only the loopback interface: other hosts cannot reach this one"
    return OK, f"uses {', '.join(names)}"


def _ib_hca(value: str, host: HostContext, env: dict) -> tuple[str, str]:
    if not host.ib_ports:
        return (
            WARN,
            "set, but this host has no InfiniBand/RoCE device (/sys/class/infiniband): NCCL uses sockets",
        )
    chosen = [p for p in host.ib_ports if filter_matches(value, p["device"], p["port"])]
    if not chosen:
        have = ", ".join(f"{p['device']}:{p['port']}" for p in host.ib_ports)
        return WARN, f"selects no HCA port of this host (it has {have}): NCCL falls back to TCP sockets"
    inactive = [f"{p['device']}:{p['port']}" for p in chosen if p.get("state") != "ACTIVE"]
    names = ", ".join(f"{p['device']}:{p['port']}" for p in chosen)
    if inactive:
        return WARN, f"selects {names}; not ACTIVE: {', '.join(inactive)}"
    return OK, f"selects {names}"


def _gid_index(value: str, host: HostContext, env: dict) -> tuple[str, str]:
    try:
        index = int(value)
    except ValueError:
        return WARN, "not an integer: NCCL reads an integer GID index"
    if index < 0:
        return OK, "NCCL picks the GID itself (a RoCE v2 GID matching NCCL_SOCKET_FAMILY)"
    roce = [p for p in host.ib_ports if p.get("link_layer") == "Ethernet"]
    if not roce:
        return OK, "no RoCE port here: on InfiniBand the GID index matters only for routing between subnets"
    bad = []
    for p in roce:
        gid = next((g for g in p.get("gids", []) if g["index"] == index), None)
        if gid is None:
            bad.append(f"{p['device']}:{p['port']} has no GID {index}")
        elif gid.get("type") != "RoCE v2":
            bad.append(f"{p['device']}:{p['port']} GID {index} is {gid.get('type') or 'of no type'}")
    if bad:
        return WARN, "; ".join(bad) + " (NCCL wants a RoCE v2 GID whose address other hosts route to)"
    return OK, f"GID {index} is RoCE v2 on every RoCE port"


def _ib_disable(value: str, host: HostContext, env: dict) -> tuple[str, str]:
    active = [p for p in host.ib_ports if p.get("state") == "ACTIVE"]
    if _flag(value) and active:
        return WARN, (
            f"IB/RoCE off although {len(active)} port(s) are ACTIVE: traffic between hosts goes over TCP "
            "sockets, a fraction of RDMA bandwidth"
        )
    return OK, ""


def _p2p_disable(value: str, host: HostContext, env: dict) -> tuple[str, str]:
    if not _flag(value):
        return OK, ""
    if host.nvlink:
        return WARN, (
            f"P2P off but {_NVLINK_NOTE}: GPU-to-GPU traffic goes through host shared memory instead, "
            "several times slower"
        )
    return OK, "often a workaround for broken PCIe peer access (IOMMU, some VMs); check it is still needed"


def _p2p_level(value: str, host: HostContext, env: dict) -> tuple[str, str]:
    if value.strip().upper() in ("LOC", "0") and host.nvlink:
        return WARN, f"LOC never uses P2P, but {_NVLINK_NOTE}: traffic goes through host memory"
    if (
        value.strip().upper() not in ("LOC", "NVL", "PIX", "PXB", "PHB", "SYS")
        and not value.strip().isdigit()
    ):
        return WARN, "not a level NCCL knows (LOC, NVL, PIX, PXB, PHB, SYS)"
    return OK, ""


def _shm_disable(value: str, host: HostContext, env: dict) -> tuple[str, str]:
    if _flag(value) and _flag(env.get("NCCL_P2P_DISABLE", "0")):
        return WARN, "with NCCL_P2P_DISABLE also set, GPUs of one host talk through the network transport"
    return OK, ""


_ALGOS = {"ring", "tree", "collnet", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat"}
_PROTOS = {"ll", "ll128", "simple"}


def _names_in(value: str) -> list[str]:
    """The algorithm / protocol names of NCCL_ALGO / NCCL_PROTO (``^`` lists, ``coll:names;...`` forms)."""
    out = []
    for part in value.split(";"):
        names = part.split(":", 1)[-1].lstrip("^")
        out += [n.strip().lower() for n in names.split(",") if n.strip()]
    return out


def _forced(
    known: set[str], what: str, exclusion_ok: str = ""
) -> Callable[[str, HostContext, dict], tuple[str, str]]:
    def check(value: str, host: HostContext, env: dict) -> tuple[str, str]:
        unknown = [n for n in _names_in(value) if n not in known]
        if unknown:
            return WARN, f"{', '.join(unknown)}: not a {what} NCCL knows ({', '.join(sorted(known))})"
        if exclusion_ok and value.replace(" ", "").lower() == exclusion_ok:
            return (
                OK,
                f"{value}: the documented workaround for LL128 data corruption on some H100 NCCL versions",
            )
        return WARN, (
            f"forces the {what}: NCCL's tuner no longer picks per size and topology; NCCL lists this "
            "under debugging, not for production"
        )

    return check


def _debug(value: str, host: HostContext, env: dict) -> tuple[str, str]:
    level = value.strip().upper()
    if level == "TRACE":
        return WARN, "TRACE logs every call (and needs a debug build of NCCL): slow"
    if level == "INFO":
        return OK, "INFO: many lines per rank at start-up (topology, channels, transports), useful once"
    if level in ("VERSION", "WARN", "ABORT", ""):
        return OK, ""
    return WARN, "not a level NCCL knows (VERSION, WARN, INFO, TRACE)"


def _topo_file(value: str, host: HostContext, env: dict) -> tuple[str, str]:
    if not os.path.isfile(value):
        return WARN, f"{value}: no such file on this host"
    return OK, ""


def _async_error_handling(value: str, host: HostContext, env: dict) -> tuple[str, str]:
    if value.strip() == "0":
        return WARN, "0: a failed or timed-out collective is never noticed; a hang stays a hang"
    return OK, ""


def _distributed_debug(value: str, host: HostContext, env: dict) -> tuple[str, str]:
    if value.strip().upper() == "DETAIL":
        return WARN, "DETAIL checks every collective's shapes across ranks: slow, for debugging"
    if value.strip().upper() not in ("OFF", "INFO", "DETAIL"):
        return WARN, "not a level PyTorch knows (OFF, INFO, DETAIL)"
    return OK, ""


def _launch_blocking(value: str, host: HostContext, env: dict) -> tuple[str, str]:
    if _flag(value):
        return WARN, "every kernel launch waits for the GPU: training runs much slower (debugging only)"
    return OK, ""


def _visible_devices(value: str, host: HostContext, env: dict) -> tuple[str, str]:
    items = [s.strip() for s in value.split(",")]
    if value.strip() == "" or value.strip() in ("-1", "none", "NoDevFiles"):
        return WARN, "hides every GPU: the job runs on the CPU"
    if len(set(items)) != len(items):
        return WARN, "lists a GPU twice: two ranks would share it"
    numeric = [i for i in items if i.isdigit()]
    if host.gpu_count and numeric:
        beyond = [i for i in numeric if int(i) >= host.gpu_count]
        if beyond:
            return WARN, (
                f"{', '.join(beyond)}: beyond this host's {host.gpu_count} GPUs; CUDA stops the list at "
                "the first invalid entry"
            )
    return OK, f"{len(items)} GPU(s) visible to the processes"


def _deprecated(new: str) -> Callable[[str, HostContext, dict], tuple[str, str]]:
    def check(value: str, host: HostContext, env: dict) -> tuple[str, str]:
        return WARN, f"the old name: recent PyTorch reads {new}"

    return check


VARS: tuple[Var, ...] = (
    # ---- NCCL: system configuration
    Var(
        "NCCL_SOCKET_IFNAME",
        "IP interfaces NCCL uses for its bootstrap and socket transport (prefixes; ^ "
        "excludes, = matches exactly)",
        _socket_ifname,
    ),
    Var("NCCL_SOCKET_FAMILY", "AF_INET or AF_INET6: the address family of NCCL's sockets"),
    Var(
        "NCCL_IB_HCA",
        "which InfiniBand/RoCE adapters (and ports) NCCL uses (prefixes; ^ excludes, = exact, :port)",
        _ib_hca,
    ),
    Var(
        "NCCL_IB_GID_INDEX",
        "the GID (address) of a RoCE port NCCL uses; unset or -1: NCCL picks a RoCE v2 GID (since 2.21)",
        _gid_index,
    ),
    Var(
        "NCCL_IB_DISABLE",
        "1 turns off the IB/RoCE transport: traffic between hosts uses TCP sockets",
        _ib_disable,
    ),
    Var(
        "NCCL_IB_TIMEOUT",
        "the InfiniBand verbs timeout (4.096 us x 2^value); raise it on large, busy fabrics",
    ),
    Var("NCCL_IB_RETRY_CNT", "InfiniBand retries before a connection fails"),
    Var("NCCL_IB_TC", "the traffic class of IB/RoCE packets (the fabric's QoS / lossless class)"),
    Var("NCCL_IB_SL", "the InfiniBand service level of NCCL's queue pairs"),
    Var(
        "NCCL_IB_QPS_PER_CONNECTION",
        "queue pairs per connection: more spread traffic over a multi-path fabric",
    ),
    Var(
        "NCCL_IB_PCI_RELAXED_ORDERING",
        "PCIe relaxed ordering for IB traffic (0 is one workaround for LL128 "
        "corruption on some H100 systems)",
    ),
    Var("NCCL_NET", "force the network transport ('IB' or 'Socket', or a plugin's name)"),
    Var("NCCL_NET_PLUGIN", "which network plugin library NCCL loads (e.g. a cloud's EFA or TCPX plugin)"),
    Var("NCCL_NET_GDR_LEVEL", "the farthest GPU-NIC distance at which GPUDirect RDMA is used (LOC .. SYS)"),
    Var("NCCL_NET_GDR_READ", "GPUDirect RDMA for sends too (reads from GPU memory)"),
    Var(
        "NCCL_CROSS_NIC",
        "whether rings/trees may use different NICs on different hosts (rail-optimized fabrics want 0)",
    ),
    Var(
        "NCCL_TOPO_FILE",
        "an XML topology NCCL loads instead of detecting one (VMs hide the real PCIe tree)",
        _topo_file,
    ),
    Var("NCCL_TOPO_DUMP_FILE", "where NCCL writes the topology it detected (for debugging)"),
    Var("NCCL_CONF_FILE", "a file of NCCL variables read at start (besides /etc/nccl.conf)"),
    Var("NCCL_COLLNET_ENABLE", "1 uses in-network reductions (IB SHARP) through the CollNet plugin"),
    Var("NCCL_MNNVL_ENABLE", "multi-node NVLink (GB200 NVL racks): NVLink between hosts"),
    Var(
        "NCCL_NVLS_ENABLE",
        "NVLink SHARP: all-reduce reduced inside NVSwitch (H100 and later); 0 turns it off "
        "and frees its buffers, where multicast is unsupported or memory is short",
    ),
    Var(
        "NCCL_CUMEM_ENABLE",
        "NCCL's buffers through the cuMem* API (default since 2.19); 0 was a workaround for "
        "a bug fixed in NCCL 2.22.3",
    ),
    # ---- NCCL: transports and tuning
    Var("NCCL_P2P_DISABLE", "1 turns off direct GPU-to-GPU copies over NVLink / PCIe", _p2p_disable),
    Var(
        "NCCL_P2P_LEVEL",
        "the farthest GPU pair that still uses P2P (LOC, NVL, PIX, PXB, PHB, SYS)",
        _p2p_level,
    ),
    Var("NCCL_SHM_DISABLE", "1 turns off the shared-memory transport used where P2P cannot go", _shm_disable),
    Var(
        "NCCL_ALGO",
        "restrict the collective algorithms (Ring, Tree, CollnetDirect, CollnetChain, NVLS, NVLSTree, PAT)",
        _forced(_ALGOS, "algorithm"),
    ),
    Var("NCCL_PROTO", "restrict the protocols (LL, LL128, Simple)", _forced(_PROTOS, "protocol", "^ll128")),
    Var("NCCL_MIN_NCHANNELS", "at least this many channels (parallel rings/trees; each takes SMs)"),
    Var("NCCL_MAX_NCHANNELS", "at most this many channels: fewer SMs for NCCL, less bandwidth"),
    Var("NCCL_BUFFSIZE", "the buffer between two GPUs per channel (bytes, default 4 MiB)"),
    Var("NCCL_NTHREADS", "CUDA threads per NCCL block"),
    Var("NCCL_SOCKET_NTHREADS", "CPU threads per socket connection (cloud TCP networks tune it)"),
    Var("NCCL_NSOCKS_PERTHREAD", "sockets per thread (cloud TCP networks tune it)"),
    Var(
        "NCCL_LAUNCH_MODE",
        "PARALLEL or GROUP: how NCCL launches kernels when one process drives several GPUs",
    ),
    # ---- NCCL: debugging
    Var("NCCL_DEBUG", "NCCL's log level (VERSION, WARN, INFO, TRACE)", _debug),
    Var("NCCL_DEBUG_SUBSYS", "which parts log (INIT, COLL, P2P, NET, GRAPH, ENV, ALL, ...)"),
    Var("NCCL_DEBUG_FILE", "write NCCL's log to this file (%h host, %p pid) instead of stdout"),
    Var(
        "NCCL_ASYNC_ERROR_HANDLING",
        "PyTorch's old name of TORCH_NCCL_ASYNC_ERROR_HANDLING",
        _deprecated("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    ),
    Var(
        "NCCL_BLOCKING_WAIT",
        "PyTorch's old name of TORCH_NCCL_BLOCKING_WAIT",
        _deprecated("TORCH_NCCL_BLOCKING_WAIT"),
    ),
    # ---- gloo
    Var(
        "GLOO_SOCKET_IFNAME",
        "the interface(s) gloo uses (exact names, comma-separated): CPU collectives and CPU offload",
        _gloo_ifname,
    ),
    Var("GLOO_DEVICE_TRANSPORT", "gloo's transport (TCP, or UV)"),
    # ---- PyTorch distributed
    Var(
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "what a failed or timed-out NCCL collective does (0 nothing, 1 abort "
        "and tear down, 2 clean up only, 3 abort without cleanup)",
        _async_error_handling,
    ),
    Var(
        "TORCH_NCCL_BLOCKING_WAIT",
        "1: the host waits on each collective, so a timeout raises where it happened",
    ),
    Var(
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "entries of the NCCL flight recorder (0 turns it off): the last "
        "collectives of each rank, dumped on a timeout",
    ),
    Var("TORCH_NCCL_DUMP_ON_TIMEOUT", "1 dumps the flight recorder when a collective times out"),
    Var("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "file prefix of the flight recorder's dumps (one per rank)"),
    Var("TORCH_NCCL_ENABLE_MONITORING", "the watchdog's heartbeat monitor that kills a stuck process"),
    Var(
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "seconds the heartbeat monitor waits before it kills the process"
    ),
    Var("TORCH_NCCL_DESYNC_DEBUG", "on a timeout, report which rank is behind (costs some speed)"),
    Var("TORCH_NCCL_AVOID_RECORD_STREAMS", "free tensors of async collectives without recordStream"),
    Var("TORCH_NCCL_HIGH_PRIORITY", "NCCL's streams at high priority"),
    Var("TORCH_NCCL_NAN_CHECK", "check collective inputs for NaN (slow)"),
    Var(
        "TORCH_DISTRIBUTED_DEBUG",
        "OFF, INFO or DETAIL: extra checks and logs of torch.distributed",
        _distributed_debug,
    ),
    Var("TORCH_CPP_LOG_LEVEL", "PyTorch's C++ log level (INFO shows the process group's start-up)"),
    Var("TORCH_SHOW_CPP_STACKTRACES", "C++ stack traces in PyTorch's errors"),
    Var(
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "the elastic agent's store not reused by the workers (loom's "
        "launcher sets it: stable restarts on gloo)",
    ),
    Var("TORCH_LOGS", "torch.compile / dynamo logging"),
    # ---- CUDA
    Var(
        "CUDA_VISIBLE_DEVICES",
        "which GPUs (indices or UUIDs) the processes see, renumbered from 0",
        _visible_devices,
    ),
    Var(
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "hardware queues per device (1 keeps communication and compute kernels "
        "in issue order, as Megatron's overlap wants)",
    ),
    Var("CUDA_LAUNCH_BLOCKING", "1 makes every kernel launch synchronous (debugging)", _launch_blocking),
    Var("CUDA_MODULE_LOADING", "LAZY (default) loads kernels when first used"),
    Var(
        "PYTORCH_CUDA_ALLOC_CONF",
        "PyTorch's caching allocator (expandable_segments:True reduces fragmentation)",
    ),
    Var("PYTORCH_ALLOC_CONF", "PyTorch's caching allocator (the newer name of PYTORCH_CUDA_ALLOC_CONF)"),
)
KNOWN = {v.name: v for v in VARS}


def listed(environ: dict[str, str]) -> list[str]:
    """The variables the doctor reports: every known one set, and any other NCCL_* / GLOO_* / TORCH_* set."""
    return sorted(n for n in environ if n in KNOWN or n.startswith(PREFIXES))


def explain(environ: dict[str, str], host: HostContext) -> list[dict]:
    """One row per reported variable: name, value, status, what it does and a note on this value here."""
    rows = []
    for name in listed(environ):
        value = environ[name]
        var = KNOWN.get(name)
        if var is None:
            near = difflib.get_close_matches(name, KNOWN, n=1, cutoff=0.85)
            if near and name.startswith(("NCCL_", "GLOO_", "TORCH_NCCL_")):
                rows.append(
                    _row(
                        name,
                        value,
                        WARN,
                        "",
                        f"not a variable loom knows; did you mean {near[0]}? "
                        "(NCCL ignores names it does not read)",
                    )
                )
            else:
                rows.append(_row(name, value, OK, "", "not in loom's table (see NCCL's or PyTorch's docs)"))
            continue
        status, note = var.check(value, host, environ) if var.check else (OK, "")
        rows.append(_row(name, value, status, var.does, note))
    return rows


def _row(name, value, status, does, note) -> dict:
    return {"name": name, "value": value, "status": status, "does": does, "note": note}


def markdown_table() -> str:
    """The table of known variables for docs/operations.md."""
    lines = ["| variable | what it does | the doctor warns when |", "|---|---|---|"]
    warns = {
        "NCCL_SOCKET_IFNAME": "it selects no interface of the host (FAIL where NCCL runs), only `lo` on several hosts",
        "NCCL_IB_HCA": "it selects no HCA port, or a port that is not ACTIVE",
        "NCCL_IB_GID_INDEX": "the index is missing or not RoCE v2 on a RoCE port",
        "NCCL_IB_DISABLE": "ACTIVE IB/RoCE ports exist",
        "NCCL_P2P_DISABLE": "the GPUs are connected by NVLink",
        "NCCL_P2P_LEVEL": "`LOC` on an NVLink machine, an unknown level",
        "NCCL_SHM_DISABLE": "P2P is disabled too",
        "NCCL_ALGO": "always (forcing is for debugging), or an unknown name",
        "NCCL_PROTO": "always but `^LL128`, or an unknown name",
        "NCCL_DEBUG": "`TRACE`, an unknown level",
        "NCCL_TOPO_FILE": "the file does not exist",
        "GLOO_SOCKET_IFNAME": "a name is not an interface of the host (FAIL), only `lo` on several hosts",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "`0`",
        "TORCH_DISTRIBUTED_DEBUG": "`DETAIL`, an unknown level",
        "CUDA_VISIBLE_DEVICES": "empty, a repeated GPU, an index beyond the host's GPUs",
        "CUDA_LAUNCH_BLOCKING": "`1`",
        "NCCL_ASYNC_ERROR_HANDLING": "always (the old name)",
        "NCCL_BLOCKING_WAIT": "always (the old name)",
    }
    for v in VARS:
        lines.append(f"| `{v.name}` | {v.does.replace('|', '/')} | {warns.get(v.name, '')} |")
    return "\n".join(lines)

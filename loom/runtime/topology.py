"""One host's GPU topology from ``nvidia-smi topo -m`` and the placement of local ranks on it.

The matrix names, for every GPU pair, the path between them: ``NV#`` (# bonded NVLinks; through NVSwitch on
HGX boxes), ``PIX`` (one PCIe switch), ``PXB`` (several), ``PHB`` (the CPU's host bridge), ``NODE`` (between
host bridges of one NUMA node) and ``SYS`` (across CPU sockets); for every GPU its nearest NICs, its CPUs and
its NUMA node. ``Topology`` holds that; ``place`` orders the local ranks on the GPUs so that the mesh axes that
talk most (tp, then cp, then dp) get the fastest links and pipeline sends the slowest, and ``apply_placement``
does it for a launched rank (``parallel.placement = auto``): which GPU it uses and which CPUs it runs on.
Everything reads text or plain values, so tests feed recorded matrices (tests/data/topology)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from loom.parallel.placement import axis_groups

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# the PCIe / CPU paths, nearest first (cost after NVLink's 1 and 2)
PATH_COST = {"PIX": 3, "PXB": 4, "PHB": 5, "NODE": 6, "SYS": 7}
FAR = 8  # a path the matrix does not name
# the axes whose groups' links are weighed, most traffic first (pp: neighbouring stages only)
WEIGHED = ("tp", "cp", "dp_shard", "dp_replicate", "pp")
SEARCH_NODES = 50_000  # the branch-and-bound's budget (~0.5 s): beyond it, the best order found so far


def parse_matrix(text: str) -> dict:
    """``nvidia-smi topo -m`` -> {"devices": [...], "links": {row: {col: link}}, "cpu_affinity": {gpu: ...},
    "numa": {gpu: ...}, "nic_names": {"NIC0": "mlx5_0"}}. Columns are found by name (tabs or spaces)."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    rows: dict[str, list[str]] = {}
    header: list[str] | None = None
    nic_names: dict[str, str] = {}
    for ln in lines:
        tokens = ln.split()
        if header is None:
            # the header comes first; the rows follow it up to a blank line or the legend
            if "GPU0" in tokens:
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
        links[name] = dict(zip(devices, cells[: len(devices)]))
        rest = cells[len(devices) :]
        if name.startswith("GPU") and rest:
            cpu[name] = rest[0]
            if len(rest) > 1:
                numa[name] = rest[1]
    return {"devices": devices, "links": links, "cpu_affinity": cpu, "numa": numa, "nic_names": nic_names}


def parse_cpus(text: str | None) -> frozenset[int] | None:
    """A CPU list like ``0-55,112-167`` -> its CPUs; None for ``N/A`` or an empty cell."""
    if not text or not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", text):
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


@dataclass(frozen=True)
class Topology:
    """GPUs by their nvidia-smi index, the link of every GPU pair and GPU-NIC pair, each GPU's CPUs and NUMA
    node (None where the matrix says N/A) and each NIC's device name (``mlx5_0``)."""

    gpus: tuple[int, ...]
    links: dict[tuple[int, int], str]  # (a, b) with a != b, both orders
    nic_links: dict[tuple[int, str], str]  # (gpu, "NIC0") -> link
    nic_names: dict[str, str] = field(default_factory=dict)
    cpus: dict[int, frozenset[int] | None] = field(default_factory=dict)
    numa: dict[int, int | None] = field(default_factory=dict)

    @classmethod
    def from_text(cls, text: str) -> Topology:
        return cls.from_matrix(parse_matrix(text))

    @classmethod
    def from_matrix(cls, m: dict) -> Topology:
        """From ``parse_matrix``'s dict."""
        gpus = [d for d in m["devices"] if d.startswith("GPU")]
        nics = [d for d in m["devices"] if d.startswith("NIC")]
        idx = {g: int(g[3:]) for g in gpus}
        links = {(idx[a], idx[b]): m["links"][a].get(b, "?") for a in gpus for b in gpus if a != b}
        nic_links = {(idx[g], n): m["links"][g].get(n, "?") for g in gpus for n in nics}
        numa = {idx[g]: int(v) if (v := m["numa"].get(g, "")).isdigit() else None for g in gpus}
        cpus = {idx[g]: parse_cpus(m["cpu_affinity"].get(g)) for g in gpus}
        return cls(tuple(idx[g] for g in gpus), links, nic_links, m["nic_names"], cpus, numa)

    def nvlinked(self, a: int, b: int) -> bool:
        return self.links.get((a, b), "").startswith("NV")

    def cost(self, a: int, b: int) -> int:
        """1 for the widest NVLink bond on the host, 2 for a narrower one, then PIX 3 .. SYS 7."""
        link = self.links.get((a, b), "")
        if m := re.fullmatch(r"NV(\d+)", link):
            return 1 if int(m.group(1)) >= self._widest_nv else 2
        return PATH_COST.get(link, FAR)

    @property
    def _widest_nv(self) -> int:
        return max((int(v[2:]) for v in self.links.values() if re.fullmatch(r"NV\d+", v)), default=0)

    def domains(self) -> list[list[int]]:
        """The NVLink domains: GPUs joined by NVLink paths (connected components), in index order."""
        seen: set[int] = set()
        out = []
        for g in self.gpus:
            if g in seen:
                continue
            comp, stack = [], [g]
            seen.add(g)
            while stack:
                x = stack.pop()
                comp.append(x)
                for y in self.gpus:
                    if y not in seen and self.nvlinked(x, y):
                        seen.add(y)
                        stack.append(y)
            out.append(sorted(comp))
        return out

    def nearest_nic(self, gpu: int, allowed: set[str] | None = None) -> tuple[str, str] | None:
        """(device name, link) of the NIC nearest ``gpu`` (among ``allowed`` device names when given)."""
        rank = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}
        nics = [
            (n, link)
            for (g, n), link in self.nic_links.items()
            if g == gpu and (allowed is None or self.nic_names.get(n, n) in allowed)
        ]
        if not nics:
            return None
        n, link = min(nics, key=lambda x: (rank.get(x[1], 9), int(x[0][3:])))
        return self.nic_names.get(n, n), link

    def restrict(self, visible: list[int]) -> Topology:
        """The topology of the GPUs ``visible`` lists (CUDA_VISIBLE_DEVICES), renumbered 0.. in that order."""
        pos = {g: i for i, g in enumerate(visible)}
        return Topology(
            tuple(range(len(visible))),
            {(pos[a], pos[b]): v for (a, b), v in self.links.items() if a in pos and b in pos},
            {(pos[g], n): v for (g, n), v in self.nic_links.items() if g in pos},
            self.nic_names,
            {pos[g]: c for g, c in self.cpus.items() if g in pos},
            {pos[g]: c for g, c in self.numa.items() if g in pos},
        )


def read_topology() -> tuple[Topology | None, str]:
    """(this host's topology, "") or (None, one line saying why there is none)."""
    if shutil.which("nvidia-smi") is None:
        return None, "nvidia-smi is not on PATH: no GPU topology"
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"nvidia-smi topo -m: {err}"
    topo = Topology.from_text(out.stdout) if out.returncode == 0 else None
    if topo is None or not topo.gpus:
        first = (out.stdout.strip() or out.stderr.strip() or f"exit code {out.returncode}").splitlines()[0]
        return None, f"nvidia-smi topo -m gave no GPU matrix: {first}"
    return topo, ""


# ---- placement ----------------------------------------------------------------------------------------


@dataclass
class Placement:
    """``order[local_rank]``: the GPU (index into the topology) each local rank uses; ``lines``: what a user
    should know (a tp / cp group that no order keeps on NVLink)."""

    order: list[int]
    lines: list[str]


def host_pairs(sizes: dict[str, int], base: int, nlocal: int) -> dict[str, list[tuple[int, int]]]:
    """Per weighed axis, the pairs of local ranks (``base``: this host's first global rank) that are in one
    group of that axis: every pair of a tp / cp / dp group, neighbouring stages of a pp group."""
    out: dict[str, list[tuple[int, int]]] = {}
    for axis in WEIGHED:
        pairs = []
        if sizes.get(axis, 1) > 1:
            for group in axis_groups(sizes, axis):
                local = [r - base for r in group if base <= r < base + nlocal]
                if axis == "pp":
                    pairs += list(zip(local, local[1:]))
                else:
                    pairs += [(a, b) for i, a in enumerate(local) for b in local[i + 1 :]]
        out[axis] = pairs
    return out


def place(topo: Topology, sizes: dict[str, int], base: int, nlocal: int) -> Placement:
    """The order of local ranks on GPUs that minimizes, in turn, the tp groups' link costs, then cp's, dp_shard's,
    dp_replicate's and pp's (a branch-and-bound over assignments, cheapest GPU first and ties in index order, so that on a
    box where every order costs the same, e.g. an NVSwitch HGX, the order is the identity)."""
    gpus = list(topo.gpus)
    if nlocal > len(gpus):
        return Placement(
            list(range(nlocal)),
            [f"placement: {nlocal} local ranks but {len(gpus)} GPUs in the topology: left as is"],
        )
    per_axis = host_pairs(sizes, base, nlocal)
    scale = 8 * nlocal * nlocal + 1  # above any one axis's total cost: the weights order the axes strictly
    weight = {a: scale ** (len(WEIGHED) - 1 - i) for i, a in enumerate(WEIGHED)}
    earlier: list[list[tuple[int, int]]] = [[] for _ in range(nlocal)]  # rank -> (earlier rank, weight)
    for axis, pairs in per_axis.items():
        for a, b in pairs:
            lo, hi = sorted((a, b))
            earlier[hi].append((lo, weight[axis]))
    cheapest = min((topo.cost(a, b) for a in gpus for b in gpus if a != b), default=1)
    # lower bound of what ranks k.. still add: each of their pairs at the cheapest link
    bound = [0] * (nlocal + 1)
    for k in range(nlocal - 1, -1, -1):
        bound[k] = bound[k + 1] + sum(w for _, w in earlier[k]) * cheapest
    cost = {(a, b): topo.cost(a, b) for a in gpus for b in gpus if a != b}
    best: list = [None, None]
    assign: list[int] = []
    used: set[int] = set()
    nodes = 0

    def search(k: int, so_far: int) -> None:
        nonlocal nodes
        nodes += 1
        if best[0] is not None and (so_far + bound[k] >= best[0] or nodes > SEARCH_NODES):
            return
        if k == nlocal:
            best[0], best[1] = so_far, list(assign)
            return
        # cheapest GPUs first (a good order early prunes the rest); ties keep index order
        adds = [(sum(w * cost[(assign[i], g)] for i, w in earlier[k]), g) for g in gpus if g not in used]
        for add, g in sorted(adds, key=lambda x: x[0]):
            assign.append(g)
            used.add(g)
            search(k + 1, so_far + add)
            assign.pop()
            used.discard(g)

    search(0, 0)
    order = best[1]
    return Placement(order, _unavoidable(topo, per_axis, order))


def _unavoidable(topo: Topology, per_axis: dict, order: list[int]) -> list[str]:
    """One line per axis (tp, cp) whose groups the best order still puts across a link that is not NVLink."""
    lines = []
    for axis in ("tp", "cp"):
        bad = [(order[a], order[b]) for a, b in per_axis[axis] if not topo.nvlinked(order[a], order[b])]
        if bad:
            a, b = bad[0]
            doms = " | ".join(",".join(f"GPU{g}" for g in d) for d in topo.domains())
            lines.append(
                f"placement: no order keeps every {axis} group inside one NVLink domain on this host "
                f"(GPU{a}-GPU{b} is {topo.links.get((a, b), '?')}; NVLink domains: {doms}): make {axis} x the "
                "axes inside it at most the domain's size"
            )
    return lines


def numa_cpus(topo: Topology, gpu: int, allowed: set[int]) -> set[int] | None:
    """The CPUs a rank on ``gpu`` should run on: its NUMA node's CPUs (the matrix's CPU affinity) that this
    process may use (``allowed``: os.sched_getaffinity); None where the matrix has none or none is allowed."""
    cpus = topo.cpus.get(gpu)
    if not cpus:
        return None
    mine = set(cpus) & set(allowed)
    return mine or None


def usable_cpus(cgroup: str = "/sys/fs/cgroup") -> int:
    """The CPUs this process may keep busy: its affinity, capped by a cgroup CPU quota (v2 ``cpu.max``, v1
    ``cpu/cpu.cfs_quota_us`` over ``cpu.cfs_period_us``). A container limited by quota shows every host CPU to
    ``os.cpu_count()`` and to the affinity, and threads sized from those oversubscribe it: the kernel then throttles
    the whole container for the rest of each quota period, a stall that lands on whichever rank ran over."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            with open(os.path.join(cgroup, quota_file)) as fh:
                fields = fh.read().split()
            if period_file is not None:
                with open(os.path.join(cgroup, period_file)) as fh:
                    fields = [fields[0], fh.read().split()[0]]
            quota, period = fields[0], int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
        if quota not in ("max", "-1") and int(quota) > 0 and period > 0:
            n = min(n, max(1, int(quota) // period))
        break
    return max(1, n)


def visible_gpus(environ: dict[str, str]) -> tuple[list[int] | None, str]:
    """The physical GPU indices CUDA_VISIBLE_DEVICES lists, in order (None: every GPU), or (None, why placement
    cannot map them: UUIDs or MIG instances, which the matrix does not name)."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None, ""
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not all(v.isdigit() for v in items):
        return None, f"CUDA_VISIBLE_DEVICES={value} names devices by UUID or MIG: placement needs indices"
    return [int(v) for v in items], ""


def apply_placement(
    parallel, device_kind: str, environ=None, topo_text: str | None = None
) -> tuple[int | None, list[str]]:
    """``parallel.placement = auto`` for this launched rank: (the CUDA device index it should use, the lines to
    print). Binds the process to its GPU's NUMA CPUs where the system allows. Off, on the CPU, alone or
    without a topology: (None, a line saying why where there is one). ``topo_text``: a recorded matrix (tests)."""
    from loom.config.errors import ConfigError
    from loom.parallel.dims import AXIS_ORDER, ParallelDims
    from loom.runtime.env import env_from_launcher

    environ = os.environ if environ is None else environ
    if parallel.placement != "auto" or device_kind == "cpu":
        return None, []
    environ.update(env_from_launcher(dict(environ)))
    world = int(environ.get("WORLD_SIZE", "1"))
    rank, local = int(environ.get("RANK", "0")), int(environ.get("LOCAL_RANK", "0"))
    nlocal = int(environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world == 1:
        return None, []
    if environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID") != "PCI_BUS_ID":
        return None, [
            f"placement off: CUDA_DEVICE_ORDER={environ['CUDA_DEVICE_ORDER']} (nvidia-smi's order is PCI_BUS_ID)"
        ]
    try:
        dims = ParallelDims.from_config(parallel, world)
    except ConfigError:
        return None, []  # the resolver names the field
    if topo_text is not None:
        topo, why = Topology.from_text(topo_text), ""
    else:
        topo, why = read_topology()
    if topo is None:
        return None, [f"placement off: {why}"]
    visible, why = visible_gpus(environ)
    if why:
        return None, [f"placement off: {why}"]
    if visible is not None:
        topo = topo.restrict([g for g in visible if g in topo.gpus])
    environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA numbers the GPUs as nvidia-smi does
    sizes = {a: getattr(dims, a) for a in AXIS_ORDER}
    result = place(topo, sizes, rank - local, nlocal)
    gpu = result.order[local]
    lines = []  # the host's lines from its local rank 0, a rank's own problem from that rank
    if local == 0:
        order = " ".join(f"{r}->{g}" for r, g in enumerate(result.order))
        lines += [f"placement: local rank -> GPU {order}", *result.lines]
    if hasattr(os, "sched_setaffinity"):
        cpus = numa_cpus(topo, gpu, os.sched_getaffinity(0))
        if cpus is not None:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError as err:
                lines.append(f"placement: could not bind local rank {local} to GPU{gpu}'s CPUs: {err}")
    return gpu, lines

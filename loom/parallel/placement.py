"""Topology-aware rank placement: which ranks each mesh axis groups, and a start-up check that the
tensor-parallel (and context-parallel) groups each lie within one host.

Rank order. ``ParallelDims`` builds its mesh over ranks ``0..world-1`` in row-major order over
``AXIS_ORDER = (pp, dp_replicate, dp_shard, cp, tp)``: tp is innermost (a tp group is ``tp`` consecutive ranks),
then cp, dp_shard, dp_replicate, and pp outermost (a pipeline stage is a contiguous block of
``world / pp`` ranks). Launchers number ranks host by host (torchrun's agents give node i ranks
``i * nproc .. (i + 1) * nproc - 1``), so with ``tp x cp`` dividing the ranks per host, tp and cp traffic (an
all-reduce or all-gather in every layer) stays on the host's NVLink, data-parallel traffic (once per step,
overlapped) and pipeline sends (activations only) cross hosts.

Why a warning and not an error: a group that spans hosts computes the same losses, only slower, and on
some systems a host is not the fast domain's edge (an NVL72 rack puts 18 hosts in one NVLink domain), so a
cross-host tp group can be intended. The warning names the ranks and hosts; `loom plan` gives layouts that keep
tp within ``--gpus-per-node``.
"""

from __future__ import annotations

import socket

from loom.parallel.dims import AXIS_ORDER

CHECKED = ("tp", "cp")  # axes whose collectives run in every layer: each group should stay on one host


def axis_groups(sizes: dict[str, int], axis: str) -> list[list[int]]:
    """The rank groups of one mesh axis: the ranks whose coordinates differ only along ``axis``, in the mesh's
    row-major order over AXIS_ORDER (``sizes``: degree per axis, missing ones 1)."""
    shape = [sizes.get(a, 1) for a in AXIS_ORDER]
    i = AXIS_ORDER.index(axis)
    stride = 1
    for n in shape[i + 1 :]:
        stride *= n
    world = stride * shape[i]
    for n in shape[:i]:
        world *= n
    block = stride * shape[i]  # ranks that share every coordinate outside this axis and the axes inside it
    return [
        [base + off + k * stride for k in range(shape[i])]
        for base in range(0, world, block)
        for off in range(stride)
    ]


def spanning_groups(hosts: list[str], sizes: dict[str, int]) -> list[tuple[str, list[int], list[str]]]:
    """(axis, ranks, their distinct hosts) for every tp / cp group whose ranks are on more than one host;
    ``hosts[r]`` is rank r's hostname."""
    out = []
    for axis in CHECKED:
        if sizes.get(axis, 1) <= 1:
            continue
        for ranks in axis_groups(sizes, axis):
            names = list(dict.fromkeys(hosts[r] for r in ranks))
            if len(names) > 1:
                out.append((axis, ranks, names))
    return out


def placement_warnings(hosts: list[str], sizes: dict[str, int]) -> list[str]:
    """One line per group that spans hosts, naming its ranks and hosts (at most 4 lines and a count)."""
    bad = spanning_groups(hosts, sizes)
    lines = [
        f"warning: the {axis} group of ranks {_ranks(ranks)} spans hosts {', '.join(names)}: its collectives "
        f"(every layer) leave the host; keep {axis} x the axes inside it within the ranks per host"
        for axis, ranks, names in bad[:4]
    ]
    if len(bad) > 4:
        lines.append(f"warning: {len(bad) - 4} more tp/cp group(s) span hosts")
    return lines


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def check_placement(dims, hostname: str | None = None) -> list[str]:
    """Gather every rank's hostname (one all_gather_object) and return the warnings for tp / cp groups that span
    hosts (the same list on every rank). ``hostname`` replaces this host's name (tests)."""
    sizes = {a: getattr(dims, a) for a in AXIS_ORDER}
    if dims.world_size == 1 or all(sizes[a] == 1 for a in CHECKED):
        return []
    import torch.distributed as dist

    hosts: list = [None] * dims.world_size
    dist.all_gather_object(hosts, hostname or socket.gethostname())
    return placement_warnings(hosts, sizes)

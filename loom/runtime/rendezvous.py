"""A shared-filesystem rendezvous for PyTorch's elastic agent: ``--rdzv-backend file --rdzv-endpoint PATH``.

The c10d backend (the default) keeps the rendezvous state in a TCPStore that the first agent serves on
``--rdzv-endpoint HOST:PORT``: every node must reach that port. The ``file`` backend keeps the same state (the
same ``DynamicRendezvousHandler`` over a ``C10dRendezvousBackend``) in a ``torch.distributed.FileStore`` at PATH,
a file on a filesystem every node mounts, so no node serves a port for the rendezvous. The filesystem must give
POSIX locks across nodes (``flock``/``fcntl``: NFSv4, Lustre mounted with ``flock``, GPFS; not NFSv3 without
lockd). Registration is per process: the agent (``loom train``, or a ``torchrun`` wrapper) calls
:func:`register_file_rendezvous` before it parses ``--rdzv-backend``.

What the workers get: torch's agent still hands every worker MASTER_ADDR (node rank 0's address) and a
MASTER_PORT (a free port that node picked), and ``init_process_group("env://")`` would serve the process
group's TCPStore there. With the file backend each agent also exports :data:`PG_STORE_ENV` (this round's
prefix inside PATH); :func:`worker_store` turns it into a ``PrefixStore`` over the same FileStore, and
``init_process_group(backend, store=worker_store(), rank=RANK, world_size=WORLD_SIZE)`` then needs no
MASTER_PORT at all. The collectives themselves still open connections between nodes (gloo's pairs, NCCL's
bootstrap and transports on ephemeral ports, or InfiniBand): a FileStore removes the one well-known port,
not the network.
"""

from __future__ import annotations

import os
import uuid
from datetime import timedelta

BACKEND = "file"
PG_STORE_ENV = "LOOM_PG_FILE_STORE"  # "<prefix>@<path>": the process group's store, this rendezvous round's
_TOKEN_KEY = "loom/pg_store_prefix"


def register_file_rendezvous() -> None:
    """Register the ``file`` rendezvous backend with torch elastic's handler registry (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)


def _create_handler(params):
    """The registry's creator: a FileStore at ``params.endpoint`` holds the rendezvous state."""
    from torch.distributed import FileStore
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    class FileRendezvousBackend(C10dRendezvousBackend):
        """The c10d backend's state machine over a FileStore; named ``file`` (the registry checks the name)."""

        @property
        def name(self) -> str:
            return BACKEND

    class FileRendezvousHandler(DynamicRendezvousHandler):
        """Dynamic rendezvous whose agents serve no TCPStore for their workers, and export the process group's
        FileStore prefix for this round (:data:`PG_STORE_ENV`)."""

        @property
        def use_agent_store(self) -> bool:
            return False

        def next_rendezvous(self):
            info = super().next_rendezvous()
            # the round's store is fresh each round: one prefix per round, chosen by node 0
            if info.rank == 0:
                info.store.set(_TOKEN_KEY, f"loom_pg/{uuid.uuid4().hex}")
            prefix = info.store.get(_TOKEN_KEY).decode()
            os.environ[PG_STORE_ENV] = f"{prefix}@{path}"  # the agent starts its workers with its environment
            return info

    path = os.path.abspath(params.endpoint.strip()) if params.endpoint and params.endpoint.strip() else ""
    if not path:
        raise ValueError(
            "--rdzv-backend file needs --rdzv-endpoint PATH: a file on a filesystem every node mounts"
        )
    if not os.path.isdir(os.path.dirname(path)):
        raise RendezvousConnectionError(
            f"--rdzv-endpoint {path}: its folder does not exist on this node (the "
            "file backend needs a filesystem every node mounts)"
        )
    # The agent's own TCPStore sharing (torch's default) would serve a port on node 0: the file backend exists to
    # avoid it. Set in the agent process, so its workers see it too.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    store = FileStore(path)
    backend = FileRendezvousBackend(store, params.run_id)
    timeouts = [params.get_as_int(f"{key}_timeout") for key in ("join", "last_call", "close", "heartbeat")]
    timeout = RendezvousTimeout(*(None if t is None else timedelta(seconds=t) for t in timeouts))
    return FileRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3),
    )


def worker_store():
    """The process group's store for a worker started by a file-rendezvous agent (a ``PrefixStore`` over the
    rendezvous FileStore), or None when the agent was not one (use ``env://``)."""
    spec = os.environ.get(PG_STORE_ENV)
    if not spec:
        return None
    from torch.distributed import FileStore, PrefixStore

    prefix, _, path = spec.partition("@")
    return PrefixStore(prefix, FileStore(path))

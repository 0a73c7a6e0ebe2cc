"""``loom launch --ray``: one training job on a Ray cluster, one Ray actor per rank, each running loom train's worker
body (``loom.cli.train.run_worker``) in its own process; the ranks meet at a store rank 0's actor serves and form
a gloo (CPU) or NCCL (one GPU per actor) group as under torchrun. Ray is imported only here (``loom-train[ray]``)."""

from __future__ import annotations

import os
import sys

from loom.config.errors import ConfigError, UserError, require


def rank_envs(
    nodes: list[str], master_addr: str, master_port: int, gpus: list[str] | None = None
) -> list[dict[str, str]]:
    """torchrun's variables for the actors on ``nodes`` (each actor's node id, in the order they were made):
    ranks numbered node by node, in the order nodes first appear (so a tp group of consecutive ranks stays on one
    node where it fits; actor 0 is rank 0), the local rank being the actor's place among its node's. ``gpus``: each
    actor's GPU (Ray's id); every rank of a node then sees all of the node's job GPUs, its own at its local rank
    (as torchrun's workers do: NCCL's peer-to-peer paths need the peers' GPUs visible; Ray shows each only its own)."""
    order = list(dict.fromkeys(nodes))
    per_node = {node: [i for i, n in enumerate(nodes) if n == node] for node in order}
    ranked = [i for node in order for i in per_node[node]]
    envs: list[dict[str, str]] = [{} for _ in nodes]
    for rank, i in enumerate(ranked):
        mates = per_node[nodes[i]]
        envs[i] = {
            "RANK": str(rank),
            "WORLD_SIZE": str(len(nodes)),
            "LOCAL_RANK": str(mates.index(i)),
            "LOCAL_WORLD_SIZE": str(len(mates)),
            "GROUP_RANK": str(order.index(nodes[i])),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }
        if gpus:
            envs[i]["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[j] for j in mates)
    return envs


class Rank:
    """One rank of the job, as a Ray actor (``ray.remote(Rank)``): its node, a free port there (rank 0's becomes
    the rendezvous), then the worker body with the job's variables."""

    def node(self) -> tuple[str, str]:
        """(this actor's node id, the GPU Ray gave it, '' without)."""
        import ray

        return ray.get_runtime_context().get_node_id(), ",".join(str(g) for g in ray.get_gpu_ids())

    def address(self) -> tuple[str, int]:
        """This node's address and the port of a TCPStore this actor serves from now on (port 0: the kernel's
        pick, nothing raced for). Rank 0's ``init_process_group`` (env://, a multi-tenant store) shares the server
        already listening there; a port merely found free could be taken meanwhile, even by a peer's own retried
        connect landing on itself while rank 0 still starts."""
        import ray
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
        return ray.util.get_node_ip_address(), self.store.port

    def train(self, env: dict[str, str], argv: list[str], workdir: str | None) -> tuple[int, str]:
        """loom train's worker body in this process: (0, '') when it finished, (2, the line) for a user error,
        (1, the line) for a run that stopped itself; a bug raises (Ray hands its traceback to the driver)."""
        from loom.cli.train import run_worker
        from loom.config.errors import TrainingStopped

        os.environ.update(env)
        for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
            os.environ.pop(var, None)  # a driver inside mpirun or SLURM: these ranks are Ray's
        if workdir and os.path.isdir(workdir):
            os.chdir(workdir)  # relative paths (--config, run.dir) mean what they meant where the driver ran
        try:
            run_worker(argv)
        except (ConfigError, UserError) as err:
            return 2, str(err)
        except TrainingStopped as err:
            return 1, f"stopped: {err}"
        return 0, ""


def run(
    train_args: list[str],
    num_workers: int,
    *,
    gpus: bool = False,
    address: str | None = None,
    cpus_per_worker: float = 1.0,
    workdir: str | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Train ``train_args`` (loom train's: --config FILE, --section.field VALUE ...) on ``num_workers`` Ray actors,
    each with ``cpus_per_worker`` CPUs and, with ``gpus``, one GPU. ``address``: the cluster's (``auto``: the one
    ``ray start`` began on this machine; None: the one ``ray.init`` finds or starts; a Ray already initialised in
    this process is used as it is). ``env``: more variables for every rank. Returns the exit code: 0, 2 with one
    line for a user error (the ranks check the config as ``loom train``'s workers do; ``loom launch --ray`` checks
    it before this is called), 1 when the run stopped itself."""
    ray = require("ray", "ray", purpose="loom launch --ray")
    if num_workers < 1:
        raise ConfigError("--nproc", num_workers, "expected a positive integer (the job's ranks)")
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, log_to_driver=True)
    actors = []
    try:
        total = ray.cluster_resources()
        need = {"CPU": cpus_per_worker * num_workers, "GPU": float(num_workers if gpus else 0)}
        short = [f"{n} {k}s (it has {total.get(k, 0):g})" for k, n in need.items() if n > total.get(k, 0)]
        if short:
            raise UserError(
                f"loom launch --ray: {num_workers} workers need {' and '.join(short)} on this Ray cluster; "
                "lower --nproc or --cpus-per-worker, or add nodes"
            )
        actor = ray.remote(num_cpus=cpus_per_worker, num_gpus=1 if gpus else 0)(Rank)
        actors = [actor.remote() for _ in range(num_workers)]
        nodes, gpu_ids = zip(*ray.get([a.node.remote() for a in actors]))
        addr, port = ray.get(actors[0].address.remote())  # actor 0 is rank 0 (rank_envs)
        envs = rank_envs(list(nodes), addr, port, list(gpu_ids) if gpus else None)
        threads = max(1, int(cpus_per_worker))
        for e in envs:
            e.setdefault("OMP_NUM_THREADS", str(threads))
            e.update(env or {})
        here = os.path.abspath(workdir or os.getcwd())
        refs = [a.train.remote(e, list(train_args), here) for a, e in zip(actors, envs)]
        return _wait(ray, refs, envs)
    finally:
        for a in actors:
            ray.kill(a)  # a rank left waiting in a collective after a peer failed goes too
        if started:
            ray.shutdown()


def _wait(ray, refs: list, envs: list[dict[str, str]]) -> int:
    """The ranks' results as they come: the first rank that fails ends the job (its line printed, the others
    killed by the caller); a crash re-raises with the rank named."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        i = refs.index(done[0])
        try:
            code, line = ray.get(done[0])
        except ray.exceptions.RayError:
            print(f"loom launch --ray: rank {envs[i]['RANK']} failed:", file=sys.stderr, flush=True)
            raise
        if code:
            print(f"loom: {'error: ' if code == 2 else ''}{line}", file=sys.stderr, flush=True)
            return code
    return 0

"""ParallelDims: validates every parallel degree and builds every named mesh.

Mesh axes, outermost first: ``pp, dp_replicate, dp_shard, cp, tp``. Flattened axes:
``dp`` (dp_replicate x dp_shard: ranks that see different samples), ``dp_shard_cp``
(the FSDP shard axis) and ``dp_cp`` (ranks over which the loss is summed).

Expert parallelism borrows data-parallel ranks: ``ep`` consecutive ranks of ``dp_shard x cp`` (the FSDP
shard ranks; with cp > 1 the cp ranks of a sample come first) hold different experts and exchange tokens.
With ep > 1 a second mesh over the same ranks splits ``dp_shard x cp`` into ``edp x ep`` (``edp = dp_shard x
cp / ep``: the ranks that hold the same experts and shard them with FSDP2; ep stays the inner axis, as
FSDP2 needs for parameters that are already DTensors over it). Under tensor parallelism the ep ranks also
take in the tp ranks (torchtitan's etp = 1): ``ep`` is then a multiple of ``tp``, ``ep / tp`` ranks come from
``dp_shard x cp`` and each tp rank sends its own sequence slice's tokens (``edp = dp_shard x cp x tp / ep``).
With ``etp = tp`` the experts are tensor-parallel instead: each tp rank holds a 1/tp slice of every expert's
hidden width, the tp ranks gather their tokens before the experts and reduce-scatter the outputs, and the ep
ranks come from ``dp_shard x cp`` alone (the expert mesh keeps a tp axis: experts are DTensors over (ep, tp)).
Components receive the mesh they need from here; nothing reads a global group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.config.errors import ConfigError
from loom.config.sections import ParallelConfig

EXPERT_AXIS_ORDER = ("pp", "dp_replicate", "edp", "ep", "tp")
AXIS_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    world_size: int
    diloco: bool = False  # parallel.diloco_inner_steps > 0: the dp_replicate groups do not reduce gradients
    reshard_after_forward: bool = True  # FSDP2 frees a block's gathered parameters after its forward (ZeRO-3)
    shard_optimizer: bool = False  # ZeRO-1: DDP with each replica stepping only its part (loom.train.zero)
    _mesh: object = field(default=None, repr=False)
    _flat: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        cfg = zero_degrees(cfg, world_size)
        others = cfg.dp_replicate * cfg.tp * cfg.pp * cfg.cp
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % others:
                culprit = next(
                    (a for a in ("tp", "pp", "cp", "dp_replicate") if getattr(cfg, a) > 1), "dp_replicate"
                )
                raise ConfigError(
                    f"parallel.{culprit}",
                    getattr(cfg, culprit),
                    f"dp_replicate x tp x pp x cp = {others} must divide the world size {world_size}",
                )
            dp_shard = world_size // others
        if dp_shard == 0:
            raise ConfigError("parallel.dp_shard", dp_shard, "allowed: -1 (auto) or >= 1")
        product = others * dp_shard
        if product != world_size:
            raise ConfigError(
                "parallel.dp_shard",
                cfg.dp_shard,
                f"dp_replicate x dp_shard x tp x pp x cp = {product} must equal the world size {world_size}",
            )
        if cfg.etp not in (1, cfg.tp):
            raise ConfigError(
                "parallel.etp",
                cfg.etp,
                f"allowed 1 (experts replicated over tp, each tp rank routes its "
                f"own tokens) or parallel.tp = {cfg.tp} (experts sharded over tp)",
            )
        if cfg.ep > 1 and cfg.tp > 1 and cfg.etp == 1:
            if cfg.ep % cfg.tp or (dp_shard * cfg.cp) % (cfg.ep // cfg.tp):
                raise ConfigError(
                    "parallel.ep",
                    cfg.ep,
                    f"with parallel.tp = {cfg.tp} must be tp x a divisor of "
                    f"parallel.dp_shard x cp ({dp_shard} x {cfg.cp}): the expert-parallel ranks take "
                    "in the tp ranks",
                )
        elif (dp_shard * cfg.cp) % cfg.ep:
            raise ConfigError(
                "parallel.ep",
                cfg.ep,
                f"must divide parallel.dp_shard x cp ({dp_shard} x {cfg.cp}): "
                "expert-parallel ranks are data/context-parallel ranks that hold different experts",
            )
        dims = cls(
            cfg.dp_replicate,
            dp_shard,
            cfg.tp,
            cfg.pp,
            cfg.cp,
            cfg.ep,
            cfg.etp,
            world_size,
            diloco=cfg.diloco_inner_steps > 0,
            reshard_after_forward=cfg.reshard_after_forward,
            shard_optimizer=cfg.zero == 1,
        )
        if cfg.zero >= 2 and dims.dp_size > 1 and not dims.fsdp_enabled:
            raise ConfigError(
                "parallel.zero",
                cfg.zero,
                f"shards over parallel.dp_shard x cp, here 1 x 1 with "
                f"dp_replicate = {dims.dp_replicate}: set dp_shard (or leave it -1 with dp_replicate 1)",
            )
        return dims

    @property
    def zero(self) -> int:
        """The ZeRO stage over the data-parallel ranks this layout is (parallel.zero, or what dp_shard and
        reshard_after_forward make of it): 0 replicated, 1 optimizer state sharded, 2 gradients too (FSDP2 keeping
        parameters gathered from forward to backward), 3 parameters too."""
        if self.fsdp_enabled:
            return 3 if self.reshard_after_forward else 2
        return 1 if self.shard_optimizer else 0

    # ---- what is enabled -------------------------------------------------
    @property
    def dp_size(self) -> int:
        """Ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp_enabled and not self.diloco

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.fsdp_enabled and not self.diloco

    @property
    def replicate_reduces(self) -> bool:
        """Whether gradients are reduced over dp_replicate every step (not under DiLoCo: loom.train.diloco
        averages the groups' weights every H steps instead)."""
        return self.dp_replicate > 1 and not self.diloco

    @property
    def replicate_with_fsdp(self) -> bool:
        """Pure replication under TP or PP: DDP takes no DTensor parameters, and its reducer breaks when a
        pipeline runs several forwards (micro-batches, stages) before a backward. FSDP2 on a
        (dp_replicate, dp_shard = 1) mesh replicates instead: no sharding, gradients all-reduced."""
        return self.ddp_enabled and (self.tp_enabled or self.pp_enabled)

    @property
    def fsdp_applied(self) -> bool:
        """Whether FSDP2 wraps the model (sharding, or replicating TP parameters)."""
        return self.fsdp_enabled or self.replicate_with_fsdp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def ep_takes_tp(self) -> bool:
        """Whether the expert-parallel ranks include the tp ranks (ep and tp both > 1, experts not tensor-parallel)."""
        return self.ep > 1 and self.tp > 1 and self.etp == 1

    @property
    def etp_enabled(self) -> bool:
        """Experts sharded over the tp ranks (parallel.etp = tp > 1)."""
        return self.etp > 1

    @property
    def edp(self) -> int:
        """Ranks of dp_shard x cp that hold the same experts (they shard them with FSDP2)."""
        return self.dp_shard * self.cp * (self.tp if self.ep_takes_tp else 1) // self.ep

    @property
    def expert_grad_factor(self) -> float:
        """An expert's gradient sums the tokens of the ep ranks' samples (ep / tp of them when ep takes in tp:
        the tp ranks hold slices of the same samples) before FSDP2 averages it over edp; every other gradient is
        averaged over all data-parallel ranks. This factor gives expert gradients the same token-sum meaning
        (loom.parallel.expert_parallel)."""
        return (self.tp if self.ep_takes_tp else 1) / self.ep

    # ---- meshes ------------------------------------------------------------
    def build_mesh(self, device_type: str):
        """Build the world mesh and its flattened views (call once, after init_process_group)."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = [getattr(self, a) for a in AXIS_ORDER]
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=AXIS_ORDER)
        # flattened meshes are kept here: torch deprecates slicing them back out of the root mesh
        self._flat = {
            "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
            "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        }
        self._mesh = mesh
        if self.ep > 1:  # the same ranks in the same order, dp_shard x cp (x tp) split into edp x ep
            sizes = {"edp": self.edp, "tp": 1 if self.ep_takes_tp else self.tp}
            shape = [sizes.get(a) or getattr(self, a) for a in EXPERT_AXIS_ORDER]
            experts = init_device_mesh(device_type, tuple(shape), mesh_dim_names=EXPERT_AXIS_ORDER)
            self._flat["ep"] = experts["ep"]
            # the experts' own 2-D mesh: sharded over ep (which experts) and tp (their width)
            if self.etp > 1:
                self._flat["ep_tp"] = experts["ep", "tp"]
            self._flat["edp"] = experts["edp"]
            self._flat["experts_dp"] = (
                experts["dp_replicate", "edp"] if self.dp_replicate > 1 else experts["edp"]
            )
        return mesh

    @property
    def mesh(self):
        assert self._mesh is not None, "build_mesh() first"
        return self._mesh

    def __getitem__(self, axes):
        """A named axis (root or flattened) or a tuple of root axes. ``dp_shard_cp`` in a tuple is the
        root ``dp_shard`` axis while cp == 1 (2-D HSDP mesh without slicing a flattened axis)."""
        if isinstance(axes, str):
            return self._flat[axes] if axes in self._flat else self.mesh[axes]
        if self.cp == 1:
            axes = tuple("dp_shard" if a == "dp_shard_cp" else a for a in axes)
        return self.mesh[axes]

    def dp_rank(self) -> int:
        """This rank's coordinate on the flattened dp axis (0 without distribution)."""
        return self["dp"].get_local_rank() if self.distributed else 0

    def data_sum(self, t):
        """``t`` summed in place over the ranks that hold different tokens of a step (data x context parallel)."""
        if self.dp_size * self.cp > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self["dp_cp"].get_group())
        return t

    def cp_rank(self) -> int:
        return self["cp"].get_local_rank() if self.cp > 1 else 0

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def pp_rank(self) -> int:
        return self["pp"].get_local_rank() if self.pp > 1 else 0

    def describe(self) -> str:
        parts = [
            name
            for name, on in (
                ("PP", self.pp_enabled),
                ("CP", self.cp_enabled),
                ("TP", self.tp_enabled),
                ("EP", self.ep_enabled),
            )
            if on
        ]
        if self.diloco:  # groups along dp_replicate, each FSDP-sharded (or not) inside
            parts.append("DiLoCo" + ("(FSDP)" if self.fsdp_enabled else ""))
        elif self.dp_size > 1 or self.fsdp_enabled:  # FSDP shards over dp_shard x cp
            parts.append(
                "HSDP"
                if self.hsdp_enabled
                else "FSDP"
                if self.fsdp_enabled
                else "DDP(ZeRO-1)"
                if self.shard_optimizer
                else "DDP"
            )
        kind = "x".join(parts) or "single"
        degrees = ", ".join(
            f"{a}={getattr(self, a)}" for a in AXIS_ORDER + ("ep", "etp") if getattr(self, a) > 1
        )
        return f"{kind} (world {self.world_size}{': ' + degrees if degrees else ''})"


def zero_degrees(cfg: ParallelConfig, world_size: int) -> ParallelConfig:
    """``parallel.zero`` mapped onto the fields it stands for (the one place this happens; -1 leaves them):
    0 and 1 replicate over the data-parallel ranks (dp_shard 1, dp_replicate all of them unless given), 2 and 3
    shard over them with FSDP2 (dp_shard -1 unless given), keeping parameters gathered from forward to backward
    (2) or not (3). Fields that contradict the stage are refused."""
    from dataclasses import replace

    z = cfg.zero
    if z == -1:
        return cfg
    if z <= 1:
        if cfg.dp_shard not in (-1, 1):
            raise ConfigError(
                "parallel.dp_shard",
                cfg.dp_shard,
                f"parallel.zero = {z} replicates over the data-parallel "
                "ranks: allowed -1 or 1 (zero 2 or 3 shard with FSDP2)",
            )
        if cfg.cp > 1:
            raise ConfigError(
                "parallel.zero",
                z,
                "context parallelism shards with FSDP2 over dp_shard x cp: allowed "
                "2 or 3 with parallel.cp > 1",
            )
        others = cfg.tp * cfg.pp * cfg.cp
        replicate = cfg.dp_replicate
        if replicate == 1 and world_size % others == 0:
            replicate = world_size // others
        return replace(cfg, dp_shard=1, dp_replicate=replicate)
    return replace(cfg, reshard_after_forward=z == 3)


def tp_limit(args) -> int:
    """The largest tensor-parallel degree that divides the model's heads, KV heads, feed-forward width and vocabulary."""
    from math import gcd

    return gcd(gcd(args.n_heads, args.n_kv_heads), gcd(args.ffn_dim, args.vocab_size))

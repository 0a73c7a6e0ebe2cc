"""ParallelDims: validates every parallel degree and builds every named mesh.

Mesh axes, outermost first: ``pp, dp_replicate, dp_shard, cp, tp``. Flattened axes:
``dp`` (dp_replicate x dp_shard: ranks that see different samples), ``dp_shard_cp``
(the FSDP shard axis) and ``dp_cp`` (ranks over which the loss is summed).
Components receive the mesh they need from here; nothing reads a global group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.config.errors import ConfigError
from loom.config.sections import ParallelConfig

# Degrees whose code exists. Others are rejected by name instead of silently ignored.
IMPLEMENTED_AXES = ("dp_replicate", "dp_shard")
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
    _mesh: object = field(default=None, repr=False)
    _flat: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> "ParallelDims":
        for axis in ("tp", "pp", "cp", "ep", "etp"):
            degree = getattr(cfg, axis)
            if degree != 1 and axis not in IMPLEMENTED_AXES:
                raise ConfigError(f"parallel.{axis}", degree,
                                  "only 1 is supported in this version (not implemented yet)")
        others = cfg.dp_replicate * cfg.tp * cfg.pp * cfg.cp
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError("parallel.dp_replicate", cfg.dp_replicate,
                                  f"dp_replicate x tp x pp x cp = {others} must divide the world size {world_size}")
            dp_shard = world_size // others
        if dp_shard == 0:
            raise ConfigError("parallel.dp_shard", dp_shard, "allowed: -1 (auto) or >= 1")
        product = others * dp_shard
        if product != world_size:
            raise ConfigError("parallel.dp_shard", cfg.dp_shard,
                              f"dp_replicate x dp_shard x tp x pp x cp = {product} must equal the world size "
                              f"{world_size}")
        return cls(cfg.dp_replicate, dp_shard, cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.etp, world_size)

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
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.fsdp_enabled

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

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

    def describe(self) -> str:
        kind = "single" if not self.distributed else (
            "HSDP" if self.hsdp_enabled else "FSDP" if self.fsdp_enabled else "DDP")
        degrees = ", ".join(f"{a}={getattr(self, a)}" for a in AXIS_ORDER if getattr(self, a) > 1)
        return f"{kind} (world {self.world_size}{': ' + degrees if degrees else ''})"

"""AdamW on fp32 master weights; fused or foreach kernels when the device supports them."""

from __future__ import annotations

import torch
from torch import nn

from loom.config.sections import OptimizerConfig
from loom.kernels.adamw.op import SMALL, adamw_multi_step_, adamw_step_
from loom.kernels.triton_support import has_triton
from loom.parallel.shards import local_tensor
from loom.train.grads import by_mesh, scale_grads, unique_params
from loom.train.large_batch import build_large_batch


def resolve_implementation(impl: str, device: torch.device, offload: bool = False) -> str:
    """``auto``: loom's Triton kernel on CUDA (measured faster than PyTorch's fused AdamW on H100,
    bench/results/optimizer_1b_h100.json), PyTorch's foreach kernels elsewhere; for state offloaded to the host
    (parallel.cpu_offload) PyTorch's fused CPU kernel, vectorized and multi-threaded (the host step is the
    offloaded run's slowest part: bench/offload.py). Triton's kernel runs on CUDA tensors only: on host tensors
    ``loom::adamw_step_`` runs its PyTorch reference."""
    if impl != "auto":
        return impl
    if offload:
        return "fused"
    if device.type == "cuda":
        return "triton" if has_triton() else "fused"
    return "foreach"


_HYPER = ("lr", "beta1", "beta2", "eps", "weight_decay", "step")  # the kernels' keyword arguments, in order


class TritonAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (same hyperparameters, same state and state dict: ``step``, ``exp_avg``,
    ``exp_avg_sq``) stepping each tensor with loom's one-pass kernel (``loom::adamw_step_``: Triton on
    CUDA, the reference elsewhere). ``step(grad_factor=t)`` multiplies the gradients by the one-element
    tensor ``t`` inside the kernel (clipping without a pass over the gradients, nor a host sync).
    Sharded (DTensor) parameters are stepped on their local shards."""

    def __init__(
        self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2
    ):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self._amax_slot: dict[int, int] = {}  # id(param) -> its slot in ``amax`` (``track_amax``)
        self._amax_params: list = []
        self._amax_versions: list[int] = []  # the tracked shards' version counters after the last step
        self.amax: torch.Tensor | None = None
        self.amax_fresh = False  # ``amax`` holds the last step's figures, not yet taken

    def track_amax(self, params: list) -> None:
        """From the next step on, each step also writes the largest |value| of each of ``params``' local shards
        after it into ``amax`` (in this order), in its own pass over them: float8's weight scales need these
        (loom.train.precision.Float8Scales), which would otherwise read every weight again."""
        self._amax_slot = {id(p): i for i, p in enumerate(params)}
        self._amax_params = list(params)
        self.amax = torch.zeros(len(params), device=local_tensor(params[0]).device) if params else None

    def amax_current(self) -> bool:
        """Whether ``amax`` holds the last step's figures, not yet taken, and no tracked shard has changed in place
        since (e.g. DiLoCo's outer step after the inner one)."""
        return self.amax_fresh and self._amax_versions == [
            local_tensor(p)._version for p in self._amax_params
        ]

    @torch.no_grad()
    def step(self, closure=None, grad_factor: torch.Tensor | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        factors: dict = {}  # once per device (offloaded shards on the host, the factor on the GPU)
        small: dict = {}  # tensors under SMALL elements, by device, gradient dtype and hyperparameters: one launch each
        if self.amax is not None:
            self.amax.zero_()
        for group in self.param_groups:
            for p in group["params"]:  # a tracked tensor without a gradient keeps its values: their amax
                slot = self._amax_slot.get(id(p))
                if p.grad is None and slot is not None and local_tensor(p).numel():
                    self.amax[slot] = local_tensor(p).abs().max()
            live = [p for p in group["params"] if p.grad is not None]
            if not live:
                continue
            states = [self._state_of(p) for p in live]
            steps = [state["step"] for state in states]
            torch._foreach_add_(steps, 1.0)  # one call for the group's counts (on the host: never a sync)
            beta1, beta2 = group["betas"]
            base = (float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"])
            for p, state, count in zip(live, states, [s.item() for s in steps]):
                local = local_tensor(p)
                tensors = (
                    local,
                    local_tensor(_like_param(p.grad, p)),
                    local_tensor(state["exp_avg"]),
                    local_tensor(state["exp_avg_sq"]),
                )
                factor = None
                if grad_factor is not None:
                    factor = factors.get(local.device)
                    if factor is None:
                        factor = factors[local.device] = torch.as_tensor(
                            grad_factor, dtype=torch.float32, device=local.device
                        ).reshape(1)
                hyper = (*base, int(count))
                slot = self._amax_slot.get(id(p))
                if local.numel() >= SMALL or slot is not None:
                    amax = None if slot is None else self.amax[slot : slot + 1]
                    adamw_step_(*tensors, **dict(zip(_HYPER, hyper)), grad_factor=factor, amax=amax)
                    continue
                _, lists = small.setdefault(
                    (local.device, tensors[1].dtype, hyper), (factor, ([], [], [], []))
                )
                for kept, t in zip(lists, tensors):
                    kept.append(t)
        for (_, _, hyper), (factor, lists) in small.items():
            adamw_multi_step_(*lists, **dict(zip(_HYPER, hyper)), grad_factor=factor)
        self.amax_fresh = self.amax is not None
        self._amax_versions = [local_tensor(p)._version for p in self._amax_params]
        return loss

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:  # as torch's AdamW initializes it (step on the host: reading it never syncs)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device.type != "cpu":  # loaded from a fused/capturable run: once per tensor
            state["step"] = state["step"].cpu()
        return state


def _like_param(grad: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The gradient in its parameter's layout. Under TP a gradient can come back otherwise: Partial for
    sequence-parallel norm weights (a pending sum over tp), Replicate for a vocab-sharded weight; a
    DTensor op would redistribute implicitly, a kernel on local shards must do it here."""
    if hasattr(p, "placements") and tuple(grad.placements) != tuple(p.placements):
        return grad.redistribute(p.device_mesh, p.placements)
    return grad


def build_optimizer(
    model: nn.Module,
    cfg: OptimizerConfig,
    device: torch.device,
    offload: bool = False,
    keeps=None,
    folder=None,
) -> torch.optim.Optimizer:
    """``optimizer.name``: AdamW, or LAMB / LARS (loom.train.large_batch). Weight decay on matrices only
    (not norms; for LAMB / LARS unless ``exclude_1d`` is off); only trainable parameters (with LoRA: the
    adapters) get a place and state. PyTorch's fused and foreach kernels take the tensors of a group together,
    which DTensors on different meshes (experts under expert parallelism) cannot be: there its per-tensor AdamW
    runs instead (loom's Triton AdamW is per tensor anyway). ``offload``: the state lives on the host
    (parallel.cpu_offload; ``device`` is then the CPU). ``keeps``: which parameters this rank steps (ZeRO-1:
    loom.train.zero); None = all. ``folder`` (optimizer.offload nvme): the ``loom.train.nvme_offload.StateFolder``
    whose files hold the AdamW moments."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad and (keeps is None or keeps(p)):
            (decay if p.ndim >= 2 else no_decay).append(p)
    # an empty group (LoRA trains matrices only) would break the checkpoint's flattened optimizer state
    if cfg.name != "adamw" and not cfg.exclude_1d:  # lamb / lars: every parameter decays and adapts
        decay, no_decay = decay + no_decay, []
    groups = [
        g
        for g in (
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        )
        if g["params"]
    ] or [{"params": decay}]
    if cfg.name != "adamw":
        return build_large_batch(cfg.name, groups, cfg)
    impl = resolve_implementation(cfg.implementation, device, offload)
    if folder is not None:
        from loom.train.nvme_offload import NvmeAdamW

        kernel = "fused" if impl == "triton" else impl  # each chunk through PyTorch's kernels
        if len(by_mesh(decay + no_decay)) > 1:
            kernel = "for_loop"
        chunk = int(cfg.offload_chunk_mb * 2**20) // 4
        return NvmeAdamW(groups, folder, chunk, kernel, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if impl == "triton":
        return TritonAdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if len(by_mesh(decay + no_decay)) > 1:
        impl = "single"
    flags = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **flags)
    opt.register_load_state_dict_post_hook(_keep_implementation)
    return opt


def _keep_implementation(opt: torch.optim.Optimizer) -> None:
    """After a checkpoint is loaded: the kernel is this run's choice (optimizer.implementation, the device, offload),
    not the saved run's, whose param groups bring back their ``fused`` / ``foreach`` flags."""
    for group in opt.param_groups:
        for key in ("fused", "foreach"):
            group[key] = opt.defaults.get(key)


class OptimizerParts:
    """One optimizer per model part (pipeline stages, or the one whole model), stepped together. Each part's
    state dict is keyed by that part's parameter names, so parts of any layout merge into one checkpoint.
    ``offload``: the parameters and their state live on the host (parallel.cpu_offload). ``shard`` (ZeRO-1,
    loom.train.zero.OptimizerShard): this rank steps its own parameters only, then the owners broadcast them."""

    def __init__(
        self,
        parts: list[nn.Module],
        cfg: OptimizerConfig,
        device: torch.device,
        offload: bool = False,
        shard=None,
        state_root: str = ".",
        rank: int = 0,
    ):
        self.parts = parts
        self.shard = shard
        self._amax_of: dict = {}  # id(param) -> (its optimizer, its slot there): ``track_amax``
        keeps = shard.keeps if shard is not None else None
        self.all_params = unique_params(parts)
        self.params = [p for p in self.all_params if keeps is None or keeps(p)]  # those this rank steps
        self.folder = None
        if cfg.offload == "nvme":  # optimizer.offload: the moments in files of this rank's own folder
            from loom.train.nvme_offload import StateFolder, moment_bytes

            held = [p for p in self.params if p.requires_grad]
            self.folder = StateFolder(cfg.offload_path or state_root, moment_bytes(held), rank)
        self.optimizers = [build_optimizer(part, cfg, device, offload, keeps, self.folder) for part in parts]
        n_held = sum(len(g["params"]) for opt in self.optimizers for g in opt.param_groups)
        # the fused kernels can multiply the gradients themselves (their ``grad_scale`` input, which
        # they divide by, as GradScaler uses it): no separate pass over the gradients. Only when no
        # parameter sits in two optimizers (each kernel rescales its gradients in place).
        self.fold_grad_factor = n_held == len(self.params) and all(
            isinstance(opt, TritonAdamW) or opt.defaults.get("fused") for opt in self.optimizers
        )

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizers[0].param_groups

    @property
    def skips_on_device(self) -> bool:
        """Whether ``step(finite=...)`` can skip an update on the device, without a host sync: loom's Triton
        AdamW (a non-finite gradient factor) and PyTorch's fused AdamW (``found_inf``), factor folded in."""
        return self.fold_grad_factor

    def track_amax(self, params: list) -> bool:
        """Each part's optimizer writes the largest |value| of ``params``' local shards after every step
        (``TritonAdamW.track_amax``); false (nothing tracked) unless loom's AdamW steps every one of them."""
        held = [
            {id(p) for g in opt.param_groups for p in g["params"]} if isinstance(opt, TritonAdamW) else set()
            for opt in self.optimizers
        ]
        self._amax_of = {}
        if not all(any(id(p) in h for h in held) for p in params):
            return False
        for opt, h in zip(self.optimizers, held):
            mine = [p for p in params if id(p) in h and id(p) not in self._amax_of]
            if mine:
                opt.track_amax(mine)
                self._amax_of.update({id(p): (opt, i) for i, p in enumerate(mine)})
        return True

    def amax_of(self, params: list) -> torch.Tensor:
        """The amax of each of ``params`` (tracked) as their optimizers hold it now."""
        where = [self._amax_of[id(p)] for p in params]
        (opt, first), *_ = where
        if all(o is opt and slot == first + i for i, (o, slot) in enumerate(where)):
            return opt.amax[
                first : first + len(where)
            ]  # consecutive slots of one optimizer: a view, no copies
        return torch.stack([o.amax[slot] for o, slot in where])

    def take_amax(self, params: list) -> torch.Tensor | None:
        """The amax of each of ``params`` (tracked) that the last step wrote, once (None: no step has since the
        last take, e.g. one the host skipped)."""
        of = self._amax_of
        if not params or not all(id(p) in of for p in params):
            return None
        opts = {id(opt): opt for opt, _ in of.values()}.values()
        current = all([opt.amax_current() for opt in opts])
        for opt in opts:
            opt.amax_fresh = False
        if not current:
            return None
        return self.amax_of(params)

    def unstep(self) -> None:
        """Take back the step counts of an update the device skipped (PyTorch's fused AdamW does it itself)."""
        for opt in self.optimizers:
            if isinstance(opt, TritonAdamW):
                for state in opt.state.values():
                    state["step"] -= 1

    def step(
        self, grad_factor: float | torch.Tensor | None = None, finite: torch.Tensor | None = None
    ) -> None:
        """Step every part; ``grad_factor`` (clipping, loss-scale removal) multiplies the gradients first.
        ``finite`` (a one-element bool device tensor, only where ``skips_on_device``): false skips the update
        on the device; the caller takes back host counts with ``unstep`` once it reads the flag."""
        if finite is not None:
            assert self.skips_on_device, "finite= needs loom's Triton or PyTorch's fused AdamW"
            skip = finite.to(
                torch.float32
            ).reciprocal()  # 1, or inf: a factor that is not finite skips the update
            # (no host value reaches the device: no sync)
            factor = skip if grad_factor is None else grad_factor * skip
            for opt in self.optimizers:
                if not isinstance(opt, TritonAdamW):  # on the parameters' device (the host under cpu_offload)
                    opt.found_inf = (~finite).to(torch.float32).to(opt.param_groups[0]["params"][0].device)
            try:
                self._step_folded(factor)
            finally:
                for opt in self.optimizers:
                    opt.__dict__.pop("found_inf", None)
        elif grad_factor is None:
            for opt in self.optimizers:
                opt.step()
        elif not self.fold_grad_factor:
            scale_grads(self.params, grad_factor)
            for opt in self.optimizers:
                opt.step()
        else:
            self._step_folded(grad_factor)
        if self.shard is not None:  # ZeRO-1: a skipped update broadcasts the unchanged parameters
            self.shard.broadcast()

    def _step_folded(self, grad_factor) -> None:
        """Each kernel multiplies the gradients by ``grad_factor`` itself (a NaN factor: the fused AdamW's
        ``found_inf`` is set too, and it skips; loom's Triton kernel skips on its own)."""
        for opt in self.optimizers:
            if isinstance(opt, TritonAdamW):
                opt.step(grad_factor=grad_factor)
                continue
            device = opt.param_groups[0]["params"][0].device
            opt.grad_scale = 1.0 / torch.as_tensor(grad_factor, dtype=torch.float32, device=device)
            try:
                opt.step()
            finally:
                opt.grad_scale = None

    def close(self) -> None:
        """optimizer.offload nvme: finish the file writes and remove this rank's files (nothing else)."""
        for opt in self.optimizers:
            if hasattr(opt, "folder"):
                opt.close()
        if self.folder is not None:
            self.folder.close()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)
        # ZeRO-1: the gradients of parameters other replicas step (DDP fills them all)
        if self.shard is not None:
            held = {id(p) for p in self.params}
            for p in self.all_params:
                if id(p) not in held and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()

"""NVMe offload of the optimizer state (optimizer.offload = nvme; DeepSpeed's ZeRO-Infinity offloads it the same way):
the two AdamW moments of every parameter live in memory-mapped files on a local disk, not in host or device memory.

A step walks the parameters in chunks: a thread reads the next chunk of both moments from the files into one of two
staging buffers (pinned on CUDA) while the current chunk is stepped (on the parameters' device: copied there and
back on CUDA, in the staging buffer on the host), and writes each stepped chunk back to the files while the next is
computed; the step returns once every write is done (a checkpoint then reads complete moments). The math of each
chunk is PyTorch's own AdamW (``torch.optim.adam.adam``, decoupled weight decay) with the kernel the run would use
without offload (foreach on the CPU, fused on CUDA), so the values equal the run's without offload. The optimizer's
state dict is AdamW's (``step``, ``exp_avg``, ``exp_avg_sq``; the moments are the file-backed tensors, DTensors
around them for sharded parameters), so distributed checkpoints save and load it as usual; a loaded state is
copied into the files.

Files: each rank makes its own temporary folder (``loom-optimizer-*``) in optimizer.offload_path (the run directory
when empty) and removes exactly the files it made, and the folder, at the end of the run; nothing else there is
touched. A killed run leaves its folder behind (a later run never reads it: the state comes from the checkpoint).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch.optim.adam import adam

from loom.config.errors import ConfigError
from loom.parallel.shards import local_tensor

FIELD = "optimizer.offload_path"
PREFIX = "loom-optimizer-"


class StateFolder:
    """This rank's temporary folder of moment files in ``root``: checked for room (``need`` bytes) and writability at
    creation; ``close`` removes the files it made, then the folder if nothing else is in it."""

    def __init__(self, root: str, need: int, rank: int = 0):
        if not os.path.isdir(root):
            raise ConfigError(FIELD, root, "is not a folder: name an existing folder on a local disk")
        if not os.access(root, os.W_OK | os.X_OK):
            raise ConfigError(FIELD, root, "is not writable: name a folder this user can write")
        free = shutil.disk_usage(root).free
        if free < need:
            raise ConfigError(
                FIELD,
                root,
                f"has {free / 2**30:,.2f} GiB free and this rank's AdamW moments need {need / 2**30:,.2f} GiB: "
                "free space there or name another folder",
            )
        try:
            self.path = tempfile.mkdtemp(prefix=f"{PREFIX}rank{rank}-", dir=root)
        except OSError as err:
            raise ConfigError(FIELD, root, f"cannot hold loom's folder ({err.strerror})") from None
        self.files: list[str] = []

    def tensor(self, name: str, numel: int) -> torch.Tensor:
        """A float32 tensor of ``numel`` zeros backed by a new file of this folder (written through to it)."""
        path = os.path.join(self.path, f"{len(self.files)}.{name}")
        self.files.append(path)
        mapped = np.memmap(path, dtype=np.float32, mode="w+", shape=(max(numel, 1),))
        return torch.from_numpy(mapped)[:numel]

    def close(self) -> None:
        """Remove the files this folder made, then the folder if it is empty (never anything else)."""
        for path in self.files:
            if os.path.isfile(path):
                os.remove(path)
        self.files = []
        if os.path.isdir(self.path) and not os.listdir(self.path):
            os.rmdir(self.path)


def _like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local`` (the shard's moments) as ``p`` is: a DTensor of the same mesh, placements and global shape for a
    sharded parameter (checkpoints reshard it), the tensor itself otherwise."""
    if not hasattr(p, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


class NvmeAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (same hyperparameters and state dict) whose moments live in ``folder``'s files, stepped
    ``chunk`` elements at a time. ``kernel``: PyTorch's implementation each chunk runs (``foreach``, ``fused`` or
    ``for_loop``); the run's ``optimizer.implementation`` without offload."""

    def __init__(self, params, folder: StateFolder, chunk: int, kernel: str, **hyper):
        super().__init__(params, foreach=False, **hyper)
        self.folder, self.chunk, self.kernel = folder, max(int(chunk), 1), kernel
        self._files: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> its two file tensors
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-nvme")
        self._staging: list[torch.Tensor] | None = None
        self.register_load_state_dict_post_hook(NvmeAdamW._into_files)

    # ------------------------------------------------------------------------------------------------- state
    def _file_pair(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if id(p) not in self._files:
            local = local_tensor(p)
            pair = tuple(
                self.folder.tensor(k, local.numel()).view(local.shape) for k in ("exp_avg", "exp_avg_sq")
            )
            self._files[id(p)] = pair
        return self._files[id(p)]

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            m, v = self._file_pair(p)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"], state["exp_avg_sq"] = _like(m, p), _like(v, p)
        return state

    @staticmethod
    def _into_files(opt: NvmeAdamW) -> None:
        """After ``load_state_dict``: each loaded moment copied into its file (the loaded tensor may be a new one)."""
        for group in opt.param_groups:
            group["foreach"], group["fused"] = False, None
            for p in group["params"]:
                state = opt.state.get(p)
                if not state or "exp_avg" not in state:
                    continue
                m, v = opt._file_pair(p)
                for key, file in (("exp_avg", m), ("exp_avg_sq", v)):
                    loaded = local_tensor(state[key])
                    if loaded.data_ptr() != file.data_ptr():
                        file.copy_(loaded)
                    state[key] = _like(file, p)
                state["step"] = state["step"].detach().to("cpu", torch.float32, copy=True)  # its own

    # -------------------------------------------------------------------------------------------------- step
    def _buffers(self, device: torch.device) -> list[torch.Tensor]:
        """Two staging buffers, each a chunk of both moments (pinned where the step runs on CUDA)."""
        if self._staging is None:
            pin = device.type == "cuda"
            self._staging = [
                torch.empty(2, self.chunk, dtype=torch.float32, pin_memory=pin) for _ in range(2)
            ]
        return self._staging

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        chunks = []  # (group, p, grad, m file, v file, start, end, the step count before this step)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state_of(p)
                m, v = (local_tensor(state[k]).reshape(-1) for k in ("exp_avg", "exp_avg_sq"))
                grad = p.grad
                if hasattr(p, "placements") and tuple(grad.placements) != tuple(p.placements):
                    grad = grad.redistribute(p.device_mesh, p.placements)
                param, grad = local_tensor(p), local_tensor(grad)
                before = state["step"].clone()
                state["step"] += 1
                for start in range(0, param.numel(), self.chunk):
                    end = min(start + self.chunk, param.numel())
                    chunks.append((group, param, grad, m, v, start, end, before))
        if chunks:
            self._run(chunks)
        return loss

    def _run(self, chunks: list) -> None:
        """Read chunk i+1 and write chunk i-1 on the IO thread while chunk i is stepped (FIFO: a buffer is read
        into only after its last write is done)."""
        device = local_tensor(chunks[0][1]).device
        buffers = self._buffers(device)

        def read(i: int) -> None:
            _, _, _, m, v, start, end, _ = chunks[i]
            buf = buffers[i % 2]
            buf[0, : end - start].copy_(m[start:end])
            buf[1, : end - start].copy_(v[start:end])

        def write(i: int) -> None:
            _, _, _, m, v, start, end, _ = chunks[i]
            buf = buffers[i % 2]
            m[start:end].copy_(buf[0, : end - start])
            v[start:end].copy_(buf[1, : end - start])

        pending = self._io.submit(read, 0)
        writes = []
        for i, (group, param, grad, _, _, start, end, before) in enumerate(chunks):
            pending.result()
            if i + 1 < len(chunks):
                pending = self._io.submit(read, i + 1)
            self._step_chunk(group, param, grad, buffers[i % 2], start, end, before)
            writes.append(self._io.submit(write, i))
        for w in writes:
            w.result()

    def _step_chunk(self, group, param, grad, buf, start: int, end: int, before: torch.Tensor) -> None:
        n = end - start
        p, g = param.view(-1)[start:end], grad.reshape(-1)[start:end]
        m, v = buf[0, :n], buf[1, :n]
        cuda = p.device.type == "cuda"
        if cuda:
            m, v = m.to(p.device, non_blocking=True), v.to(p.device, non_blocking=True)
        fused = self.kernel == "fused"
        step = before.clone().to(p.device) if fused else before.clone()
        beta1, beta2 = group["betas"]
        adam(
            [p],
            [g],
            [m],
            [v],
            [],
            [step],
            foreach=self.kernel == "foreach",
            fused=fused or None,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        if cuda:
            buf[0, :n].copy_(m, non_blocking=True)
            buf[1, :n].copy_(v, non_blocking=True)
            torch.cuda.current_stream(
                p.device
            ).synchronize()  # the buffer holds the chunk before it is written

    def close(self) -> None:
        """Finish the IO thread and remove this rank's files (the state stays readable in this process)."""
        self._io.shutdown(wait=True)
        self.folder.close()


def moment_bytes(params) -> int:
    """Bytes of the two float32 AdamW moments of ``params`` (this rank's shards)."""
    return 8 * sum(local_tensor(p).numel() for p in params)

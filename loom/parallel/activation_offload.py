"""Activation offload (training.activation_offload): the tensors a selected transformer block saves for backward wait
in host memory instead of on the device.

Each selected block's forward runs under ``torch.autograd.graph.saved_tensors_hooks`` (the pattern of
``torch.autograd.graph.save_on_cpu``): a saved tensor is copied into a pinned host buffer on a side CUDA stream (the
block's compute goes on; the device memory returns to the allocator once the copy is done, ``record_stream``), and
during backward the first read of a block's tensors also starts copying back the block that ran before it (its
backward is next), on the side stream, so the copy overlaps this block's backward. A tensor not yet back is copied
when autograd asks for it. A block's forward starts once the copies of the block two back are done (a wait on the
device), so at most two blocks' tensors are on the device at a time.

What is offloaded: every saved tensor of a plain device tensor type except the block's own parameters and buffers
(under FSDP2 the gathered weights, gathered again for backward anyway). Tensor subclasses (the DTensors of tensor
parallelism, float8 tensors) stay on the device. With activation checkpointing the hooks wrap the checkpoint from
outside: a recomputed block (full, every_k's checkpointed blocks, op, matmuls) saves only its input through them, so that
input waits on the host and the recomputation reads it back; what the recomputation saves lives only during that
block's backward, and op-level checkpointing's saved matmul / attention outputs (kept by its own cache, not by
saved-tensor hooks) stay on the device. On the CPU the hooks still pack and unpack through a copy (no streams), so
a CPU run checks the bookkeeping: its losses equal the run without offload.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from loom.parallel.offload_rules import offloaded_blocks
from loom.parallel.shards import local_tensor


class _Saved:
    """One packed tensor: its host copy, the device copy a prefetch brought back (until autograd has read it as
    often as it was saved: ``uses``), and the events that order the copies."""

    __slots__ = ("host", "back", "d2h", "h2d", "block", "uses", "__weakref__")

    def __init__(self, host: torch.Tensor, d2h, block: _BlockRecord):
        self.host, self.back, self.d2h, self.h2d, self.block, self.uses = host, None, d2h, None, block, 1


class _BlockRecord:
    """The tensors one forward of one block packed, and the block that ran before it in the same model forward
    (its backward comes next: prefetched when this block's backward starts)."""

    __slots__ = ("saved", "seen", "storages", "copied", "before", "started", "skip", "__weakref__")

    def __init__(self, before: _BlockRecord | None, skip: set[int]):
        self.saved: list[weakref.ref] = []
        # a tensor saved again (the input of q, k and v; of gate and up) is copied once: its view's key -> the
        # tensor (held until the block's forward ends, so its memory cannot be another tensor's) and its copy
        self.seen: dict[tuple, tuple[torch.Tensor, weakref.ref]] = {}
        self.storages: set[int] = set()  # the memory those tensors keep alive, counted once (resident_bytes)
        self.copied = (
            None  # the event after this block's last copy to the host (the side stream runs in order)
        )
        self.before = weakref.ref(before) if before is not None else None
        self.started = False
        self.skip = skip


class ActivationOffload:
    """Saved-tensor hooks for the selected blocks of one model part. ``device``: where the model computes; on CUDA
    the copies run on one side stream shared by the part's blocks. ``packed_bytes`` counts what went to the host;
    ``resident_bytes`` the device memory the same tensors would have kept alive until backward without offload
    (each storage once: views of one tensor saved by several ops share it). The tests and benches read both."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.last: _BlockRecord | None = None  # the previous offloaded block of the running model forward
        self.packed_bytes = 0
        self.resident_bytes = 0
        self._active: list = []

    # ---------------------------------------------------------------------------------------------- module hooks
    def attach(self, model: nn.Module, blocks: dict[str, nn.Module]) -> None:
        """Hooks on ``model`` (each forward starts a new chain of blocks) and on each block in ``blocks`` (its
        forward runs under the saved-tensor hooks; exited on an exception too)."""
        model.register_forward_pre_hook(self._model_starts)
        for block in blocks.values():
            block.register_forward_pre_hook(self._enter)
            block.register_forward_hook(self._exit, always_call=True)

    def _model_starts(self, module, args) -> None:
        self.last = None

    def _enter(self, block: nn.Module, args) -> None:
        if not torch.is_grad_enabled():
            self._active.append(None)
            return
        skip = {_storage(t) for t in _own_tensors(block)}
        self._bound_in_flight()
        record = _BlockRecord(self.last, skip)
        self.last = record
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t, r=record: self._pack(t, r), self._unpack)
        hooks.__enter__()
        self._active.append((hooks, record))

    def _bound_in_flight(self) -> None:
        """Before a block's forward, the device waits (on the GPU, not the host) until the copies of the offloaded
        block two back have reached the host, so at most two blocks' saved tensors are on the device whatever the
        copies' speed: over PCIe they are slower than the compute, and unbounded they fell behind, leaving most
        blocks' tensors on the device when the forward ended (torchtune's OffloadActivations bounds its stash for
        the same reason). The cost: a forward no faster than its copies, which bound an offloaded step anyway."""
        before = self.last.before() if self.last is not None and self.last.before is not None else None
        if self.cuda and before is not None and before.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(before.copied)

    def _exit(self, block: nn.Module, args, output) -> None:
        entered = self._active.pop()
        if entered is not None:
            hooks, record = entered
            hooks.__exit__(None, None, None)
            record.seen.clear()
            record.storages.clear()

    # ---------------------------------------------------------------------------------------------- pack / unpack
    def _keeps(self, t: torch.Tensor, record: _BlockRecord) -> bool:
        """Tensors that stay where they are: subclasses, those already on the host of a GPU run, empty ones, and
        the block's own parameters and buffers (and views of them)."""
        if type(t) is not torch.Tensor:  # nn.Parameter among them
            return True
        if t.numel() == 0 or (self.cuda and t.device.type != "cuda"):
            return True
        return t.untyped_storage().data_ptr() in record.skip

    def _pack(self, t: torch.Tensor, record: _BlockRecord):
        if self._keeps(t, record):
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
        _, packed = record.seen.get(key, (None, None))
        saved = packed() if packed is not None else None
        if saved is not None:
            saved.uses += 1
            return saved
        self.packed_bytes += t.numel() * t.element_size()
        if key[0] not in record.storages:
            record.storages.add(key[0])
            self.resident_bytes += t.untyped_storage().nbytes()
        if not self.cuda:  # the bookkeeping alone: a copy in its own memory
            saved = _Saved(t.detach().clone(), None, record)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host = torch.empty_like(t, device="cpu", pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # its memory is reused only after the copy
                done = torch.cuda.Event()
                done.record(self.stream)
            record.copied = done
            saved = _Saved(host, done, record)
        record.saved.append(weakref.ref(saved))
        record.seen[key] = (t, weakref.ref(saved))
        return saved

    def _unpack(self, saved) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        record = saved.block
        if not record.started:
            record.started = True
            before = record.before() if record.before is not None else None
            if before is not None and not before.started:
                self._prefetch(before)
        if not self.cuda:
            return saved.host
        current = torch.cuda.current_stream(self.device)
        if saved.back is not None:  # prefetched
            current.wait_event(saved.h2d)
            out = saved.back
            out.record_stream(current)  # allocated on the side stream, freed after this stream's use
            saved.uses -= 1
            if saved.uses <= 0:
                saved.back = None
            return out
        current.wait_event(saved.d2h)
        return saved.host.to(self.device, non_blocking=True)

    def _prefetch(self, record: _BlockRecord) -> None:
        """Copy ``record``'s tensors back on the side stream (CUDA only), each ready at its event."""
        if not self.cuda:
            return
        with torch.cuda.stream(self.stream):
            for ref in record.saved:
                saved = ref()
                if saved is None or saved.back is not None:
                    continue
                self.stream.wait_event(saved.d2h)
                saved.back = saved.host.to(self.device, non_blocking=True)
                saved.h2d = torch.cuda.Event()
                saved.h2d.record(self.stream)


def _own_tensors(block: nn.Module):
    yield from block.parameters()
    yield from block.buffers()


def _storage(t: torch.Tensor) -> int | None:
    """Where ``t``'s memory starts (a DTensor's local shard's); None for a tensor whose storage cannot be read
    (other subclasses: QLoRA's NF4 weights)."""
    local = local_tensor(t)
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def apply_activation_offload(model: nn.Module, spec: str, device: torch.device) -> ActivationOffload | None:
    """Offload the saved activations of the blocks ``spec`` selects among ``model.layers`` (called after activation
    checkpointing, so the hooks wrap a checkpointed block from outside); None when none is selected. Under a
    pipeline split the indices are the whole model's (a stage offloads those of its blocks it holds)."""
    n_layers = model.args.n_layers if hasattr(model, "args") else len(model.layers)
    picked = {str(i) for i in offloaded_blocks(spec, n_layers)}
    blocks = {name: block for name, block in model.layers.items() if name in picked}
    if not blocks:
        return None
    offload = ActivationOffload(device)
    offload.attach(model, blocks)
    model.activation_offload = offload  # read by the run's tests and the memory report
    return offload

"""Reading a Hugging Face folder's safetensors (one file, or shards with an index) into a loom model, plain or
sharded (FSDP2/HSDP/TP, a pipeline stage): ``safe_open(...).get_slice(name)[rows]``, so every rank reads only the
region of each tensor its parameter holds, with no collectives (DCP plans a load across all ranks together; this
reader can also fill an untied head from tied embeddings, and names a missing, unexpected or misshapen tensor in
one line). An imported loom checkpoint (``loom convert --from-hf``) loads through DCP instead."""

from __future__ import annotations

import contextlib
import json
import os

import torch

from loom.checkpoint.hf.config import (
    INDEX,
    SINGLE,
    is_loom_checkpoint,
    llama_args_from_hf_config,
    read_hf_config,
)
from loom.checkpoint.hf.head import SCORE_WEIGHT, has_score_head
from loom.checkpoint.hf.names import hf_expert_names, hf_name, ignorable, stacked_experts
from loom.checkpoint.manager import load_model_weights, verify
from loom.config.errors import ConfigError, UserError, require
from loom.models.common.init import canonical_name
from loom.models.llama.flavors import LlamaArgs
from loom.models.registry import hf_adapter
from loom.parallel.shards import local_tensor


def llama_args_from_hf(folder: str, field: str = "model.init_from") -> LlamaArgs:
    """The loom shape of a Hugging Face folder of a registered family (from its config.json; a family's optional
    modules as far as the weights hold them: ``fit``)."""
    args = llama_args_from_hf_config(read_hf_config(folder, field), field, folder)
    adapter = hf_adapter(args)
    if not adapter.optional_modules or is_loom_checkpoint(
        folder
    ):  # an import's config copy says what it holds
        return args
    try:
        names = set(weight_files(folder))
    except (
        UserError
    ):  # no weights to look at (a config alone): the config's word; loading says what is missing
        return args
    return adapter.fit(args, lambda name: hf_name(name, args) in names)


def open_weights(path: str):
    """``safe_open`` of one safetensors file; a damaged one (a cut-off download or copy) as a one-line UserError.
    Opening parses the header and checks that the file covers every tensor it lists, so this finds a truncated
    file without reading its data."""
    safe_open = require("safetensors", "hf", purpose="reading Hugging Face weights").safe_open
    try:
        return safe_open(path, framework="pt")
    except Exception as err:  # safetensors' SafetensorError derives from Exception only
        raise UserError(
            f"{path}: not a readable safetensors file ({err}); it is probably truncated (an interrupted "
            "download or copy): download or copy it again"
        ) from None


def check_weights(folder: str) -> None:
    """Every safetensors file of a Hugging Face folder opens (headers only), or an imported loom checkpoint is
    complete with the hashes it records: found before a model is built."""
    if is_loom_checkpoint(folder):
        verify(folder)
        return
    for path in sorted(set(weight_files(folder).values())):
        with open_weights(path):
            pass


def weight_files(folder: str) -> dict[str, str]:
    """Hugging Face tensor name -> the safetensors file holding it (from the index, or the files' headers)."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
            out = {name: os.path.join(folder, f) for name, f in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise UserError(
                f"{index}: not a safetensors index with a weight_map ({err}); download it again"
            ) from None
        for path in set(out.values()):
            if not os.path.isfile(path):
                raise UserError(f"{index} names {os.path.basename(path)}, which is not in {folder}")
        return out
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise UserError(
            f"{folder}: no safetensors weights (need {SINGLE} or sharded files with {INDEX}; "
            "re-save .bin checkpoints with save_pretrained(safe_serialization=True))"
        )
    out = {}
    for f in files:
        with open_weights(os.path.join(folder, f)) as handle:
            out.update({name: os.path.join(folder, f) for name in handle.keys()})
    return out


def owned_region(param: torch.Tensor) -> tuple[slice, ...]:
    """The index ranges of the full tensor that this rank stores: everything for a plain tensor, the
    local shard for a DTensor (FSDP's Shard(0), HSDP's (Replicate, Shard(0)), any Shard(d), and FSDP2 over
    expert-parallel experts: a _StridedShard(0) that splits this rank's ep shard further)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    odd = [p for p in param.placements if type(p) not in (Shard, Replicate, _StridedShard)]
    if odd:
        raise NotImplementedError(f"loading into placements {odd} (only Shard/Replicate)")
    # plain shards first (mesh order), then the strided ones from the innermost out: a _StridedShard is a
    # split applied to what the later mesh dims' shards already left (FSDP2 after TP / EP)
    mesh, coord = param.device_mesh, param.device_mesh.get_coordinate()
    order = [i for i, p in enumerate(param.placements) if type(p) is Shard] + [
        i for i, p in reversed(list(enumerate(param.placements))) if type(p) is _StridedShard
    ]
    region = [(0, n) for n in param.shape]
    for i in order:
        dim, size = param.placements[i].dim, mesh.size(i)
        start, length = region[dim]
        chunk = -(-length // size)  # torch.chunk: ceil-sized pieces, the last ones shorter or empty
        lo = min(start + coord[i] * chunk, start + length)
        region[dim] = (lo, min(chunk, start + length - lo))
    shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, param.placements)
    if tuple(n for _, n in region) != tuple(shape) or any(
        n and o != lo for (lo, n), o in zip(region, offset)
    ):
        raise NotImplementedError(
            f"loading into placements {param.placements}: the local shard is not one block"
        )
    return tuple(slice(lo, lo + n) for lo, n in region)


def _source_names(
    name: str, param: torch.Tensor, files: dict[str, str], hf_tied: bool, args: LlamaArgs | None = None
) -> list[str]:
    """The stored tensors that fill loom parameter ``name``: one, or one per expert for stacked expert weights;
    an untied loom head may start from tied embeddings."""
    if stacked_experts(name, args):
        return hf_expert_names(name, param.shape[0], args)
    src = hf_name(name, args)
    if src == "lm_head.weight" and src not in files and hf_tied:
        return ["model.embed_tokens.weight"]
    return [src]


def _check_tying(model: torch.nn.Module, files: dict[str, str], hf_tied: bool, folder: str) -> None:
    """A tied loom model cannot hold a checkpoint whose head differs from its embeddings."""
    if model.args.tie_embeddings and not hf_tied and "lm_head.weight" in files:
        raise ConfigError(
            "model.tie_embeddings",
            "true",
            f"{folder} has its own lm_head weights "
            "(tie_word_embeddings is false); use model.tie_embeddings = false or flavor",
        )


def _read_into(handle, src: str, param: torch.Tensor, folder: str) -> None:
    """Copy this rank's region of stored tensor ``src`` into ``param``, reading only that region."""
    sl = handle.get_slice(src)
    stored = tuple(sl.get_shape())
    if stored != tuple(param.shape):
        raise UserError(
            f"{folder}: tensor {src} has shape {list(stored)}, the loom model expects "
            f"{list(param.shape)} (check model.vocab_size / the model shape)"
        )
    region = owned_region(param)
    local = local_tensor(param)
    if local.numel() == 0:
        return  # an uneven split can leave a rank without rows of a small tensor
    local.copy_(sl[region])  # (rows this rank owns, ...); cast to the parameter's dtype


def _read_experts_into(handle_of, srcs: list[str], param: torch.Tensor, folder: str) -> None:
    """A stacked expert weight (n, a, b) from ``srcs``, one stored (b, a) tensor per expert: this rank's experts
    (FSDP2 / expert parallelism shard the expert dim), each read only over this rank's block, transposed."""
    region = owned_region(param)  # (experts, a, b)
    local = local_tensor(param)
    for k, j in enumerate(range(region[0].start, region[0].stop)):
        sl = handle_of(srcs[j]).get_slice(srcs[j])
        stored, want = tuple(sl.get_shape()), (param.shape[2], param.shape[1])
        if stored != want:
            raise UserError(
                f"{folder}: tensor {srcs[j]} has shape {list(stored)}, the loom model expects "
                f"{list(want)} (check the expert width / model shape)"
            )
        local[k].copy_(sl[region[2], region[1]].T)  # (b, a) block -> (a, b)


def check_checkpoint_shapes(
    folder: str, model: torch.nn.Module, field: str, whole_model: bool = True, hint: str = ""
) -> None:
    """``model``'s tensors against loom checkpoint ``folder``'s before loading, each mismatch one line naming the
    tensor (DCP's own error is a traceback) and then ``hint``; ``whole_model``: the checkpoint holds no model
    tensor it lacks."""
    from torch.distributed.checkpoint import FileSystemReader

    stored = {
        k.removeprefix("model."): tuple(m.size)
        for k, m in FileSystemReader(folder).read_metadata().state_dict_metadata.items()
        if k.startswith("model.")
    }
    names = set()
    for name, t in model.state_dict().items():
        name = canonical_name(name)
        names.add(name)
        if name not in stored:
            raise ConfigError(
                field,
                folder,
                f"has no model tensor {name} (not a loom Llama checkpoint, or another model.tie_embeddings)",
            )
        if stored[name] != tuple(t.shape):
            raise ConfigError(
                field,
                folder,
                f"{name} has shape {list(stored[name])} but the config gives {list(t.shape)}{hint}",
            )
    extra = sorted(set(stored) - names)
    if whole_model and extra:
        raise ConfigError(
            field,
            folder,
            f"holds tensors with no place in this model: {', '.join(extra[:4])} "
            "(another model.tie_embeddings?)",
        )


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, folder: str, whole_model: bool = True) -> None:
    """Fill a loom Llama (plain, sharded with FSDP2/HSDP/TP, or one pipeline stage: ``whole_model`` false)
    from a Hugging Face folder; each rank reads only the rows it owns. No collectives: every rank reads
    its own part independently. From an imported loom checkpoint (``loom convert --from-hf``) DCP loads it: every
    rank calls this for each of its parts in the same order."""
    if is_loom_checkpoint(folder):
        hf_tied = bool(read_hf_config(folder).get("tie_word_embeddings", False))
        if model.args.tie_embeddings and not hf_tied:
            raise ConfigError(
                "model.tie_embeddings",
                "true",
                f"{folder} has its own output weights "
                "(tie_word_embeddings is false); use model.tie_embeddings = false or flavor",
            )
        check_checkpoint_shapes(folder, model, "model.init_from", whole_model)
        load_model_weights(folder, model)
        return
    hf_cfg = read_hf_config(folder)
    hf_tied = bool(hf_cfg.get("tie_word_embeddings", False))
    files = weight_files(folder)
    score = has_score_head(model)
    if not score:
        _check_tying(model, files, hf_tied, folder)
    params = dict(model.named_parameters())  # tied weights appear once
    state = model.state_dict(keep_vars=True)  # persistent buffers (a router's selection bias) are weights too
    params.update({n: b for n, b in model.named_buffers() if n in state})
    args = model.args
    sources = {name: _source_names(name, param, files, hf_tied, args) for name, param in params.items()}
    # a reward model's head: the folder's score head, or (a base model's folder) its own seeded init
    if score:
        sources.update(
            {
                n: [SCORE_WEIGHT] if SCORE_WEIGHT in files else []
                for n in params
                if canonical_name(n) == "output.weight"
            }
        )
    used = {src for srcs in sources.values() for src in srcs}
    missing = sorted(used - set(files))
    if missing:
        raise UserError(
            f"{folder}: missing tensors {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
        )
    adapter = hf_adapter(args)
    unused = sorted(
        n
        for n in set(files) - used
        if not ignorable(n)
        and not (n == "lm_head.weight" and (hf_tied or score))
        and not adapter.ignored(n, args)
    )
    if unused and whole_model:
        raise UserError(
            f"{folder}: tensors with no place in the loom model: {', '.join(unused[:4])}"
            f"{' ...' if len(unused) > 4 else ''}"
        )
    with contextlib.ExitStack() as stack:
        handles: dict[str, object] = {}

        def handle_of(src: str):
            if files[src] not in handles:
                handles[files[src]] = stack.enter_context(open_weights(files[src]))
            return handles[files[src]]

        for name, param in params.items():
            if not sources[name]:
                continue
            if stacked_experts(name, args):
                _read_experts_into(handle_of, sources[name], param, folder)
            else:
                _read_into(handle_of(sources[name][0]), sources[name][0], param, folder)

"""Writing a loom model as a Hugging Face folder of the family that holds it: renamed tensors in safetensors
shards, config.json, and the run's tokenizer (loom.checkpoint.hf.tokenizer); all of it or nothing."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil

import torch

from loom.checkpoint.hf.config import (
    CONFIG,
    GENERATION_CONFIG,
    INDEX,
    SINGLE,
    hf_architecture,
    hf_config_from_args,
)
from loom.checkpoint.hf.head import SCORE_WEIGHT, score_config, state_has_score_head
from loom.checkpoint.hf.names import expected_loom_names, hf_expert_names, hf_name, stacked_experts
from loom.checkpoint.hf.tokenizer import ExportTokenizer, export_file_names, json_bytes
from loom.checkpoint.manager import _disk_full
from loom.config.errors import UserError, require
from loom.models.common.init import canonical_name
from loom.models.llama.flavors import LlamaArgs
from loom.models.registry import hf_adapter

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size ("5GB")


def hf_state_dict(model_state: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """Rename a full (unsharded) loom state dict to Hugging Face names; the tied head is not stored. A reward
    model's score head (``output.weight`` (1, dim)) is ``score.weight``."""
    state = {canonical_name(k): v for k, v in model_state.items()}
    score = state_has_score_head(state, args)
    expected = expected_loom_names(args.with_(tie_embeddings=False) if score else args)
    missing = [n for n in expected if n not in state]
    extra = sorted(set(state) - set(expected) - {"output.weight"})
    if missing or extra:
        raise UserError(
            f"the model state does not match the model shape: missing {missing[:4]}, unexpected {extra[:4]}"
        )
    out = {}
    for name in expected:
        t = state[name]
        if hasattr(t, "full_tensor"):
            raise TypeError(f"{name} is a DTensor; export needs full tensors (gather them first)")
        t = plain(t).detach().to("cpu")
        if stacked_experts(name, args):  # (n, a, b) -> one (b, a) tensor per expert
            out.update(
                {src: t[j].T.contiguous() for j, src in enumerate(hf_expert_names(name, t.shape[0], args))}
            )
        elif score and name == "output.weight":
            out[SCORE_WEIGHT] = t.contiguous()
        else:
            out[hf_name(name, args)] = t.contiguous()
    return out if score else {**out, **hf_adapter(args).derived(out, args)}


def plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor a wrapper subclass of one tensor holds (torchao's float8 all-gather weights,
    ``training.float8_all_gather``): safetensors writes plain tensors only."""
    while type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        if len(names) != 1:
            break
        t = getattr(t, names[0])
    return t


def plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Greedy split, in order, into groups of at most ``max_bytes`` (a larger tensor gets a group alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def check_empty_target(out_folder: str, also: tuple[str, ...] = ()) -> None:
    """Refuse to mix new files with a model already in the folder (stale shards would be loaded too), or to
    overwrite the files named in ``also`` (the tokenizer's)."""
    if os.path.isdir(out_folder):
        clash = [
            f for f in sorted(os.listdir(out_folder)) if f.endswith(".safetensors") or f in (CONFIG, INDEX)
        ]
        clash += [f for f in also if os.path.exists(os.path.join(out_folder, f))]
        if clash:
            raise UserError(f"{out_folder} already holds a model ({clash[0]}); choose an empty folder")


def export_hf(
    model_state: dict[str, torch.Tensor],
    args: LlamaArgs,
    out_folder: str,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer: ExportTokenizer | None = None,
) -> list[str]:
    """Write ``out_folder`` as a Hugging Face folder of the family that holds the model (``hf_architecture``:
    LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM,
    DeepseekV3ForCausalLM); returns the
    safetensors file names. With ``tokenizer``: its files, its special ids in config.json and a
    generation_config.json, so that transformers, vLLM and PEFT load the folder as it is.

    ``model_state`` holds full tensors with loom names (``model.state_dict()`` of an unsharded model). A reward
    model's (loom.methods.reward: a score head) is written as the family's ``*ForSequenceClassification``."""
    save_file = require("safetensors.torch", "hf", purpose="writing a Hugging Face folder").save_file

    hf_architecture(args)  # a model no family holds fails before anything is written
    tensors = hf_state_dict(model_state, args)
    check_empty_target(out_folder, export_file_names(tokenizer))
    groups = plan_shards(tensors, max_shard_bytes)
    names = (
        [SINGLE]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    need = sum(t.numel() * t.element_size() for t in tensors.values())
    with whole_or_nothing(out_folder, "the Hugging Face folder", need) as written:
        mode = 0o666 & ~current_umask()  # what open() gives; safetensors writes its files 0600
        for fname, group in zip(names, groups):
            written.append(os.path.join(out_folder, fname))
            save_file({n: tensors[n] for n in group}, written[-1], metadata={"format": "pt"})
            os.chmod(written[-1], mode)
        if len(groups) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map = {n: fname for fname, group in zip(names, groups) for n in group}
            written.append(os.path.join(out_folder, INDEX))
            write_json(written[-1], {"metadata": {"total_size": total}, "weight_map": weight_map})
        dtype = tensors["model.embed_tokens.weight"].dtype
        written.append(os.path.join(out_folder, CONFIG))
        config = hf_config_from_args(args, dtype)
        if SCORE_WEIGHT in tensors:
            config = score_config(config)
        write_json(written[-1], {**config, **(tokenizer.config_ids() if tokenizer else {})})
        if tokenizer is not None:
            files = {GENERATION_CONFIG: json_bytes(tokenizer.generation_config()), **tokenizer.files}
            for name, data in files.items():
                written.append(os.path.join(out_folder, name))
                with open(written[-1], "wb") as fh:
                    fh.write(data)
    return names


@contextlib.contextmanager
def whole_or_nothing(out_folder: str, what: str, need: int | None = None):
    """Yields a list for the paths the block writes into ``out_folder``; when the block fails they are removed (and
    the folder, if it made it), so no half-written export is left for a reader to load. ``need``: the bytes the
    block writes, named when the disk is full."""
    created = not os.path.isdir(out_folder)
    written: list[str] = []
    try:
        os.makedirs(out_folder, exist_ok=True)
        yield written
    except BaseException as caught:
        err = os_error_of(caught)
        for path in written:
            with contextlib.suppress(OSError):
                os.remove(path)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out_folder)
        if isinstance(err, OSError) or _disk_full(err):
            space = (
                f"; it needs about {need:,} bytes, {_free(out_folder):,} are free"
                if need and _disk_full(err)
                else ""
            )
            reason = (
                getattr(err, "strerror", None) or "no space left on the device"
                if _disk_full(err)
                else (getattr(err, "strerror", None) or err)
            )
            raise UserError(
                f"{out_folder}: writing {what} failed ({reason}){space}; nothing partial was kept, the "
                "target is as it was"
            ) from None
        raise


def os_error_of(err: BaseException) -> BaseException:
    """``err``, or the OSError a safetensors write failure stands for: safetensors reports a full disk as a
    SafetensorError ("I/O error: No space left on device (os error 28)"), not as an OSError."""
    found = re.search(r"I/O error: (.*) \(os error (\d+)\)", str(err))
    if type(err).__name__ == "SafetensorError" and found:
        return OSError(int(found[2]), found[1])
    return err


def _free(folder: str) -> int:
    """Free bytes on the filesystem of ``folder`` (or of the nearest folder above it that exists)."""
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder.rstrip(os.sep)) or "."
    try:
        return shutil.disk_usage(folder or ".").free
    except OSError:
        return 0


def current_umask() -> int:
    """The process's umask, read without changing it where Linux reports it (no window for other threads)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json(path: str, obj) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")

"""Loading a Hugging Face folder into an FSDP2-sharded loom Llama (2 ranks, gloo, CPU).

Each rank must end up with exactly its shard of every tensor, and must have read only that shard:
a thin wrapper around ``safetensors.safe_open`` (installed in the worker processes only) counts the
bytes every rank pulls out of the files, whichever way it asks for them.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_fn

safetensors = pytest.importorskip("safetensors")

WORLD = 2
VOCAB = 385  # odd: the embedding rows split unevenly (193 + 192)


class CountingSlice:
    def __init__(self, inner, log: list):
        self._inner, self._log = inner, log

    def get_shape(self):
        return self._inner.get_shape()

    def get_dtype(self):
        return self._inner.get_dtype()

    def __getitem__(self, index):
        t = self._inner[index]
        self._log.append(t.numel() * t.element_size())
        return t


class CountingFile:
    """safe_open that records the size of every tensor or slice read through it."""

    log: list[int] = []

    def __init__(self, path, **kwargs):
        self._inner = _REAL_SAFE_OPEN(path, **kwargs)

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def keys(self):
        return self._inner.keys()

    def metadata(self):
        return self._inner.metadata()

    def get_slice(self, name):
        return CountingSlice(self._inner.get_slice(name), CountingFile.log)

    def get_tensor(self, name):
        t = self._inner.get_tensor(name)
        CountingFile.log.append(t.numel() * t.element_size())
        return t


_REAL_SAFE_OPEN = safetensors.safe_open


def full_tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def sharded_via_loom(args, rank):
    """The trainer's path: ParallelDims mesh + parallelize_llama (1-D FSDP over both ranks)."""
    from loom.config.sections import ParallelConfig, TrainingConfig
    from loom.models.llama import Llama
    from loom.parallel.dims import ParallelDims
    from loom.parallel.parallelize import parallelize_llama

    dims = ParallelDims.from_config(ParallelConfig(), WORLD)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Llama(args)
    return parallelize_llama(
        model, dims, TrainingConfig(), ParallelConfig(), torch.device("cpu"), seed=0
    ).parts[0]


def sharded_hsdp(args, mesh_shape):
    """HSDP placements (Replicate, Shard(0)) on a 2-D mesh ``(replicas, shards)``."""
    from torch.distributed.device_mesh import init_device_mesh

    from loom.models.common.init import materialize
    from loom.models.llama import Llama
    from loom.parallel.data_parallel import apply_fsdp
    from loom.parallel.shards import keep_shard

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp_replicate", "dp_shard"))
    with torch.device("meta"):
        model = Llama(args)
    apply_fsdp(
        model,
        list(model.layers.values()),
        mesh,
        compute_dtype=torch.float32,
        reshard_after_forward=True,
        cpu_offload=False,
    )
    materialize(model, torch.device("cpu"), 0, model.param_std, model.init_buffers, keep=keep_shard)
    return model


def check_rank_holds_its_shard(model, full: dict[str, torch.Tensor], shards: int, shard_rank: int) -> int:
    """Every local shard equals this rank's torch.chunk of the stored tensor; returns the local bytes."""
    from loom.checkpoint.hf.names import hf_name

    local_bytes = 0
    for name, param in model.named_parameters():
        assert type(param).__name__ == "DTensor", name
        expected = torch.chunk(full[hf_name(name)], shards, dim=0)[shard_rank]  # (rows of this rank, ...)
        local = param.to_local()
        assert torch.equal(local, expected), name
        local_bytes += local.numel() * local.element_size()
    return local_bytes


def worker(folder: str, rank: int, world: int) -> bool:
    """Runs on every rank inside the harness's gloo group (its teardown avoids gloo's rare SIGABRT at exit)."""
    import safetensors as st

    from loom.checkpoint.hf.reader import llama_args_from_hf, load_hf_weights
    from loom.models.llama import Llama

    assert world == WORLD
    torch.set_num_threads(1)
    try:
        full = full_tensors(folder)
        args = llama_args_from_hf(folder).with_(max_seq_len=16)
        reference = Llama(args)
        load_hf_weights(reference, folder)  # unsharded: reads everything
        st.safe_open = CountingFile  # load_hf_weights imports safe_open when it runs
        tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
        layouts = [  # (name, build, shards, this rank's shard, replicas)
            ("fsdp via parallelize_llama", lambda: sharded_via_loom(args, rank), WORLD, rank, 1),
            ("hsdp 1x2", lambda: sharded_hsdp(args, (1, WORLD)), WORLD, rank, 1),
            ("hsdp 2x1", lambda: sharded_hsdp(args, (WORLD, 1)), 1, 0, WORLD),
        ]
        total_bytes = sum(t.numel() * t.element_size() for t in full.values())
        for name, build, shards, shard_rank, replicas in layouts:
            model = build()
            CountingFile.log.clear()
            load_hf_weights(model, folder)
            read = sum(CountingFile.log)
            local_bytes = check_rank_holds_its_shard(model, full, shards, shard_rank)
            assert read == local_bytes, (name, read, local_bytes)
            assert shards == 1 or read < total_bytes, (name, read, total_bytes)
            counts = torch.tensor([read])
            dist.all_reduce(counts)
            assert int(counts) == total_bytes * replicas, name  # each replica reads every byte exactly once
            with torch.no_grad():
                assert torch.allclose(model(tokens), reference(tokens), atol=1e-5), name
    finally:
        st.safe_open = _REAL_SAFE_OPEN
    return True


def test_sharded_load_reads_only_the_local_rows(tmp_path):
    transformers = pytest.importorskip(
        "transformers"
    )  # here, not at import: the workers re-import this module
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    folder = str(tmp_path / "hf")
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="30KB")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    assert run_fn(WORLD, functools.partial(worker, folder), str(tmp_path)) is True


def mixtral_worker(folder: str, rank: int, world: int) -> bool:
    """A Mixtral folder into loom's MoE model under FSDP2 (experts sharded over dp_shard) and under EP2 (over
    ep): every rank holds its torch.chunk of every (stacked, transposed) tensor and read only that. Under TP2
    with etp2 (each expert's hidden width sharded over tp) every rank holds its chunk of every expert's width."""
    import safetensors as st

    from loom.checkpoint.hf.names import hf_expert_names, hf_name, stacked_experts
    from loom.checkpoint.hf.reader import llama_args_from_hf, load_hf_weights
    from loom.config.sections import ParallelConfig, TrainingConfig
    from loom.models.llama import Llama
    from loom.parallel.dims import ParallelDims
    from loom.parallel.parallelize import parallelize_llama

    torch.set_num_threads(1)
    full = full_tensors(folder)
    args = llama_args_from_hf(folder).with_(max_seq_len=16)
    total_bytes = sum(t.numel() * t.element_size() for t in full.values())
    try:
        st.safe_open = CountingFile
        for parallel in (
            ParallelConfig(dp_shard=WORLD),
            ParallelConfig(dp_shard=WORLD, fsdp_embedding="vocab"),  # the table split by rows (as resolved)
            ParallelConfig(dp_shard=WORLD, ep=WORLD),
            ParallelConfig(dp_shard=1, tp=WORLD, etp=WORLD),
        ):
            dims = ParallelDims.from_config(parallel, WORLD)
            dims.build_mesh("cpu")
            with torch.device("meta"):
                model = Llama(args)
            model = parallelize_llama(
                model, dims, TrainingConfig(), parallel, torch.device("cpu"), seed=0
            ).parts[0]
            CountingFile.log.clear()
            load_hf_weights(model, folder)
            # w1 / w3 (n, E, H) split on H, w2 (n, H, E) on H; the rest is TP's own layout
            if parallel.etp > 1:
                for name, param in model.named_parameters():
                    if stacked_experts(name):
                        whole = torch.stack([full[src].T for src in hf_expert_names(name, param.shape[0])])
                        width = 1 if name.endswith("w2") else 2
                        assert torch.equal(param.to_local(), torch.chunk(whole, WORLD, dim=width)[rank]), name
                continue
            local_bytes = 0
            for name, param in model.named_parameters():
                if stacked_experts(name):
                    whole = torch.stack([full[src].T for src in hf_expert_names(name, param.shape[0])])
                else:
                    whole = full[hf_name(name)]
                local = param.to_local()
                assert torch.equal(local, torch.chunk(whole, WORLD, dim=0)[rank]), (parallel.ep, name)
                local_bytes += local.numel() * local.element_size()
            read = sum(CountingFile.log)
            assert read == local_bytes, (parallel.ep, read, local_bytes)
            counts = torch.tensor([read])
            dist.all_reduce(counts)
            assert int(counts) == total_bytes, parallel.ep  # every byte read by exactly one rank
    finally:
        st.safe_open = _REAL_SAFE_OPEN
    return True


def test_sharded_mixtral_load_reads_only_the_local_experts(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    folder = str(tmp_path / "hf")
    transformers.MixtralForCausalLM(cfg).save_pretrained(folder, max_shard_size="30KB")
    assert run_fn(WORLD, functools.partial(mixtral_worker, folder), str(tmp_path)) is True

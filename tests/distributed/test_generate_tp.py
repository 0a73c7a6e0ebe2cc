"""Tensor-parallel generation on 2 gloo ranks: the same greedy tokens as one process (plain decoding, sampling with a
seed, and prompt-lookup speculation), each rank's cache holding its half of the KV heads, for a Hugging Face folder
with untied and with tied embeddings."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.harness import run_fn

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 9, 10], [20]]


def _folder(path: str, tied: bool) -> str:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=384,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        eos_token_id=3,
    )
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5) if p.ndim == 1 else p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


def _generate(folder: str) -> dict:
    from loom.infer import Generator, PromptLookup, SamplingParams

    gen = Generator(folder, compile=False)
    greedy = [o.token_ids for o in gen.generate_ids(PROMPTS, max_new_tokens=16)]
    sampled = [
        o.token_ids
        for o in gen.generate_ids(
            PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=5)
        )
    ]
    spec = [o.token_ids for o in gen.generate_ids(PROMPTS, max_new_tokens=16, speculative=PromptLookup(k=3))]
    return {
        "greedy": greedy,
        "sampled": sampled,
        "spec": spec,
        "kv_heads": [c.k.shape[1] for c in gen.engine.caches],
    }


def tp_worker(folders: list[str], rank: int, world: int) -> list[dict]:
    return [_generate(f) for f in folders]


def test_tp2_generates_what_one_process_does(tmp_path):
    folders = [_folder(str(tmp_path / name), tied) for name, tied in (("untied", False), ("tied", True))]
    splits = run_fn(2, functools.partial(tp_worker, folders), str(tmp_path))  # one process group for both
    for folder, split in zip(folders, splits):
        single = _generate(folder)
        assert single["kv_heads"] == [2, 2] and split["kv_heads"] == [1, 1]
        assert split["greedy"] == single["greedy"]
        assert split["spec"] == single["greedy"]
        assert split["sampled"] == single["sampled"]

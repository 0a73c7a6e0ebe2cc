"""Generation against transformers on the same weights: greedy tokens equal ``generate``'s for a batch of prompts of
different lengths (token ids, plain text and chat messages through the folder's tokenizer and chat template); the
sampling filters equal transformers' logits processors; the same seed gives the same tokens; stop strings, stop ids,
EOS and the token budget end a sequence with the right text; an imported checkpoint and a run's checkpoint load."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from loom.config.errors import ConfigError  # noqa: E402
from loom.data.tokenizers import ByteTokenizer  # noqa: E402
from loom.infer import Generator, SamplingParams  # noqa: E402
from loom.infer.sampling import probabilities  # noqa: E402
from loom.infer.text import Codec, Sequence  # noqa: E402

VOCAB = 512
EOS = 4  # "<|eot_id|>" in the llama3-style tokenizer folder of tests/unit/test_chat.py


def random_hf_llama(seed: int = 0, **kw):
    """A small LlamaForCausalLM whose weights are widened from HF's init, so that greedy choices are well apart."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        **{
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "vocab_size": VOCAB,
            "rope_theta": 10000.0,
            "max_position_embeddings": 128,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "bos_token_id": 0,
            "eos_token_id": EOS,
            "pad_token_id": 0,
            **kw,
        }
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5) if p.ndim == 1 else p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A Hugging Face folder: random weights, a BPE tokenizer and a Llama-3-style chat template."""
    from tests.unit.test_chat import build_folder

    folder = tmp_path_factory.mktemp("gen") / "hf"
    build_folder(folder, "llama3")
    model = random_hf_llama()
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(folder)
    return str(folder), model


def hf_greedy(model, ids: list[int], new: int) -> list[int]:
    x = torch.tensor(
        [ids]
    )  # an explicit mask: transformers would take the prompt's id 0 (BOS here) for padding
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def test_greedy_ids_equal_transformers(hf_folder):
    folder, hf = hf_folder
    gen = Generator(folder, compile=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 6, 1)]
    outs = gen.generate_ids(prompts, max_new_tokens=20)
    for prompt, out in zip(prompts, outs):
        expected = hf_greedy(hf, prompt, 20)
        assert out.token_ids == expected
        assert out.finish_reason == ("eos" if expected[-1] == EOS else "length")
        assert out.prompt_tokens == len(prompt)


def test_text_and_chat_prompts_equal_transformers(hf_folder):
    folder, hf = hf_folder
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    gen = Generator(folder, compile=False)
    text = "What is the capital of France?"
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me a joke about cats."},
    ]
    chat_ids = list(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )
    assert gen.encode(text) == tok(text)["input_ids"]
    assert gen.encode(messages) == chat_ids
    plain, chat = gen.generate([text, messages], max_new_tokens=12)
    for out, ids in ((plain, tok(text)["input_ids"]), (chat, chat_ids)):
        expected = hf_greedy(hf, ids, 12)
        assert out.token_ids == expected
        assert out.text == tok.decode(expected, skip_special_tokens=True)


def test_sampling_filters_equal_transformers_processors():
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    seen_ids = torch.randint(0, 50, (3, 6), generator=g)
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter_(1, seen_ids, True)
    for params in (
        SamplingParams(temperature=0.7, top_k=10),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    ):
        ref = logits.clone()
        if params.repetition_penalty != 1.0:
            ref = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(seen_ids, ref)
        ref = TemperatureLogitsWarper(params.temperature)(seen_ids, ref)
        if params.top_k:
            ref = TopKLogitsWarper(params.top_k)(seen_ids, ref)
        if params.top_p < 1:
            ref = TopPLogitsWarper(params.top_p)(seen_ids, ref)
        if params.min_p:
            ref = MinPLogitsWarper(params.min_p)(seen_ids, ref)
        ours = probabilities(logits, params, seen if params.repetition_penalty != 1.0 else None)
        assert torch.allclose(ours, ref.softmax(-1), atol=1e-6), params
        assert (ours > 0).sum() < 50  # the filters removed something


def test_same_seed_same_tokens(hf_folder):
    folder, _ = hf_folder
    gen = Generator(folder, compile=False)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=50, seed=3, ignore_eos=True)
    a = [o.token_ids for o in gen.generate_ids(prompts, params)]
    b = [o.token_ids for o in gen.generate_ids(prompts, params)]
    c = [o.token_ids for o in gen.generate_ids(prompts, params.with_(seed=4))]
    assert a == b and a != c
    greedy = [o.token_ids for o in gen.generate_ids(prompts, max_new_tokens=16, ignore_eos=True)]
    top1 = [o.token_ids for o in gen.generate_ids(prompts, params.with_(top_k=1))]
    assert top1 == greedy  # top-k 1 is greedy whatever the draws


def test_batches_and_max_batch_give_the_same_greedy_tokens(hf_folder):
    folder, _ = hf_folder
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, VOCAB, (n,), generator=g).tolist() for n in (2, 7, 4, 9, 5)]
    one = [
        o.token_ids
        for o in Generator(folder, compile=False, max_batch=1).generate_ids(prompts, max_new_tokens=9)
    ]
    two = [
        o.token_ids
        for o in Generator(folder, compile=False, max_batch=2).generate_ids(prompts, max_new_tokens=9)
    ]
    assert one == two


# ---- stopping -----------------------------------------------------------------------------------------------


def _feed(seq: Sequence, text: str) -> None:
    for token in text.encode():
        if seq.add(token):
            return


def test_stop_strings_cut_the_text_and_streaming_never_shows_them():
    codec = Codec(ByteTokenizer())
    deltas = []
    seq = Sequence(
        SamplingParams(max_new_tokens=100, stop=("\n\n", "END")),
        eos_ids=(257,),
        codec=codec,
        on_text=deltas.append,
    )
    _feed(seq, "def f():\n    return 1\n\nprint(f())")
    assert seq.finish_reason == "stop" and seq.text == "def f():\n    return 1"
    assert "".join(deltas) == seq.text
    assert len(seq.token_ids) == len("def f():\n    return 1\n\n")  # the tokens through the stop string


def test_eos_stop_ids_and_the_budget():
    codec = Codec(ByteTokenizer())
    seq = Sequence(SamplingParams(max_new_tokens=100), eos_ids=(257,), codec=codec)
    for t in [104, 105, 257, 106]:
        if seq.add(t):
            break
    assert (seq.finish_reason, seq.text, seq.token_ids) == ("eos", "hi", [104, 105, 257])
    seq = Sequence(SamplingParams(max_new_tokens=100, stop_token_ids=(33,)), eos_ids=(257,), codec=codec)
    _feed(seq, "hey!there")
    assert (seq.finish_reason, seq.text) == ("stop", "hey")
    seq = Sequence(SamplingParams(max_new_tokens=3, ignore_eos=True), eos_ids=(257,), codec=codec)
    for t in [257, 104, 105]:
        seq.add(t)
    assert (seq.finish_reason, seq.text, seq.token_ids) == ("length", "hi", [257, 104, 105])


def test_multibyte_characters_stream_whole():
    codec = Codec(ByteTokenizer())
    deltas = []
    seq = Sequence(SamplingParams(max_new_tokens=100), codec=codec, on_text=deltas.append)
    _feed(seq, "café 東京")
    assert "".join(deltas) == "café 東京" and all("\ufffd" not in d for d in deltas)


def test_the_byte_tokenizers_ascii_fast_path_decides_what_decoding_decides():
    """Detokenizer's fast path (an id below 128 after decided text, no decode) against the decoding path, on random
    ids mixing ASCII, multi-byte characters cut anywhere, invalid bytes and special ids: the same delta at every
    token and the same flush."""
    import random

    from loom.infer.text import Detokenizer

    codec = Codec(ByteTokenizer())
    assert codec.ascii_ids
    rng = random.Random(0)
    pool = list(range(128)) * 4 + list("é東€😀".encode()) + [0x80, 0xC3, 0xFF, 256, 257, 258]
    fast_hits = 0
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        fast, slow = Detokenizer(codec.decode, ascii_ids=True), Detokenizer(codec.decode)
        for t in ids:
            fast_hits += t < 128 and fast._read == len(fast.ids)
            assert fast.add(t) == slow.add(t), ids
        assert fast.flush() == slow.flush() and fast.text == slow.text == codec.decode(ids), ids
    assert fast_hits > 1000  # the fast path ran


def test_parameter_errors_name_the_field():
    for kw, field in (
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop": ("",)}, "stop"),
    ):
        with pytest.raises(ConfigError, match=field):
            SamplingParams(**kw)


# ---- checkpoints --------------------------------------------------------------------------------------------


def test_an_imported_checkpoint_generates_as_its_folder(hf_folder, tmp_path):
    from loom.checkpoint.hf.dcp_import import import_hf_to_dcp

    folder, _ = hf_folder
    ckpt = str(tmp_path / "imported")
    import_hf_to_dcp(folder, ckpt)
    messages = [{"role": "user", "content": "Hi"}]
    a = Generator(folder, compile=False).generate(["Paris is", messages], max_new_tokens=10)
    b = Generator(ckpt, compile=False).generate(["Paris is", messages], max_new_tokens=10)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_a_run_checkpoint_and_its_run_dir(tmp_path):
    from loom.config import build_config
    from loom.train.trainer import Trainer
    from tests.tiny import tiny_overrides

    run = tmp_path / "run"
    cfg = build_config(
        None,
        {
            k: str(v)
            for k, v in tiny_overrides(run, tmp_path / "cache", **{"checkpoint.at_end": None}).items()
        },
    )
    Trainer(cfg).fit()
    step = os.path.join(run, "checkpoints", "step_00000004")
    by_step = Generator(step, compile=False).generate("def ", max_new_tokens=8)[0]
    by_dir = Generator(str(run), compile=False).generate("def ", max_new_tokens=8)[0]
    assert by_step.token_ids == by_dir.token_ids and len(by_step.token_ids) >= 1
    chat = Generator(str(run), compile=False).generate(
        [[{"role": "user", "content": "hi"}]], max_new_tokens=4
    )
    assert chat[0].finish_reason in ("eos", "length")


def test_load_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="folder not found"):
        Generator(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="neither a loom checkpoint"):
        Generator(str(tmp_path / "empty"))
    os.makedirs(tmp_path / "run")
    (tmp_path / "run" / "config.toml").write_text("[run]\n")
    with pytest.raises(ConfigError, match="without a complete checkpoint"):
        Generator(str(tmp_path / "run"))

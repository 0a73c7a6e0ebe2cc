"""An exported folder is complete: transformers loads its tokenizer and model as they are, the special ids are
loom's, the tokenizer encodes as loom's does, the chat template survives, and generate runs. For the built-in
byte tokenizer, for a tokenizer.json folder, and through an import and back. (That the exported weights give
transformers the same logits as loom: tests/unit/test_hf.py, once here for a trained run.)"""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from loom.cli.main import main as loom_main  # noqa: E402
from loom.config.errors import UserError  # noqa: E402
from loom.data.chat import BUILTIN_TEMPLATE, ChatEncoder, load_template  # noqa: E402
from loom.data.tokenizers import ByteTokenizer, HFTokenizer  # noqa: E402
from tests.unit.test_hf import random_hf_llama, save_hf  # noqa: E402
from tests.unit.test_run_dir import TEMPLATE, tokenizer_folder, train  # noqa: E402

TEXT = "déjà vu: 3 < 4 && x != y\n\tthe quick brown fox 🙂"
FOLDER_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
}


def export(tmp_path, ckpt: str) -> str:
    out = str(tmp_path / "out")
    assert loom_main(["convert", "--from", ckpt, "--to-hf", out]) == 0
    return out


def read_json(folder, name) -> dict:
    with open(os.path.join(folder, name)) as fh:
        return json.load(fh)


def generates(model, ids: list[int], n: int = 4) -> None:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    assert out.shape == (1, len(ids) + n)


def test_the_byte_tokenizer_as_a_tokenizer_json_has_the_same_ids():
    tokenizers = pytest.importorskip("tokenizers")
    loom = ByteTokenizer()
    hf = tokenizers.Tokenizer.from_str(loom.hf_json())
    for text in (TEXT, "", " leading and trailing ", "\x00\x7f\u00ad\u00a0", "日本語のテキスト"):
        assert hf.encode(text).ids == loom.encode(text)
        assert hf.decode(hf.encode(text).ids) == text
    assert hf.get_vocab_size() == loom.vocab_size
    assert [hf.token_to_id(n) for n in ("<s>", "</s>", "<pad>")] == [loom.bos_id, loom.eos_id, loom.pad_id]


def test_a_byte_run_exports_a_folder_transformers_loads(tmp_path, monkeypatch):
    trainer = train(tmp_path, monkeypatch, tmp_path / "run")
    out = export(tmp_path, str(tmp_path / "run" / "checkpoints" / "step_00000002"))
    assert FOLDER_FILES <= set(os.listdir(out))
    loom = ByteTokenizer()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (loom.bos_id, loom.eos_id, loom.pad_id)
    ids = tok(TEXT, add_special_tokens=False).input_ids
    assert ids == loom.encode(TEXT) and tok.decode(ids) == TEXT
    assert tok(TEXT).input_ids == ids  # nothing added around a text, as in training

    # the byte tokenizer's built-in chat template travels with it: transformers renders and tokenizes a
    # conversation as loom's SFT does, and loom finds the same template in the export (a run from the export)
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    loom_template = load_template("", loom)
    assert tok.chat_template == BUILTIN_TEMPLATE
    assert tok.apply_chat_template(chat, tokenize=False) == loom_template.render(chat)
    assert (
        tok.apply_chat_template(chat, return_dict=False) == ChatEncoder(loom_template, loom).encode(chat)[0]
    )
    exported = load_template("", HFTokenizer(os.path.join(out, "tokenizer.json")))
    assert exported.source == BUILTIN_TEMPLATE and exported.render(chat) == loom_template.render(chat)

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (
        256,
        257,
        258,
    )
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (257, 258)
    tokens = torch.tensor([loom.encode("def main():\n    return 0")])  # (1, S)
    ours = trainer.parts[0].eval()
    with torch.no_grad():
        assert (model(tokens).logits - ours(tokens)).abs().max() < 1e-4
    generates(model, loom.encode("def "))
    with pytest.raises(SystemExit):  # the folder holds a model now: not written over
        loom_main(
            ["convert", "--from", str(tmp_path / "run" / "checkpoints" / "step_00000002"), "--to-hf", out]
        )


def test_a_tokenizer_folder_run_exports_its_tokenizer_and_chat_template(tmp_path, monkeypatch):
    source = tokenizer_folder(tmp_path / "tok")
    train(tmp_path, monkeypatch, tmp_path / "run", tokenizer=source)
    out = export(tmp_path, str(tmp_path / "run" / "checkpoints" / "step_00000002"))
    assert FOLDER_FILES <= set(os.listdir(out))
    loom = HFTokenizer(source)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token_id, tok.eos_token_id) == (loom.bos_id, loom.eos_id) == (0, 1)
    assert tok(TEXT, add_special_tokens=False).input_ids == loom.encode(TEXT)
    assert tok.chat_template == TEMPLATE
    chat = [{"role": "user", "content": "hi"}]
    assert (
        tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        == "<|begin_of_text|>user\nhi<|eot_id|><|begin_of_text|>assistant\n"
    )

    # config.json: loom's end of document; generation also stops at the end of a chat turn the source names
    assert read_json(out, "config.json")["eos_token_id"] == 1
    assert read_json(out, "generation_config.json") == {"bos_token_id": 0, "eos_token_id": [1, 2]}
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.generation_config.eos_token_id == [1, 2]
    generates(model, tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))


def test_an_import_exports_its_source_tokenizer_and_generation_config_unchanged(tmp_path):
    src = save_hf(random_hf_llama(tied=True), tmp_path / "hf")
    tokenizer_folder(tmp_path / "tok")
    source_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    source_tok.save_pretrained(src)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    gen = {"bos_token_id": 0, "eos_token_id": [1, 2], "do_sample": True, "temperature": 0.6}
    with open(os.path.join(src, "generation_config.json"), "w") as fh:
        json.dump(gen, fh)
    ckpt = str(tmp_path / "ckpt")
    assert loom_main(["convert", "--from-hf", src, "--to", ckpt]) == 0
    kept = sorted(os.listdir(os.path.join(ckpt, "tokenizer")))
    assert "tokenizer.json" in kept and "tokenizer_config.json" in kept

    out = export(tmp_path, ckpt)
    for name in kept:
        with open(os.path.join(src, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
            assert a.read() == b.read(), name
    assert read_json(out, "generation_config.json") == gen
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == source_tok.chat_template == TEMPLATE
    generates(transformers.AutoModelForCausalLM.from_pretrained(out).eval(), [5, 6, 7])


def test_export_refuses_to_overwrite_tokenizer_files(tmp_path, monkeypatch):
    from loom.checkpoint.hf.export import check_empty_target

    os.makedirs(tmp_path / "out")
    (tmp_path / "out" / "tokenizer.json").write_text("{}")
    check_empty_target(str(tmp_path / "out"))  # a tokenizer alone is no model
    with pytest.raises(UserError, match="already holds a model \\(tokenizer.json\\)"):
        check_empty_target(str(tmp_path / "out"), ("tokenizer.json",))


def test_a_byte_sft_run_with_its_own_chat_template_exports_that_template(tmp_path):
    """An SFT run on the byte tokenizer with its own data.chat_template exports that template, not the built-in
    one: transformers' apply_chat_template on the export renders and tokenizes as the run's SFT did. (No training:
    the export's tokenizer files from the run's resolved config, as `loom convert --to-hf` writes them.)"""
    from loom.checkpoint.hf.tokenizer import tokenizer_export
    from loom.cli.convert import run_chat_template
    from loom.config import build_config

    own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    (tmp_path / "own.jinja").write_text(own)
    cfg = build_config(None, {"training.objective": "sft", "data.chat_template": str(tmp_path / "own.jinja")})
    out = tmp_path / "out"
    out.mkdir()
    for name, data in tokenizer_export(cfg.data.tokenizer, 256, run_chat_template(cfg)).files.items():
        (out / name).write_bytes(data)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    loom, template = ByteTokenizer(), load_template(str(tmp_path / "own.jinja"), ByteTokenizer())
    assert tok.chat_template == own != BUILTIN_TEMPLATE
    assert (
        tok.apply_chat_template(chat, tokenize=False)
        == template.render(chat)
        == "[user] 2+2?</s>[assistant] 4</s>"
    )
    assert tok.apply_chat_template(chat, return_dict=False) == ChatEncoder(template, loom).encode(chat)[0]
    exported = load_template("", HFTokenizer(str(out / "tokenizer.json")))
    assert exported.source == own

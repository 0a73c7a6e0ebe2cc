"""The tokenizer files an exported Hugging Face folder holds: the run's tokenizer as transformers loads it (the
byte tokenizer written as a tokenizer.json), or an imported checkpoint's copies of its source's, with the special
ids config.json and generation_config.json name."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from loom.checkpoint.hf.config import GENERATION_CONFIG, HF_CONFIG_COPY, HF_GENERATION_COPY, TOKENIZER_COPY
from loom.data.tokenizers import COMPANIONS, TOKENIZER_JSON, build_tokenizer, is_byte, tokenizer_files


@dataclass(frozen=True)
class ExportTokenizer:
    """What an exported folder takes from the run's tokenizer: files written beside the weights (name -> bytes)
    and the special token ids for config.json and generation_config.json (None: unknown; ``eos_ids``: every id
    that ends a generation, loom's end-of-document id first)."""

    files: dict[str, bytes] = field(default_factory=dict)
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    pad_id: int | None = None

    def config_ids(self) -> dict:
        """The ids config.json gets (a single EOS: the one loom ends documents with)."""
        ids = {
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_ids[0] if self.eos_ids else None,
            "pad_token_id": self.pad_id,
        }
        return {k: v for k, v in ids.items() if v is not None}

    def generation_config(self) -> dict:
        eos = list(self.eos_ids) if len(self.eos_ids) > 1 else (self.eos_ids[0] if self.eos_ids else None)
        ids = {"bos_token_id": self.bos_id, "eos_token_id": eos, "pad_token_id": self.pad_id}
        return {k: v for k, v in ids.items() if v is not None}


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with ``content``."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def tokenizer_export(spec: str, max_len: int, chat_template: str | None = None) -> ExportTokenizer:
    """The Hugging Face tokenizer files of loom tokenizer ``spec`` with its special ids: for the byte tokenizer
    a tokenizer.json with the same ids (``ByteTokenizer.hf_json``) and the chat template a run on it renders with
    (``chat_template`` or the built-in one), so that a fine-tuning run from the export and transformers'
    ``apply_chat_template`` find it; for a tokenizer.json its file and companions (chat template included; a run's
    own ``chat_template`` text replaces the folder's), tokenizer_config.json naming BOS / EOS as loom finds them.
    ``max_len``: the tokenizer's model_max_length where its config has none."""
    from loom.data.chat import BUILTIN_TEMPLATE

    tok = build_tokenizer(spec)
    if is_byte(spec):
        special = {
            "bos_token": tok.token(tok.bos_id),
            "eos_token": tok.token(tok.eos_id),
            "pad_token": tok.token(tok.pad_id),
        }
        conf = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "model_max_length": max_len,
            "clean_up_tokenization_spaces": False,
            "chat_template": chat_template or BUILTIN_TEMPLATE,
        }
        files = {
            TOKENIZER_JSON: tok.hf_json().encode(),
            "tokenizer_config.json": json_bytes(conf),
            "special_tokens_map.json": json_bytes(special),
        }
        return ExportTokenizer(files, tok.bos_id, (tok.eos_id,), tok.pad_id)
    files = {}
    for name, path in tokenizer_files(spec).items():
        with open(path, "rb") as fh:
            files[name] = fh.read()
    conf = tok.config()
    stated_eos = _token_name(conf.get("eos_token"))
    pad = next(
        (
            i
            for i in (tok.token_id(n) for n in (_token_name(conf.get("pad_token")), "<pad>", "<|pad|>") if n)
            if i is not None
        ),
        None,
    )
    special = {
        k: tok.token(i)
        for k, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id), ("pad_token", pad))
        if i is not None
    }
    conf = {**conf, "tokenizer_class": "PreTrainedTokenizerFast", **special}
    conf.pop("auto_map", None)  # remote code of the source's own tokenizer class: not what this folder holds
    if chat_template is not None:  # the run's own template (data.chat_template) in place of the folder's
        if "chat_template.jinja" in files:
            files["chat_template.jinja"] = chat_template.encode()
        else:
            conf["chat_template"] = chat_template
    conf.setdefault("model_max_length", max_len)
    files["tokenizer_config.json"] = json_bytes(conf)
    stated_map = _readjson_bytes(files.get("special_tokens_map.json"))
    files["special_tokens_map.json"] = json_bytes({**stated_map, **special})
    eos = [tok.eos_id]
    stated = tok.token_id(stated_eos) if stated_eos else None
    if stated is not None and stated != tok.eos_id:  # e.g. a chat model's end-of-turn token
        eos.append(stated)
    return ExportTokenizer(files, tok.bos_id, tuple(eos), pad)


def _readjson_bytes(data: bytes | None) -> dict:
    try:
        out = json.loads(data) if data else {}
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def imported_tokenizer_export(ckpt: str) -> ExportTokenizer:
    """An imported checkpoint's tokenizer and special ids as its source folder had them (its copies, verbatim)."""
    files = {}
    folder = os.path.join(ckpt, TOKENIZER_COPY)
    for name in (TOKENIZER_JSON, *COMPANIONS):
        if os.path.isfile(os.path.join(folder, name)):
            with open(os.path.join(folder, name), "rb") as fh:
                files[name] = fh.read()
    if os.path.isfile(os.path.join(ckpt, HF_GENERATION_COPY)):
        with open(os.path.join(ckpt, HF_GENERATION_COPY), "rb") as fh:
            files[GENERATION_CONFIG] = fh.read()
    with open(os.path.join(ckpt, HF_CONFIG_COPY)) as fh:
        cfg = json.load(fh)
    eos = cfg.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)
    return ExportTokenizer(files, cfg.get("bos_token_id"), eos, cfg.get("pad_token_id"))


def export_file_names(tokenizer: ExportTokenizer | None) -> tuple[str, ...]:
    """The files besides the weights and config.json that an export with ``tokenizer`` writes."""
    if tokenizer is None:
        return ()
    return tuple(dict.fromkeys([*tokenizer.files, GENERATION_CONFIG]))

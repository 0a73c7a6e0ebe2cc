"""Chat templates (loom.data.chat) against transformers' ``apply_chat_template``: the same text and token ids for
ChatML (Qwen), Llama-3 and Mistral style templates in tokenizer folders built here, the same assistant mask as
``return_assistant_tokens_mask`` for ``{% generation %}`` templates, and the assistant mask's effect on the loss:
only assistant tokens count."""

from __future__ import annotations

import json
import os

import pytest
import torch

from loom.config.errors import ConfigError
from loom.data.chat import (
    BUILTIN,
    FLAG_LOSS,
    FLAG_START,
    ChatEncoder,
    ChatError,
    ChatTemplate,
    assistant_spans,
    load_template,
)
from loom.data.tokenizers import ByteTokenizer, HFTokenizer
from loom.numerics import IGNORE, cross_entropy_sum

tokenizers = pytest.importorskip("tokenizers")

CORPUS = [
    "You are a helpful assistant.",
    "What is the capital of France? Paris is the capital.",
    "def add(a, b):\n    return a + b",
    "Tell me a joke about cats. Why did the cat sit on the computer?",
    "Voilà, a naïve café in 東京 🙂",
    'Thanks! You\'re welcome. <b>bold</b> & "quotes"',
] * 4

CHATML = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# TRL's style of training template: the assistant's turns inside {% generation %} blocks
CHATML_GENERATION = """{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# tojson as transformers defines it (no HTML escaping, non-ASCII kept), namespace, loop controls
JSONISH = """{%- set ns = namespace(n=0) %}
{%- for message in messages %}
    {%- if message.role == 'tool' %}{% continue %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
    {{- '<|im_start|>' + message.role + ' ' + ns.n|string + '\\n' + message | tojson + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant ' + (ns.n + 1)|string + '\\n' }}{%- endif %}
"""

STYLES = {
    "chatml": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
        CHATML,
        False,
    ),
    "llama3": (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        LLAMA3,
        False,
    ),
    "mistral": (
        ["<unk>", "<s>", "</s>"],
        {
            "bos_token": {
                "__type": "AddedToken",
                "content": "<s>",
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            },
            "eos_token": "</s>",
            "unk_token": "<unk>",
        },
        MISTRAL,
        True,
    ),
    "chatml_generation": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        CHATML_GENERATION,
        False,
    ),
    "jsonish": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], {"eos_token": "<|im_end|>"}, JSONISH, False),
}

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital. Voilà!"},
    {"role": "user", "content": 'Tell me a joke about cats, in <b>bold</b> & "quotes".'},
    {"role": "assistant", "content": "Why did the cat sit on the computer? 🙂 To keep an eye on the mouse."},
]


def build_folder(folder, style: str, *, as_file: bool = False) -> str:
    """A tiny tokenizer folder of ``style``: tokenizer.json (a BPE trained here) and tokenizer_config.json with the
    special tokens and the chat template (``as_file``: in chat_template.jinja instead)."""
    specials, config, template, metaspace = STYLES[style]
    tk = tokenizers
    os.makedirs(folder, exist_ok=True)
    if metaspace:  # sentencepiece-like, as Mistral's and Llama 2's: ▁ for spaces, byte fallback
        tok = tk.Tokenizer(tk.models.BPE(byte_fallback=True, unk_token="<unk>"))
        tok.pre_tokenizer = tk.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = tk.decoders.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = tk.trainers.BpeTrainer(
            vocab_size=500,
            show_progress=False,
            special_tokens=specials + [f"<0x{b:02X}>" for b in range(256)],
        )
    else:  # byte-level, as GPT-2's, Llama 3's and Qwen's
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=500,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    conf = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{k: v for k, v in config.items() if v is not None},
    }
    if as_file:
        with open(os.path.join(folder, "chat_template.jinja"), "w") as fh:
            fh.write(template)
    else:
        conf["chat_template"] = template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as fh:
        json.dump(conf, fh)
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {style: build_folder(root / style, style, as_file=style == "llama3") for style in STYLES}


def hf_reference(folder, messages, **kwargs):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return text, list(out["input_ids"]), tok


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_text_and_ids_equal_transformers(folders, style, generation_prompt):
    messages = CONVERSATION[:-1] if generation_prompt else CONVERSATION
    text, ids, _ = hf_reference(folders[style], messages, add_generation_prompt=generation_prompt)
    tokenizer = HFTokenizer(folders[style])
    template = load_template("", tokenizer)
    assert template.render(messages, add_generation_prompt=generation_prompt) == text
    enc = ChatEncoder(template, tokenizer)
    assert enc._enc.encode(text)[0] == ids
    if not generation_prompt:
        assert enc.encode(messages)[0] == ids


def test_a_template_file_and_named_templates(folders, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(CHATML)
    tokenizer = HFTokenizer(folders["llama3"])  # its folder's template is Llama 3's; the file wins
    assert load_template(str(path), tokenizer).render(CONVERSATION).startswith("<|im_start|>system\n")
    assert load_template("", tokenizer).origin.endswith("chat_template.jinja")
    folder = build_folder(tmp_path / "named", "chatml")
    conf = json.loads(open(os.path.join(folder, "tokenizer_config.json")).read())
    conf["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": MISTRAL}]
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as fh:
        json.dump(conf, fh)
    assert load_template("", HFTokenizer(folder)).source == MISTRAL
    del conf["chat_template"]
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as fh:
        json.dump(conf, fh)
    with pytest.raises(ConfigError, match="data.chat_template.*no chat template"):
        load_template("", HFTokenizer(folder))
    with pytest.raises(ConfigError, match="no such file"):
        load_template(str(tmp_path / "missing.jinja"), tokenizer)


def test_generation_blocks_give_transformers_assistant_mask(folders):
    _, ids, tok = hf_reference(folders["chatml_generation"], CONVERSATION)
    ref = tok.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    tokenizer = HFTokenizer(folders["chatml_generation"])
    got_ids, flags = ChatEncoder(load_template("", tokenizer), tokenizer).encode(CONVERSATION)
    assert got_ids == ids
    assert [f & FLAG_LOSS for f in flags] == list(ref["assistant_masks"])


def _trained_texts(decode, ids, flags) -> list[str]:
    """The trained stretches of a conversation, each decoded with ``decode(ids)``."""
    out, cur = [], []
    for i, f in zip(ids, flags):
        if f & FLAG_LOSS:
            cur.append(i)
        elif cur:
            out.append(cur)
            cur = []
    return [decode(s) for s in out + ([cur] if cur else [])]


@pytest.mark.parametrize(
    "style,turn_end", [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>"), ("mistral", "</s>")]
)
def test_every_assistant_turn_and_its_end_token_is_trained(folders, style, turn_end):
    tokenizer = HFTokenizer(folders[style])
    ids, flags = ChatEncoder(load_template("", tokenizer), tokenizer).encode(CONVERSATION)
    assert flags[0] == FLAG_START
    hf = tokenizers.Tokenizer.from_file(tokenizer.path)
    texts = _trained_texts(lambda s: hf.decode(s, skip_special_tokens=False), ids, flags)
    assert len(texts) == 2  # both assistant turns, nothing of the system or user messages
    for text, message in zip(texts, (CONVERSATION[2], CONVERSATION[4])):
        assert text.strip().endswith(turn_end)
        assert text.strip()[: -len(turn_end)].strip() == message["content"]


def test_builtin_template_for_the_byte_tokenizer():
    tok = ByteTokenizer()
    template = load_template("", tok)
    assert template.origin == BUILTIN
    text = template.render(CONVERSATION)
    assert text.startswith("<s><|system|>\nYou are a helpful assistant.\n<|user|>\n")
    assert "<|assistant|>\nParis is the capital. Voilà!</s>\n" in text
    ids, flags = ChatEncoder(template, tok).encode(CONVERSATION)
    assert ids[0] == tok.bos_id and ids.count(tok.eos_id) == 2
    assert len(ids) == len(text.encode()) - (3 - 1) - 2 * (4 - 1)  # <s> and two </s> are one id each
    trained = bytes(i for i, f in zip(ids, flags) if f & FLAG_LOSS and i < 256).decode()
    assert trained == CONVERSATION[2]["content"] + CONVERSATION[4]["content"]
    assert sum(1 for i, f in zip(ids, flags) if f & FLAG_LOSS and i == tok.eos_id) == 2  # each turn's end
    # a prompt-completion pair trains its completion only; 'all' trains every token but the first
    _, flags_pc = ChatEncoder(template, tok).encode(CONVERSATION, first=3)
    assert (
        bytes(i for i, f in zip(ids, flags_pc) if f & FLAG_LOSS and i < 256).decode()
        == CONVERSATION[4]["content"]
    )
    _, flags_all = ChatEncoder(template, tok, "all").encode(CONVERSATION)
    assert flags_all[0] == FLAG_START and all(f == FLAG_LOSS for f in flags_all[1:])


def test_template_errors_are_chat_errors(folders):
    tokenizer = HFTokenizer(folders["mistral"])
    enc = ChatEncoder(load_template("", tokenizer), tokenizer)
    with pytest.raises(ChatError, match="roles must alternate"):
        enc.encode([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    # a template that moves the system prompt into the last user turn (Mistral v0.3) is not prefix-stable
    moving = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'user' and loop.last %}[{{ m.content }}|sys]"
        "{% elif m.role == 'user' %}[{{ m.content }}]{% elif m.role == 'assistant' %}"
        "{{ m.content }}</s>{% endif %}{% endfor %}",
        "x",
        (),
    )
    with pytest.raises(ChatError, match="generation"):
        assistant_spans(moving, CONVERSATION[1:3])


def test_only_assistant_tokens_contribute_to_the_loss(folders):
    """Perturbing the labels (and the logits) of every prompt, system and user position leaves the summed loss
    unchanged: only the assistant's tokens count."""
    tokenizer = HFTokenizer(folders["chatml"])
    ids, flags = ChatEncoder(load_template("", tokenizer), tokenizer).encode(CONVERSATION)
    targets = torch.tensor(ids)[1:][None]  # (1, S): the next token at every position
    trained = (torch.tensor(list(flags))[1:] & FLAG_LOSS).bool()[None]  # (1, S)
    assert 0 < int(trained.sum()) < trained.numel()
    torch.manual_seed(0)
    logits = torch.randn(1, len(ids) - 1, tokenizer.vocab_size)  # (1, S, V)
    base = cross_entropy_sum(logits, torch.where(trained, targets, IGNORE))
    perturbed = torch.where(trained, targets, torch.randint_like(targets, tokenizer.vocab_size))
    assert not torch.equal(perturbed, targets)
    assert torch.equal(cross_entropy_sum(logits, torch.where(trained, perturbed, IGNORE)), base)
    noisy = logits.clone()
    noisy[~trained] += 10 * torch.randn(int((~trained).sum()), tokenizer.vocab_size)
    assert torch.equal(cross_entropy_sum(noisy, torch.where(trained, targets, IGNORE)), base)
    # and the assistant positions do count
    noisy = logits.clone()
    noisy[trained] += 1.0 * torch.randn(int(trained.sum()), tokenizer.vocab_size)
    assert not torch.equal(cross_entropy_sum(noisy, torch.where(trained, targets, IGNORE)), base)

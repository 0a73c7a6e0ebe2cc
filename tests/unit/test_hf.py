"""Hugging Face interop: logits equal transformers', HF -> loom checkpoint -> HF is lossless, training
starts from an HF folder with HF's weights, and user mistakes give one-line errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors import safe_open  # noqa: E402

from loom.checkpoint.hf.dcp_import import import_hf_to_dcp  # noqa: E402
from loom.checkpoint.hf.export import export_hf  # noqa: E402
from loom.checkpoint.hf.reader import llama_args_from_hf, load_hf_weights, weight_files  # noqa: E402
from loom.checkpoint.manager import load_model_only, verify  # noqa: E402
from loom.cli.main import main as loom_main  # noqa: E402
from loom.config.errors import ConfigError, UserError  # noqa: E402
from loom.models.common.rope import RopeScaling  # noqa: E402
from loom.models.llama import Llama  # noqa: E402
from tests.tiny import tiny_args  # noqa: E402

VOCAB = 384
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# compared after the save: what a reader of the folder sees
CONFIG_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "rope_parameters",
    "dtype",
    "architectures",
)


def random_hf_llama(tied: bool, seed: int = 0):
    """A small LlamaForCausalLM with llama3 RoPE scaling. Weights are widened from HF's 0.02 init (and
    norms moved off 1) so that a wrong tensor or RoPE detail shows up far above the tolerance."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        rope_theta=10000.0,
        rope_scaling=dict(LLAMA3),
        tie_word_embeddings=tied,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5) if p.ndim == 1 else p.normal_(0.0, 0.1)
    return model


def save_hf(model, folder, shard: str | None = None) -> str:
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kw)
    return str(folder)


def read_all(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, path in weight_files(folder).items():
        with safe_open(path, framework="pt") as fh:
            out[name] = fh.get_tensor(name)
    return out


def loom_from_hf(folder: str, **overrides) -> Llama:
    model = Llama(llama_args_from_hf(folder).with_(**overrides))
    load_hf_weights(model, folder)
    return model.eval()


# ---- logits ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("max_seq_len", [None, 100], ids=["table-from-config", "table-exactly-seq"])
def test_logits_match_transformers(tmp_path, tied, max_seq_len):
    hf = random_hf_llama(tied)
    folder = save_hf(hf, tmp_path / "hf")
    args = llama_args_from_hf(folder)
    assert args.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32) and args.rope_theta == 10000.0
    assert (args.tie_embeddings, args.max_seq_len, args.norm_eps) == (tied, 256, 1e-5)
    model = loom_from_hf(folder, **({"max_seq_len": max_seq_len} if max_seq_len else {}))
    tokens = torch.randint(0, VOCAB, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits  # (B, S, V)
    assert theirs.abs().max() > 1.0  # logits large enough for the tolerance to mean something
    assert (ours - theirs).abs().max() < 1e-4


def test_untied_model_starts_from_tied_embeddings(tmp_path):
    folder = save_hf(random_hf_llama(tied=True), tmp_path / "hf")
    model = loom_from_hf(folder, tie_embeddings=False)
    assert model.output.weight is not model.tok_embeddings.weight
    assert torch.equal(model.output.weight, read_all(folder)["model.embed_tokens.weight"])


def test_tied_model_refuses_a_separate_head(tmp_path):
    folder = save_hf(random_hf_llama(tied=False), tmp_path / "hf")
    model = Llama(llama_args_from_hf(folder).with_(tie_embeddings=True))
    with pytest.raises(ConfigError, match="model.tie_embeddings.*own lm_head"):
        load_hf_weights(model, folder)


def test_wrong_vocabulary_names_the_tensor(tmp_path):
    folder = save_hf(random_hf_llama(tied=False), tmp_path / "hf")
    model = Llama(llama_args_from_hf(folder).with_(vocab_size=512))
    with pytest.raises(UserError, match=r"model.embed_tokens.weight has shape \[384, 64\].*\[512, 64\]"):
        load_hf_weights(model, folder)


# ---- round trips -------------------------------------------------------------------------------


def assert_same_folder(a: str, b: str, fields=CONFIG_FIELDS) -> None:
    """Bitwise-equal tensors under the same names, and configs that transformers reads the same way."""
    ta, tb = read_all(a), read_all(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name
    ca, cb = transformers.AutoConfig.from_pretrained(a), transformers.AutoConfig.from_pretrained(b)
    for field in fields:
        assert getattr(ca, field) == getattr(cb, field), field
    assert llama_args_from_hf(a) == llama_args_from_hf(b)


@pytest.mark.parametrize(
    "tied,shard", [(True, None), (False, "20KB")], ids=["tied-single-file", "untied-sharded"]
)
def test_round_trip_through_cli(tmp_path, tied, shard, capsys):
    hf = random_hf_llama(tied)
    src = save_hf(hf, tmp_path / "hf", shard)
    assert os.path.isfile(os.path.join(src, "model.safetensors.index.json")) == bool(shard)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert loom_main(["convert", "--from-hf", src, "--to", ckpt]) == 0
    verify(ckpt)  # a complete loom checkpoint: marker, DCP metadata, hashes
    extra = ["--max-shard-size", "20KB"] if shard else []
    assert loom_main(["convert", "--from", ckpt, "--to-hf", out, *extra]) == 0
    assert_same_folder(src, out)
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json")) == bool(shard)
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)


def test_imported_checkpoint_loads_into_a_loom_model(tmp_path):
    src = save_hf(random_hf_llama(tied=False), tmp_path / "hf")
    ckpt = str(tmp_path / "ckpt")
    args = import_hf_to_dcp(src, ckpt)
    with open(os.path.join(ckpt, "trainer_state.json")) as fh:
        assert json.load(fh)["step"] == 0
    model = Llama(args)
    load_model_only(ckpt, model)
    stored = read_all(src)
    assert torch.equal(model.layers["1"].feed_forward.w3.weight, stored["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(model.output.weight, stored["lm_head.weight"])


def test_export_shards_by_size_and_indexes_every_tensor(tmp_path):
    src = save_hf(random_hf_llama(tied=False), tmp_path / "hf")
    model = loom_from_hf(src)
    names = export_hf(model.state_dict(), model.args, str(tmp_path / "out"), max_shard_bytes=40_000)
    with open(tmp_path / "out" / "model.safetensors.index.json") as fh:
        index = json.load(fh)
    assert len(names) > 1 and sorted(set(index["weight_map"].values())) == sorted(names)
    stored = read_all(src)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in stored.values())
    for name in names:  # no file above the limit unless it holds one tensor that is larger by itself
        with safe_open(str(tmp_path / "out" / name), framework="pt") as fh:
            keys = list(fh.keys())
            size = sum(fh.get_tensor(k).numel() * 4 for k in keys)
        assert size <= 40_000 or len(keys) == 1
    with pytest.raises(UserError, match="already holds a model"):
        export_hf(model.state_dict(), model.args, str(tmp_path / "out"))


# ---- training from a Hugging Face folder -------------------------------------------------------


def hf_loss(hf, micro_batches) -> float:
    """The trainer's loss definition (token-mean over the step) computed with transformers."""
    total, count = 0.0, 0
    with torch.no_grad():
        for mb in micro_batches:
            logits = hf(mb.inputs).logits  # (B, S, V)
            total += F.cross_entropy(
                logits.flatten(0, 1), mb.labels.flatten(), ignore_index=-100, reduction="sum"
            ).item()
            count += int((mb.labels != -100).sum())
    return total / count


def train_from_hf(tmp_path, src: str):
    """Two training steps with model.init_from ``src`` on a small text file; returns the trainer, step 1's
    micro-batches and the records."""
    from loom.cli.preflight import load_config
    from loom.train.trainer import Trainer

    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox {i * 7 % 13} jumps\n" for i in range(600)))
    cfg, _ = load_config(
        tiny_args(
            tmp_path / "run",
            **{
                "run.device": "cpu",
                "model.init_from": src,
                "data.source": str(text),
                "training.steps": 2,
                "training.global_batch_size": 4,
                "optimizer.warmup_steps": 0,
                "metrics.progress": "false",
                "checkpoint.at_end": None,
            },
        )
    )
    trainer = Trainer(cfg)
    state = trainer.loader.state_dict()
    first = trainer.loader.next_step().micro_batches  # peek at step 1's batch, then rewind
    trainer.loader.load_state_dict(state)
    return trainer, first, trainer.fit()


def test_training_starts_from_hf_weights_and_exports_back(tmp_path, capsys):
    hf = random_hf_llama(tied=False)
    src = save_hf(hf, tmp_path / "hf")
    trainer, first, records = train_from_hf(tmp_path, src)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["loss"] == pytest.approx(hf_loss(hf, first), rel=1e-5)
    assert records[1]["loss"] != records[0]["loss"]  # it did train

    # the final checkpoint exports through the run's config.toml (flavor from init_from, byte tokenizer)
    ckpt = os.path.join(tmp_path, "run", "checkpoints", "step_00000002")
    out = str(tmp_path / "out")
    assert loom_main(["convert", "--from", ckpt, "--to-hf", out]) == 0
    exported = read_all(out)
    trained = trainer.parts[0].state_dict()
    assert torch.equal(
        exported["model.layers.0.self_attn.k_proj.weight"], trained["layers.0.attention.wk.weight"]
    )
    assert torch.equal(exported["lm_head.weight"], trained["output.weight"])
    assert llama_args_from_hf(out) == llama_args_from_hf(src)


def test_training_starts_from_an_imported_checkpoint(tmp_path):
    """`loom convert --from-hf` then `loom train --model.init_from CKPT`: the shape and the weights come from the
    checkpoint (the first loss is transformers' on the same batch), and the trained run exports back."""
    hf = random_hf_llama(tied=False)
    ckpt = str(tmp_path / "ckpt")
    import_hf_to_dcp(save_hf(hf, tmp_path / "hf"), ckpt)
    trainer, first, records = train_from_hf(tmp_path, ckpt)
    assert trainer.model_args.n_layers == 2 and trainer.model_args.vocab_size == VOCAB
    assert records[0]["loss"] == pytest.approx(hf_loss(hf, first), rel=1e-5)
    out = str(tmp_path / "out")
    assert (
        loom_main(
            [
                "convert",
                "--from",
                os.path.join(tmp_path, "run", "checkpoints", "step_00000002"),
                "--to-hf",
                out,
            ]
        )
        == 0
    )
    assert llama_args_from_hf(out) == llama_args_from_hf(ckpt)


def test_an_imported_checkpoint_names_the_command_that_trains_from_it(tmp_path, capsys):
    """Resuming an import into the default model is one line pointing at --model.init_from; its config.toml holds
    only what it knows, so it also serves as --config."""
    from loom.config import build_config

    ckpt = str(tmp_path / "ckpt")
    import_hf_to_dcp(save_hf(random_hf_llama(tied=True), tmp_path / "hf"), ckpt)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        loom_main(["train", *tiny_args(tmp_path / "run"), "--checkpoint.resume", ckpt])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert (
        f"checkpoint.resume {ckpt}: a weights-only checkpoint" in err and f"--model.init_from {ckpt}," in err
    )
    cfg = build_config(
        os.path.join(ckpt, "config.toml"), {"training.steps": "2"}
    )  # the default warmup shrinks
    assert (cfg.model.init_from, cfg.model.vocab_size, cfg.optimizer.warmup_steps) == (ckpt, VOCAB, 0)
    with pytest.raises(ConfigError, match="model.tie_embeddings"):  # a tied checkpoint has no head of its own
        load_hf_weights(
            Llama(llama_args_from_hf(ckpt).with_(tie_embeddings=True)),
            save_hf(random_hf_llama(tied=False), tmp_path / "untied"),
        )
    model = Llama(llama_args_from_hf(ckpt).with_(n_layers=1))
    with pytest.raises(ConfigError, match="holds tensors with no place in this model: layers.1"):
        load_hf_weights(model, ckpt)
    trainer_folder = save_hf(
        random_hf_llama(tied=True), tmp_path / "checkpoint-500"
    )  # transformers' Trainer's
    (tmp_path / "checkpoint-500" / "trainer_state.json").write_text("{}")
    assert llama_args_from_hf(trainer_folder) == llama_args_from_hf(
        ckpt
    )  # a Hugging Face folder all the same


# ---- Mixtral (loom's mixture of experts) -------------------------------------------------------


def random_hf_mixtral(seed: int = 0):
    """A small MixtralForCausalLM (4 experts, top 2), weights widened as for the Llama above."""
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5) if p.ndim == 1 else p.normal_(0.0, 0.1)
    return model


def test_mixtral_logits_match_transformers(tmp_path):
    hf = random_hf_mixtral()
    folder = save_hf(hf, tmp_path / "hf")
    args = llama_args_from_hf(folder)
    assert (args.moe_experts, args.moe_top_k, args.expert_ffn_dim) == (4, 2, 96)
    model = loom_from_hf(folder)
    stored = read_all(folder)  # one (H, E) tensor per expert, loom stacks them transposed
    assert torch.equal(
        model.layers["1"].feed_forward.experts.w1[2],
        stored["model.layers.1.block_sparse_moe.experts.2.w1.weight"].T,
    )
    tokens = torch.randint(0, VOCAB, (2, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits  # (B, S, V)
    assert theirs.abs().max() > 1.0
    assert (ours - theirs).abs().max() < 1e-4


def test_mixtral_round_trip_through_cli(tmp_path):
    hf = random_hf_mixtral()
    src = save_hf(hf, tmp_path / "hf", "40KB")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert loom_main(["convert", "--from-hf", src, "--to", ckpt]) == 0
    assert loom_main(["convert", "--from", ckpt, "--to-hf", out, "--max-shard-size", "40KB"]) == 0
    # transformers' Mixtral leaves head_dim null (hidden / heads); loom writes the value: same model
    mixtral_fields = [f for f in CONFIG_FIELDS if f != "head_dim"] + [
        "num_local_experts",
        "num_experts_per_tok",
    ]
    assert_same_folder(src, out, mixtral_fields)
    back = transformers.MixtralForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)


@pytest.mark.slow
def test_training_starts_from_mixtral_weights_and_exports_back(tmp_path):
    """model.init_from a Mixtral folder: the experts, top-k and expert width come from it; the first step's loss
    is transformers' on the same batch; the trained checkpoint exports as a Mixtral again."""
    hf = random_hf_mixtral()
    src = save_hf(hf, tmp_path / "hf")
    trainer, first, records = train_from_hf(tmp_path, src)
    assert (trainer.model_args.moe_experts, trainer.model_args.moe_top_k) == (4, 2)
    assert records[0]["loss"] == pytest.approx(hf_loss(hf, first), rel=1e-5)
    assert records[1]["loss"] != records[0]["loss"]
    ckpt = os.path.join(tmp_path, "run", "checkpoints", "step_00000002")
    out = str(tmp_path / "out")
    assert loom_main(["convert", "--from", ckpt, "--to-hf", out]) == 0
    exported, trained = read_all(out), trainer.parts[0].state_dict()
    assert torch.equal(
        exported["model.layers.1.block_sparse_moe.experts.3.w2.weight"],
        trained["layers.1.feed_forward.experts.w2"][3].T,
    )
    assert torch.equal(
        exported["model.layers.0.block_sparse_moe.gate.weight"],
        trained["layers.0.feed_forward.router.gate.weight"],
    )
    assert llama_args_from_hf(out) == llama_args_from_hf(src)


def test_mixtral_folder_errors(tmp_path):
    cfg = random_hf_mixtral().config.to_dict()
    with pytest.raises(ConfigError, match="sliding_window = 4096 is not supported"):
        llama_args_from_hf(write_config(tmp_path / "window", {**cfg, "sliding_window": 4096}))
    from loom.cli.preflight import load_config
    from loom.data import build_tokenizer
    from loom.resolve import resolve_model_args

    src = save_hf(random_hf_mixtral(), tmp_path / "hf")
    run, _ = load_config(["--model.init_from", src, "--model.moe_experts", "8"])
    with pytest.raises(ConfigError, match="model.moe_experts.*holds 4 experts"):
        resolve_model_args(run, build_tokenizer(run.data.tokenizer))
    run, _ = load_config(["--model.init_from", src, "--model.moe_ffn_dim", "128"])
    with pytest.raises(ConfigError, match="model.moe_ffn_dim.*96 wide"):
        resolve_model_args(run, build_tokenizer(run.data.tokenizer))


# ---- user errors -------------------------------------------------------------------------------


def write_config(folder, cfg: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return str(folder)


def test_missing_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"^model.init_from = .*nope': folder not found"):
        llama_args_from_hf(str(tmp_path / "nope"))


def test_folder_without_config(tmp_path):
    with pytest.raises(ConfigError, match=r"^model.init_from = .*: no config.json in this folder"):
        llama_args_from_hf(str(tmp_path))


def test_non_llama_architecture(tmp_path):
    folder = write_config(tmp_path / "gpt2", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ConfigError, match="architecture GPT2LMHeadModel is not supported"):
        llama_args_from_hf(folder)


def test_unsupported_rope_type(tmp_path):
    cfg = random_hf_llama(tied=True).config.to_dict()
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="RoPE type 'yarn' is not supported"):
        llama_args_from_hf(write_config(tmp_path / "yarn", cfg))


def test_transformers4_style_rope_keys(tmp_path):
    """Older config.json files keep rope_theta at the top and the scaling under rope_scaling."""
    cfg = random_hf_llama(tied=True).config.to_dict()
    del cfg["rope_parameters"]
    cfg.update(rope_theta=500000.0, rope_scaling={**LLAMA3, "factor": 32.0})
    args = llama_args_from_hf(write_config(tmp_path / "v4", cfg))
    assert args.rope_theta == 500000.0 and args.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 32)


def test_cli_errors_are_one_line_with_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        loom_main(["convert", "--from-hf", str(tmp_path / "nope"), "--to", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and "--from-hf" in err and "folder not found" in err
    with pytest.raises(SystemExit) as exit_info:
        loom_main(["convert", "--from", str(tmp_path), "--to-hf", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "no COMPLETE.json" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "ckpt") and not os.path.exists(tmp_path / "out")


def test_cli_help_prints_usage(capsys):
    assert loom_main(["convert", "--help"]) == 0
    assert "loom convert --from-hf HF_FOLDER --to CKPT_FOLDER" in capsys.readouterr().out


def test_export_with_the_wrong_flavor_names_the_mismatch(tmp_path, capsys):
    src = save_hf(random_hf_llama(tied=True), tmp_path / "hf")
    ckpt = str(tmp_path / "ckpt")
    import_hf_to_dcp(src, ckpt)
    with pytest.raises(SystemExit) as exit_info:
        loom_main(["convert", "--from", ckpt, "--to-hf", str(tmp_path / "out"), "--flavor", "125M"])
    assert exit_info.value.code == 2
    assert (
        "tok_embeddings.weight has shape [384, 64] but the config gives [384, 768]" in capsys.readouterr().err
    )

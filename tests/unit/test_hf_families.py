"""Hugging Face families besides Llama 3 and Mixtral: Llama 2, Mistral (sliding window), Qwen2 (q/k/v biases) and
Qwen3 (q/k norms, head_dim apart from hidden / heads). Each one's logits equal transformers' (fp32), HF -> loom ->
HF gives the same tensors and config back, and training starts from such a folder."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from loom.checkpoint.hf.config import hf_architecture  # noqa: E402
from loom.checkpoint.hf.export import export_hf  # noqa: E402
from loom.checkpoint.hf.reader import llama_args_from_hf  # noqa: E402
from loom.cli.main import main as loom_main  # noqa: E402
from loom.config.errors import ConfigError, UserError  # noqa: E402
from tests.unit.test_hf import (  # noqa: E402
    CONFIG_FIELDS,
    VOCAB,
    assert_same_folder,
    hf_loss,
    loom_from_hf,
    read_all,
    save_hf,
    train_from_hf,
    write_config,
)

WINDOW = 8  # Mistral's window in these tests: shorter than every test sequence
_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
# family -> (config class, model class, config overrides)
FAMILIES = {
    "llama2": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(rope_theta=1e6, sliding_window=WINDOW, tie_word_embeddings=False),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(rope_theta=1e6, head_dim=24, tie_word_embeddings=False),
    ),
    "qwen3-tied": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(rope_theta=1e6, head_dim=24, tie_word_embeddings=True),
    ),
}
# what each family's config.json says beyond CONFIG_FIELDS (Qwen2's config has no head_dim: hidden / heads)
EXTRA_FIELDS = {
    "llama2": ("model_type",),
    "mistral": ("model_type", "sliding_window"),
    "qwen2": ("model_type", "use_sliding_window", "sliding_window", "layer_types"),
    "qwen3": ("model_type", "use_sliding_window", "sliding_window", "layer_types", "attention_bias"),
    "qwen3-tied": ("model_type", "layer_types"),
}


def random_hf(family: str, seed: int = 0, **overrides):
    """A small model of ``family`` with its weights widened as ``test_hf.random_hf_llama``'s (biases and q/k norms
    included) so that a wrong tensor, mask or norm shows up far above the tolerance."""
    config_cls, model_cls, kw = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**{**_SHAPE, **kw, **overrides})
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5) if p.ndim == 1 else p.normal_(0.0, 0.1)
    return model


def tokens_of(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ---- config mapping ----------------------------------------------------------------------------


def test_each_family_maps_to_its_switches(tmp_path):
    expect = {
        "llama2": (False, False, 0, 16),
        "mistral": (False, False, WINDOW, 16),
        "qwen2": (True, False, 0, 16),
        "qwen3": (False, True, 0, 24),
    }
    for family, (bias, qk_norm, window, head_dim) in expect.items():
        args = llama_args_from_hf(save_hf(random_hf(family), tmp_path / family))
        assert (args.attention_bias, args.qk_norm, args.sliding_window, args.head_dim) == (
            bias,
            qk_norm,
            window,
            head_dim,
        ), family
        assert args.rope_scaling is None and args.rope_theta == FAMILIES[family][2]["rope_theta"]
    assert llama_args_from_hf(save_hf(random_hf("qwen2"), tmp_path / "q2")).tie_embeddings


# ---- logits ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(tmp_path, family):
    hf = random_hf(family)
    model = loom_from_hf(save_hf(hf, tmp_path / "hf"))
    tokens = tokens_of(2, 40)  # 5 windows long for Mistral
    with torch.no_grad():
        theirs = hf(tokens).logits  # (B, S, V)
        assert theirs.abs().max() > 1.0  # logits large enough for the tolerance to mean something
        for backend in ("sdpa", "flash"):  # flash: loom's op (its reference on a CPU without the interpreter)
            for block in model.layers.values():
                block.attention.backend = backend
            assert (model(tokens) - theirs).abs().max() < 1e-4, backend


def test_mistral_window_matters(tmp_path):
    """The same weights attending over the whole sequence give other logits: the window is in effect."""
    hf = random_hf("mistral")
    folder = save_hf(hf, tmp_path / "hf")
    tokens = tokens_of(1, 40)
    with torch.no_grad():
        full = loom_from_hf(folder, sliding_window=0)(tokens)
        assert (full - hf(tokens).logits)[:, WINDOW:].abs().max() > 1e-2
        assert (full - hf(tokens).logits)[
            :, :WINDOW
        ].abs().max() < 1e-4  # the first window sees the same keys


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_packed_documents_with_a_window_match_each_document_alone(tmp_path, backend):
    """Packed documents (per-document positions) under a sliding window: each document's logits are transformers'
    on that document alone, documents longer and shorter than the window alike."""
    hf = random_hf("mistral")
    model = loom_from_hf(save_hf(hf, tmp_path / "hf"), attention=backend)
    lengths = [13, 5, 22]  # the window is 8
    tokens = tokens_of(1, sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]  # (1, S)
    with torch.no_grad():
        ours = model(tokens, positions)  # (1, S, V)
        for doc, start in zip(tokens.split(lengths, dim=1), torch.tensor([0, *lengths]).cumsum(0)):
            theirs = hf(doc).logits  # (1, n, V)
            assert (ours[:, start : start + doc.shape[1]] - theirs).abs().max() < 1e-4


# ---- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_gives_the_folder_back(tmp_path, family):
    """HF -> loom -> HF: the same tensors under the same names, and the same config to transformers (the
    family's architecture and model_type, its window and layer types); transformers loads it with the same logits."""
    hf = random_hf(family)
    src = save_hf(hf, tmp_path / "hf")
    model = loom_from_hf(src)
    out = str(tmp_path / "out")
    export_hf(model.state_dict(), model.args, out)
    fields = [f for f in CONFIG_FIELDS if not (family == "qwen2" and f == "head_dim")] + list(
        EXTRA_FIELDS[family]
    )
    assert_same_folder(src, out, fields)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf)
    tokens = tokens_of(1, 30, seed=2)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)


def test_round_trip_through_cli_keeps_the_window(tmp_path):
    hf = random_hf("mistral")
    src = save_hf(hf, tmp_path / "hf", "20KB")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert loom_main(["convert", "--from-hf", src, "--to", ckpt]) == 0
    assert llama_args_from_hf(ckpt).sliding_window == WINDOW
    assert loom_main(["convert", "--from", ckpt, "--to-hf", out]) == 0
    assert_same_folder(src, out, CONFIG_FIELDS + EXTRA_FIELDS["mistral"])


def test_loom_switches_choose_the_family():
    from loom.models.llama import FLAVORS

    debug = FLAVORS["debug"]
    assert hf_architecture(debug) == "LlamaForCausalLM"
    assert hf_architecture(debug.with_(sliding_window=64)) == "MistralForCausalLM"
    assert hf_architecture(debug.with_(attention_bias=True, sliding_window=64)) == "Qwen2ForCausalLM"
    assert hf_architecture(debug.with_(qk_norm=True)) == "Qwen3ForCausalLM"
    assert hf_architecture(FLAVORS["debug_moe"]) == "MixtralForCausalLM"
    with pytest.raises(UserError, match="q/k norms with q/k/v biases"):
        hf_architecture(debug.with_(qk_norm=True, attention_bias=True))


def test_qwen_with_a_window_in_every_layer_round_trips(tmp_path):
    """A Qwen2 with its window in every layer (max_window_layers 0) is one loom window; the export says so again."""
    hf = random_hf("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)
    src = save_hf(hf, tmp_path / "hf")
    model = loom_from_hf(src)
    assert model.args.sliding_window == WINDOW
    tokens = tokens_of(1, 30)
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max() < 1e-4
    export_hf(model.state_dict(), model.args, str(tmp_path / "out"))
    assert_same_folder(
        src,
        str(tmp_path / "out"),
        [f for f in CONFIG_FIELDS if f != "head_dim"] + list(EXTRA_FIELDS["qwen2"]) + ["max_window_layers"],
    )


# ---- what loom does not hold -------------------------------------------------------------------


def test_unsupported_family_variants_are_config_errors(tmp_path):
    cfg = random_hf("qwen2").config.to_dict()
    mixed = {
        **cfg,
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 1,
        "layer_types": None,
    }
    with pytest.raises(ConfigError, match="sliding window in some layers only"):
        llama_args_from_hf(write_config(tmp_path / "mixed", mixed))
    qwen3 = {**random_hf("qwen3").config.to_dict(), "attention_bias": True}
    with pytest.raises(ConfigError, match="attention_bias = true is not supported for qwen3"):
        llama_args_from_hf(write_config(tmp_path / "bias", qwen3))
    with pytest.raises(
        ConfigError, match="architecture Gemma2ForCausalLM is not supported.*Qwen3ForCausalLM"
    ):
        llama_args_from_hf(write_config(tmp_path / "gemma", {"architectures": ["Gemma2ForCausalLM"]}))


def test_sliding_window_reaches_the_model_and_refuses_context_parallelism(tmp_path):
    from loom.config import build_config
    from loom.data.tokenizers import ByteTokenizer
    from loom.parallel.dims import ParallelDims
    from loom.resolve import check_model, resolve_model_args

    tok = ByteTokenizer()
    assert resolve_model_args(build_config(None, {}), tok).sliding_window == 0
    cfg = build_config(None, {"model.sliding_window": "16"})
    args = resolve_model_args(cfg, tok)
    assert args.sliding_window == 16
    src = save_hf(random_hf("mistral"), tmp_path / "hf")
    assert resolve_model_args(build_config(None, {"model.init_from": src}), tok).sliding_window == WINDOW
    assert (
        resolve_model_args(
            build_config(None, {"model.init_from": src, "model.sliding_window": "32"}), tok
        ).sliding_window
        == 32
    )
    cp = build_config(None, {"parallel.cp": "2", "parallel.dp_shard": "1"})
    with pytest.raises(ConfigError, match="parallel.cp.*sliding window"):
        check_model(ParallelDims.from_config(cp.parallel, 2), args, cp.parallel)


def test_auto_attention_takes_loom_kernel_for_a_window_untimed(tmp_path):
    """On CUDA ``model.attention = auto`` picks loom's kernel for a window (it skips the blocks outside it; the
    start-up timing runs without a window, so it is not asked); SDPA on the CPU."""
    from loom.config import build_config
    from loom.data.tokenizers import ByteTokenizer
    from loom.methods import resolve
    from loom.resolve import model_kernels, times_attention

    src = save_hf(random_hf("mistral"), tmp_path / "hf")
    for overrides in ({"model.sliding_window": "16"}, {"model.init_from": src}):
        cfg = build_config(None, overrides)
        assert model_kernels(cfg, "cuda", triton=True).attention == "flash"
        assert model_kernels(cfg, "cpu").attention == "sdpa"
    assert model_kernels(build_config(None, {}), "cuda", triton=True).attention == "sdpa"
    assert not times_attention(
        resolve(
            build_config(None, {"model.sliding_window": "16"}), 1, device="cpu", tokenizer=ByteTokenizer()
        )
    )


# ---- training ----------------------------------------------------------------------------------


def test_training_starts_from_a_mistral_folder_and_exports_back(tmp_path):
    """model.init_from a Mistral folder whose window (8) is shorter than the run's sequences (32): the first loss is
    transformers' on the same batch, and the trained checkpoint exports as a Mistral with its window."""
    hf = random_hf("mistral")
    src = save_hf(hf, tmp_path / "hf")
    trainer, first, records = train_from_hf(tmp_path, src)
    assert trainer.model_args.sliding_window == WINDOW
    assert records[0]["loss"] == pytest.approx(hf_loss(hf, first), rel=1e-5)
    assert records[1]["loss"] != records[0]["loss"]
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
    assert llama_args_from_hf(out) == llama_args_from_hf(src)
    assert transformers.AutoConfig.from_pretrained(out).sliding_window == WINDOW
    assert torch.equal(
        read_all(out)["model.layers.1.self_attn.q_proj.weight"],
        trainer.parts[0].state_dict()["layers.1.attention.wq.weight"],
    )


def test_planner_counts_biases_and_q_k_norms():
    """The planner's parameter count (loom.plan.shapes) holds the switches' parameters exactly."""
    from loom.config.sections import ParallelConfig
    from loom.models.llama import FLAVORS, Llama
    from loom.plan.shapes import rank_shares

    for kw in (
        dict(attention_bias=True),
        dict(qk_norm=True, head_dim=24),
        dict(attention_bias=True, moe_experts=4),
    ):
        args = FLAVORS["debug"].with_(vocab_size=VOCAB, **kw)
        with torch.device("meta"):
            total = sum(p.numel() for p in Llama(args).parameters())
        assert rank_shares(args, 1, ParallelConfig(), 64)[0].params(1) == total, kw

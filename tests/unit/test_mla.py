"""Multi-head latent attention (loom.models.common.mla): logits equal transformers' DeepSeek-V3 (fp32) with and
without a query compression, interleaved RoPE and YaRN, on every attention backend and for packed documents; DeepSeek-V3
folders round-trip both ways (and through `loom convert`, and into training); what loom does not hold is refused in one
line; the FLOPs and the planner's parameter counts equal the model's own."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from loom.checkpoint.hf.config import hf_architecture  # noqa: E402
from loom.checkpoint.hf.export import export_hf  # noqa: E402
from loom.checkpoint.hf.reader import llama_args_from_hf  # noqa: E402
from loom.cli.main import main as loom_main  # noqa: E402
from loom.config import build_config  # noqa: E402
from loom.config.errors import ConfigError, UserError  # noqa: E402
from loom.models.common.mla import YarnScaling, deinterleave, softmax_scale, yarn_rope_table  # noqa: E402
from loom.models.llama import FLAVORS, Llama, LlamaArgs  # noqa: E402
from tests.unit.test_hf import (  # noqa: E402
    CONFIG_FIELDS,
    VOCAB,
    assert_same_folder,
    hf_loss,
    loom_from_hf,
    save_hf,
    train_from_hf,
    write_config,
)

MLA_FIELDS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_interleave",
    "first_k_dense_replace",
    "model_type",
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}  # attention factor != 1
# name -> DeepseekV3Config overrides: query compressed or not, RoPE pairs interleaved or not, YaRN
VARIANTS = {
    "q_lora-interleaved": dict(q_lora_rank=24, rope_interleave=True),
    "direct_q-rotate_half": dict(q_lora_rank=None, rope_interleave=False),
    "yarn": dict(q_lora_rank=24, rope_interleave=True, rope_parameters=YARN),
    "yarn-factor_only": dict(
        q_lora_rank=None,
        rope_interleave=True,
        rope_parameters={**YARN, "mscale": None, "mscale_all_dim": None},
    ),
}


def random_deepseek(variant: str = "q_lora-interleaved", seed: int = 0, **overrides):
    """A small dense DeepseekV3ForCausalLM (values 12 wide, queries/keys 16 + 8) with its weights widened as
    ``test_hf.random_hf_llama``'s, so that a wrong tensor, RoPE layout or scale shows up far above the tolerance."""
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(
        **{
            **dict(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=4,
                intermediate_size=128,
                vocab_size=VOCAB,
                max_position_embeddings=256,
                kv_lora_rank=32,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=12,
                first_k_dense_replace=2,
                tie_word_embeddings=False,
            ),
            **VARIANTS[variant],
            **overrides,
        }
    )
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5) if p.ndim == 1 else p.normal_(0.0, 0.1)
    return model


def tokens_of(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def set_backend(model: Llama, backend: str) -> None:
    for block in model.layers.values():
        block.attention.backend = backend


def random_loom(flavor: str = "debug_mla", seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    model = Llama(FLAVORS[flavor].with_(vocab_size=VOCAB, max_seq_len=64, **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5) if p.ndim == 1 else p.normal_(0.0, 0.1)
    return model


# ---- the model against transformers -----------------------------------------------------------------


def test_config_maps_to_latent_attention(tmp_path):
    args = llama_args_from_hf(save_hf(random_deepseek("yarn"), tmp_path / "hf"))
    assert (
        args.mla,
        args.n_kv_heads,
        args.q_lora_rank,
        args.kv_lora_rank,
        args.head_dim,
        args.value_head_dim,
        args.rope_dim,
        args.rope_interleave,
    ) == (True, 4, 24, 32, 24, 12, 8, True)
    assert args.rope_scaling == YarnScaling(4.0, 16, 32.0, 1.0, 1.0, 0.8)
    assert args.cache_elements_per_token == 32 + 8
    assert hf_architecture(args) == "DeepseekV3ForCausalLM"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
    hf = random_deepseek(variant)
    model = loom_from_hf(save_hf(hf, tmp_path / "hf"))
    tokens = tokens_of(2, 40)  # past YaRN's original 16 positions
    with torch.no_grad():
        theirs = hf(tokens).logits  # (B, S, V)
        assert theirs.abs().max() > 1.0
        for backend in (
            "sdpa",
            "flash",
            "flex",
        ):  # flash, flex (forward only on CPU): values zero-padded to 24
            set_backend(model, backend)
            assert (model(tokens) - theirs).abs().max() < 1e-4, backend


def test_rope_layout_and_scale_are_in_effect(tmp_path):
    """Controls: the same weights read with the other RoPE layout, or without YaRN's softmax scale, give other
    logits."""
    hf = random_deepseek("yarn")
    folder = save_hf(hf, tmp_path / "hf")
    tokens = tokens_of(1, 40)
    with torch.no_grad():
        theirs = hf(tokens).logits
        assert (loom_from_hf(folder, rope_interleave=False)(tokens) - theirs).abs().max() > 1e-2
        plain = loom_from_hf(folder)
        for block in plain.layers.values():
            block.attention.scale = 24**-0.5
        assert (plain(tokens) - theirs).abs().max() > 1e-2


def test_yarn_table_and_scale_are_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    cfg = random_deepseek("yarn").config
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    scaling = YarnScaling(4.0, 16, 32.0, 1.0, 1.0, 0.8)
    table = yarn_rope_table(8, 40, 10000.0, scaling)  # (2, S, D)
    freqs = torch.outer(torch.arange(40.0), inv_freq)
    torch.testing.assert_close(table[0], torch.cat([freqs, freqs], -1).cos() * attention)
    assert softmax_scale(24, scaling) == pytest.approx(yarn_apply_mscale(cfg.rope_parameters, 24**-0.5))
    assert torch.equal(deinterleave(torch.arange(8.0)), torch.tensor([0.0, 2, 4, 6, 1, 3, 5, 7]))


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_packed_documents_match_each_document_alone(tmp_path, backend):
    hf = random_deepseek("q_lora-interleaved")
    model = loom_from_hf(save_hf(hf, tmp_path / "hf"), attention=backend)
    lengths = [13, 5, 22]
    tokens = tokens_of(1, sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]  # (1, S)
    with torch.no_grad():
        ours = model(tokens, positions)  # (1, S, V)
        for doc, start in zip(tokens.split(lengths, dim=1), torch.tensor([0, *lengths]).cumsum(0)):
            assert (ours[:, start : start + doc.shape[1]] - hf(doc).logits).abs().max() < 1e-4


def test_backends_agree_in_the_backward():
    """SDPA (values as they are) and loom's op (values zero-padded to the q/k head dim): the same gradients."""
    tokens = tokens_of(2, 24)
    grads = {}
    for backend in ("sdpa", "flash"):
        model = random_loom(attention=backend).train()
        model(tokens, labels=tokens).backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads["sdpa"].items():
        torch.testing.assert_close(grads["flash"][name], g, rtol=1e-4, atol=1e-5, msg=name)


# ---- folders both ways ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["q_lora-interleaved", "direct_q-rotate_half", "yarn"])
def test_export_gives_the_folder_back(tmp_path, variant):
    """HF -> loom -> HF: the same tensors under the same names and the same config to transformers, which loads the
    export with bitwise the same logits."""
    hf = random_deepseek(variant)
    src = save_hf(hf, tmp_path / "hf")
    model = loom_from_hf(src)
    out = str(tmp_path / "out")
    export_hf(model.state_dict(), model.args, out)
    assert_same_folder(src, out, CONFIG_FIELDS + MLA_FIELDS)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf)
    tokens = tokens_of(1, 30, seed=2)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)


@pytest.mark.parametrize(
    "flavor,overrides", [("debug_mla", {}), ("debug_mla", {"q_lora_rank": 0, "rope_interleave": True})]
)
def test_loom_model_exports_to_transformers(tmp_path, flavor, overrides):
    """loom -> HF: transformers' DeepseekV3ForCausalLM on the export gives loom's logits."""
    model = random_loom(flavor, **overrides)
    out = str(tmp_path / "out")
    export_hf(model.state_dict(), model.args, out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    tokens = tokens_of(2, 40)
    with torch.no_grad():
        ours = model(tokens)
        assert ours.abs().max() > 1.0 and (hf(tokens).logits - ours).abs().max() < 1e-4
    back = llama_args_from_hf(
        out
    )  # the DeepSeek-V3 family's args (loom.models.deepseek_v3): dense, the same shape
    assert (
        LlamaArgs(**{f.name: getattr(back, f.name) for f in dataclasses.fields(LlamaArgs)})
        == model.args.with_(attention="sdpa")
        and not back.moe
        and not back.mtp_depth
    )


def test_round_trip_through_cli(tmp_path):
    src = save_hf(random_deepseek("yarn"), tmp_path / "hf", "20KB")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert loom_main(["convert", "--from-hf", src, "--to", ckpt]) == 0
    assert llama_args_from_hf(ckpt).mla
    assert loom_main(["convert", "--from", ckpt, "--to-hf", out]) == 0
    assert_same_folder(src, out, CONFIG_FIELDS + MLA_FIELDS)


def test_training_starts_from_a_deepseek_folder_and_exports_back(tmp_path):
    hf = random_deepseek("q_lora-interleaved")
    src = save_hf(hf, tmp_path / "hf")
    trainer, first, records = train_from_hf(tmp_path, src)
    assert trainer.model_args.mla
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


# ---- what loom does not hold ------------------------------------------------------------------------


def test_unsupported_deepseek_configs_are_one_line_errors(tmp_path):
    cfg = random_deepseek().config.to_dict()
    # DeepSeek's MoE layers are the DeepSeek-V3 family's (tests/unit/test_moe_families.py)
    assert llama_args_from_hf(write_config(tmp_path / "moe", {**cfg, "first_k_dense_replace": 1})).moe_layer(
        1
    )
    with pytest.raises(ConfigError, match="num_key_value_heads = 2 is not supported"):
        llama_args_from_hf(write_config(tmp_path / "kv", {**cfg, "num_key_value_heads": 2}))
    with pytest.raises(ConfigError, match="YaRN with attention_factor = 2.0 is not supported"):
        llama_args_from_hf(
            write_config(tmp_path / "af", {**cfg, "rope_parameters": {**YARN, "attention_factor": 2.0}})
        )
    with pytest.raises(ConfigError, match="attention_bias = true is not supported for deepseek_v3"):
        llama_args_from_hf(write_config(tmp_path / "bias", {**cfg, "attention_bias": True}))
    llama = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=YARN).to_dict()
    with pytest.raises(ConfigError, match="RoPE type 'yarn' is not supported"):  # YaRN for DeepSeek only
        llama_args_from_hf(write_config(tmp_path / "llama", {**llama, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UserError, match="multi-head latent attention with experts"):
        hf_architecture(FLAVORS["debug_mla"].with_(moe_experts=4))


def test_config_rules(tmp_path):
    from loom.data.tokenizers import ByteTokenizer
    from loom.kernels.dispatch import KernelChoice, mla_kernels
    from loom.parallel.dims import ParallelDims
    from loom.resolve import check_model, model_kernels, resolve_model_args

    tok = ByteTokenizer()
    args = resolve_model_args(build_config(None, {"model.flavor": "debug_mla"}), tok)
    cp = build_config(None, {"parallel.cp": "2", "parallel.dp_shard": "1"})
    check_model(ParallelDims.from_config(cp.parallel, 2), args, cp.parallel)  # context parallel: accepted
    with pytest.raises(
        ConfigError, match="lora.targets.*k, v: not a linear of this model's multi-head latent"
    ):
        resolve_model_args(build_config(None, {"model.flavor": "debug_mla", "lora.rank": "4"}), tok)
    mla_lora = {"model.flavor": "debug_mla", "lora.rank": "4", "lora.targets": "q_a,q_b,kv_a,kv_b,o,gate"}
    assert resolve_model_args(build_config(None, mla_lora), tok).mla  # LoRA on latent attention
    # loom's kernel on CUDA: DeepSeek-V2-Lite's 192-wide heads fall back to SDPA under auto, are refused under flash
    flash = KernelChoice("flash", False, False, False, False)
    lite = build_config(None, {"model.flavor": "deepseek_v2_lite", "data.document_positions": "true"})
    assert model_kernels(lite, "cuda", triton=True).attention == "sdpa"
    debug = build_config(None, {"model.flavor": "debug_mla"})
    # 32 wide
    assert mla_kernels(debug, flash, "cuda", lambda: max(args.head_dim, args.value_head_dim)) == flash
    assert mla_kernels(lite, flash, "cpu", lambda: 192) == flash  # the reference takes any width
    with pytest.raises(ConfigError, match="model.attention.*head dims 16, 32, 64, 128.*needs 192"):
        model_kernels(
            build_config(None, {"model.flavor": "deepseek_v2_lite", "model.attention": "flash"}),
            "cuda",
            triton=True,
        )


def test_flash_head_dims_are_the_kernels():
    pytest.importorskip("triton")
    from loom.kernels.attention.triton import HEAD_DIMS
    from loom.kernels.dispatch import FLASH_HEAD_DIMS

    assert FLASH_HEAD_DIMS == HEAD_DIMS


# ---- FLOPs and the planner ------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": 0}], ids=["q_lora", "direct_q"])
def test_counts_equal_the_models_own(overrides):
    """The FLOPs' matmul weights and the planner's per-block parameters (sharded by heads / replicated) equal the
    model's tensors; the attention FLOPs count scores over q/k's width and sums over v's."""
    from loom.metrics.flops import attention_matmul_params, flops_per_token, matmul_params
    from loom.plan.shapes import layer_params

    args = FLAVORS["debug_mla"].with_(vocab_size=VOCAB, **overrides)
    with torch.device("meta"):
        model = Llama(args)
    attn = model.layers["0"].attention
    linears = {n: p.numel() for n, p in attn.named_parameters() if "norm" not in n}
    assert attention_matmul_params(args) == sum(linears.values())
    block = {n: p.numel() for n, p in model.layers["0"].named_parameters()}
    replicated = {n for n in block if "norm" in n or n.startswith(("attention.wq_a.", "attention.wkv_a."))}
    assert layer_params(args) == (
        sum(v for n, v in block.items() if n not in replicated),
        sum(block[n] for n in replicated),
    )
    matmuls = sum(
        p.numel() for n, p in model.named_parameters() if "norm" not in n and "tok_embeddings" not in n
    )
    assert matmul_params(args) == matmuls
    heads, qk, v = 4, 32, 16
    assert flops_per_token(args, 64) == 6 * matmuls + 6 * args.n_layers * heads * (qk + v) * 64

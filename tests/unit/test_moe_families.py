"""The Qwen3-MoE and DeepSeek-V3 families (loom.models.qwen3_moe, loom.models.deepseek_v3): logits equal
transformers' (fp32) on tiny random models, HF -> loom -> HF gives the same tensors back and transformers loads the
export with the same logits; DeepSeek's multi-token prediction layer round-trips in its published layout and
transformers skips it; the registry builds each family from its flavor."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from loom.checkpoint.hf.export import export_hf  # noqa: E402
from loom.checkpoint.hf.reader import llama_args_from_hf, load_hf_weights  # noqa: E402
from loom.cli.main import main as loom_main  # noqa: E402
from loom.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Args  # noqa: E402
from loom.models.qwen3_moe import Qwen3MoeArgs  # noqa: E402
from loom.models.registry import all_flavors, build_model, spec_of  # noqa: E402
from tests.unit.test_hf import VOCAB, read_all, save_hf  # noqa: E402

_SHAPE = dict(
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    tie_word_embeddings=False,
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
}


def _widen(model):
    """Weights widened from HF's init (norms off 1, biases off 0) so a wrong tensor or route shows far above 1e-4."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if p.ndim == 1 else p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)  # a selection bias that changes which experts win
    return model.eval()


def random_qwen3_moe(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        **{
            **_SHAPE,
            **dict(
                num_hidden_layers=4,
                num_key_value_heads=2,
                head_dim=24,
                intermediate_size=96,
                moe_intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=3,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[1],
                rope_theta=1e6,
                rms_norm_eps=1e-6,
            ),
            **overrides,
        }
    )
    return _widen(transformers.Qwen3MoeForCausalLM(cfg))


def random_deepseek_v3(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(
        **{
            **_SHAPE,
            **dict(
                num_hidden_layers=3,
                num_key_value_heads=4,
                intermediate_size=96,
                moe_intermediate_size=16,
                kv_lora_rank=32,
                q_lora_rank=24,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=12,
                rope_interleave=True,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_shared_experts=2,
                n_group=4,
                topk_group=2,
                routed_scaling_factor=2.5,
                norm_topk_prob=True,
                first_k_dense_replace=1,
                rope_parameters=YARN,
            ),
            **overrides,
        }
    )
    return _widen(transformers.DeepseekV3ForCausalLM(cfg))


FAMILIES = {"qwen3_moe": random_qwen3_moe, "deepseek_v3": random_deepseek_v3}


def loom_of(folder: str):
    model = build_model(llama_args_from_hf(folder))
    load_hf_weights(model, folder)
    return model.eval()


def tokens_of(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_config_maps_to_each_family(tmp_path):
    q = llama_args_from_hf(save_hf(random_qwen3_moe(), tmp_path / "q"))
    assert type(q) is Qwen3MoeArgs and spec_of(q).name == "qwen3_moe"
    assert (q.qk_norm, q.n_kv_heads, q.head_dim, q.moe_experts, q.moe_top_k, q.expert_ffn_dim, q.ffn_dim) == (
        True,
        2,
        24,
        8,
        3,
        32,
        96,
    )
    assert [q.moe_layer(i) for i in range(4)] == [True, False, True, True]  # mlp_only_layers = [1]
    d = llama_args_from_hf(save_hf(random_deepseek_v3(), tmp_path / "d"))
    assert type(d) is DeepSeekV3Args and d.mla and d.moe_score == "sigmoid" and d.moe_bias
    assert (d.moe_groups, d.moe_topk_groups, d.moe_shared_experts, d.moe_route_scale, d.first_k_dense) == (
        4,
        2,
        2,
        2.5,
        1,
    )
    assert [d.moe_layer(i) for i in range(3)] == [False, True, True]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(tmp_path, family):
    hf = FAMILIES[family]()
    model = loom_of(save_hf(hf, tmp_path / "hf"))
    tokens = tokens_of(2, 24)
    with torch.no_grad():
        theirs = hf(tokens).logits
        assert theirs.abs().max() > 1.0
        assert (model(tokens) - theirs).abs().max() < 1e-4


def test_softmax_topk_without_renormalizing_matches(tmp_path):
    """Qwen3-MoE with norm_topk_prob false (the raw softmax weights) and a sparse step of 2."""
    hf = random_qwen3_moe(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[])
    model = loom_of(save_hf(hf, tmp_path / "hf"))
    assert [model.args.moe_layer(i) for i in range(4)] == [False, True, False, True]
    tokens = tokens_of(1, 20)
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max() < 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_gives_the_folder_back(tmp_path, family):
    hf = FAMILIES[family]()
    src = save_hf(hf, tmp_path / "hf")
    model = loom_of(src)
    out = str(tmp_path / "out")
    export_hf(model.state_dict(), model.args, out)
    a, b = read_all(src), read_all(out)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert llama_args_from_hf(out) == llama_args_from_hf(src)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf)
    tokens = tokens_of(1, 16, seed=2)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)


def test_mtp_layer_round_trips_in_deepseeks_layout(tmp_path):
    """A loom DeepSeek-V3 with an MTP module exports it as layer n_layers (enorm, hnorm, eh_proj, shared_head, the
    block, copies of the embedding and head); loom reads it back bit for bit; transformers loads the folder, skips
    the extra layer and gives loom's logits (MTP is not run at inference)."""
    args = all_flavors()["deepseek_v3_debug"].with_(vocab_size=VOCAB, max_seq_len=64)
    torch.manual_seed(0)
    model = _widen(build_model(args))
    assert args.mtp_depth == 1 and isinstance(model, DeepSeekV3)
    out = str(tmp_path / "out")
    export_hf(model.state_dict(), args, out)
    stored = read_all(out)
    n = args.n_layers
    assert {
        f"model.layers.{n}.{k}"
        for k in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "shared_head.norm.weight",
            "embed_tokens.weight",
            "shared_head.head.weight",
            "mlp.gate.e_score_correction_bias",
            "self_attn.kv_a_proj_with_mqa.weight",
        )
    } <= set(stored)
    with open(os.path.join(out, "config.json")) as fh:
        assert json.load(fh)["num_nextn_predict_layers"] == 1
    back = loom_of(out)
    assert sorted(back.state_dict()) == sorted(model.state_dict())
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = tokens_of(2, 20)
    with torch.no_grad():
        assert (hf(tokens).logits - model(tokens)).abs().max() < 1e-4


def test_mtp_adds_its_weighted_loss_in_training_only():
    args = all_flavors()["deepseek_v3_debug"].with_(vocab_size=VOCAB, max_seq_len=64)
    torch.manual_seed(0)
    model = build_model(args)
    for p in model.parameters():
        torch.nn.init.normal_(p, 0.0, 0.05) if p.ndim > 1 else torch.nn.init.ones_(p)
    tokens = tokens_of(2, 16)
    labels = torch.roll(tokens, -1, dims=1)
    main = model.eval()(tokens, labels=labels)
    with torch.no_grad():
        both = model.train()(tokens, labels=labels)
        plain = build_model(args.with_(mtp_depth=0))
        plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
        assert torch.equal(plain.train()(tokens, labels=labels), main)
    assert both > main and float(both - main) / float(main) == pytest.approx(args.mtp_weight, rel=0.3)


def test_cli_round_trip(tmp_path):
    """`loom convert --from-hf` then `--to-hf` gives a DeepSeek-V3 (MoE) folder back."""
    src = save_hf(random_deepseek_v3(), tmp_path / "hf")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert loom_main(["convert", "--from-hf", src, "--to", ckpt]) == 0
    assert loom_main(["convert", "--from", ckpt, "--to-hf", out]) == 0
    a, b = read_all(src), read_all(out)
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generation_from_the_folder_equals_transformers_greedy(tmp_path, family):
    """`loom generate --model <folder>`'s engine (loom.infer: KV cache, MLA's latent cache) on each family's folder
    gives transformers' greedy continuation."""
    from loom.infer import Generator

    hf = FAMILIES[family]()
    folder = save_hf(hf, tmp_path / "hf")
    prompts = [tokens_of(1, n, seed=n)[0].tolist() for n in (5, 9)]
    outs = Generator(folder, compile=False).generate_ids(prompts, max_new_tokens=8)
    for prompt, out in zip(prompts, outs):
        x = torch.tensor([prompt])
        want = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert out.token_ids[: len(want)] == want


def test_training_starts_from_a_deepseek_folder_and_exports_back(tmp_path):
    """model.init_from a DeepSeek-V3 MoE folder: step 1's loss is transformers' on that batch, two steps move the
    selection bias, and `loom convert --to-hf` of the run's checkpoint loads in transformers with the moved bias."""
    from tests.unit.test_hf import train_from_hf

    hf = random_deepseek_v3()
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
    src = save_hf(hf, tmp_path / "hf")
    trainer, first, records = train_from_hf(tmp_path, src)
    with torch.no_grad():
        sums = [
            torch.nn.functional.cross_entropy(
                hf(mb.inputs).logits.flatten(0, 1), mb.labels.flatten(), ignore_index=-100, reduction="sum"
            )
            for mb in first
        ]
    want = sum(sums) / sum(int((mb.labels != -100).sum()) for mb in first)
    assert records[0]["loss"] == pytest.approx(float(want), rel=1e-4)
    out = str(tmp_path / "out")
    ckpt = next(p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert loom_main(["convert", "--from", str(ckpt), "--to-hf", out]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(back) is type(hf)
    assert back.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_logits_and_round_trip(tmp_path, method):
    """DeepseekV2ForCausalLM (softmax scores, weights scaled not renormalized, greedy or group-limited top-k): the
    DeepSeek-V3 family's model with V2's routing gives transformers' logits and exports the same folder back."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV2Config(
        **{
            **_SHAPE,
            **dict(
                num_hidden_layers=3,
                num_key_value_heads=4,
                intermediate_size=96,
                moe_intermediate_size=16,
                kv_lora_rank=32,
                q_lora_rank=24,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=12,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_shared_experts=1,
                n_group=4,
                topk_group=2,
                topk_method=method,
                routed_scaling_factor=1.5,
                first_k_dense_replace=1,
                rope_theta=10000.0,
            ),
        }
    )
    hf = _widen(transformers.DeepseekV2ForCausalLM(cfg))
    src = save_hf(hf, tmp_path / "hf")
    model = loom_of(src)
    assert model.args.moe_score == "softmax" and model.args.moe_groups == (4 if method != "greedy" else 1)
    tokens = tokens_of(2, 24)
    with torch.no_grad():
        theirs = hf(tokens).logits
        assert theirs.abs().max() > 1.0 and (model(tokens) - theirs).abs().max() < 1e-4
    out = str(tmp_path / "out")
    export_hf(model.state_dict(), model.args, out)
    a, b = read_all(src), read_all(out)
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert type(back) is type(hf) and torch.equal(back(tokens).logits, theirs)


def test_lora_on_latent_attention_loads_in_peft_with_loom_logits(tmp_path):
    """LoRA on DeepSeek-V3's latent attention (q_a, q_b, kv_a, kv_b, o): the adapter exported in PEFT's format loads
    with ``PeftModel.from_pretrained`` on the Hugging Face folder and gives loom's logits (fp32, 1e-4), and
    ``lora.init_from`` reads it back into loom; a GQA target on this model, an MLA one on a GQA model, or shared
    experts where there are none, is one line naming the allowed ones."""
    peft = pytest.importorskip("peft")
    from dataclasses import replace

    from loom.checkpoint.peft import ADAPTER_CONFIG, export_peft, load_peft_adapter
    from loom.config.errors import ConfigError
    from loom.config.sections import LoraConfig
    from loom.data.tokenizers import ByteTokenizer
    from loom.models.common.lora import apply_lora
    from loom.resolve import resolve_model_args
    from tests.tiny import tiny_config

    folder = save_hf(random_deepseek_v3(), tmp_path / "hf")
    model = loom_of(folder)
    lora = LoraConfig(rank=4, alpha=8.0, targets="q_a,q_b,kv_a,kv_b,o")
    assert apply_lora(model, lora) == 5 * 3
    with torch.no_grad():  # adapters that change the model (PEFT's B starts at zero)
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    export_peft(model.state_dict(), lora, str(tmp_path / "adapter"), folder, args=model.args)
    cfg = json.load(open(tmp_path / "adapter" / ADAPTER_CONFIG))
    assert sorted(cfg["target_modules"]) == sorted(
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = tokens_of(2, 16)
    with torch.no_grad():
        base = hf(tokens).logits
        theirs = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()(tokens).logits
        ours = model.eval()(tokens)
    assert (ours - theirs).abs().max() < 1e-4 and (base - theirs).abs().max() > 1e-2
    back = loom_of(folder)
    apply_lora(back, lora)
    reloaded = replace(lora, init_from=str(tmp_path / "adapter"))
    assert load_peft_adapter(back, reloaded, args=back.args) == 2 * 5 * 3
    with torch.no_grad():
        assert (back.eval()(tokens) - ours).abs().max() == 0
    tok = ByteTokenizer()
    for flavor, targets, says in (
        ("deepseek_v3_debug", "q,k,v,o", "q, k, v: not a linear of this model's multi-head latent attention"),
        ("qwen3_moe_debug", "q,kv_b", "kv_b: not a linear of this model's grouped-query attention"),
        ("qwen3_moe_debug", "q,shared_up", "shared_up: this model has no shared experts"),
    ):
        with pytest.raises(ConfigError, match=says) as err:
            resolve_model_args(
                tiny_config(**{"model.flavor": flavor, "lora.rank": 4, "lora.targets": targets}), tok
            )
        assert "\n" not in str(err.value)


def test_first_k_dense_moves_the_dense_first_blocks_of_a_deepseek_flavor(tmp_path):
    """model.first_k_dense: a DeepSeek-V3 flavor's dense first blocks change (fewer experts to build); another
    family, more blocks than the model has, or a folder's different count are refused, naming the field."""
    from types import SimpleNamespace

    from loom.config import build_config
    from loom.config.errors import ConfigError
    from loom.models.common.moe import MoE
    from loom.resolve import dense_first_blocks, resolve_model_args

    def cfg(**kw):
        return build_config(None, {f"model.{k}": str(v) for k, v in kw.items()})

    base = all_flavors()["deepseek_v3_debug"]  # 3 blocks, the first dense
    assert dense_first_blocks(base, cfg(flavor="deepseek_v3_debug")) is base
    args = dense_first_blocks(base, cfg(flavor="deepseek_v3_debug", first_k_dense=2))
    assert [args.moe_layer(i) for i in range(3)] == [False, False, True]
    resolved = resolve_model_args(
        cfg(flavor="deepseek_v3_debug", first_k_dense=2), SimpleNamespace(vocab_size=VOCAB)
    )
    assert resolved.first_k_dense == 2  # the run's resolution applies it
    model = build_model(args.with_(vocab_size=VOCAB))
    assert sum(isinstance(m, MoE) for m in model.layers.modules()) == 1
    assert model(tokens_of(1, 8)).shape[-1] == VOCAB
    folder = save_hf(random_deepseek_v3(), tmp_path / "d")  # first_k_dense_replace 1
    held = llama_args_from_hf(folder)
    assert dense_first_blocks(held, cfg(init_from=folder, first_k_dense=1)).first_k_dense == 1
    refused = [
        (all_flavors()["debug"], cfg(flavor="debug", first_k_dense=1), "DeepSeek-V3 family"),
        (base, cfg(flavor="deepseek_v3_debug", first_k_dense=4), "0..3"),
        (held, cfg(init_from=folder, first_k_dense=2), "has 1 dense first blocks"),
    ]
    for args, c, why in refused:
        with pytest.raises(ConfigError, match="model.first_k_dense") as err:
            dense_first_blocks(args, c)
        assert why in str(err.value)


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> str:
    """The methods' tokenized embedded data, shared by both families (pytest's own ``cache`` fixture is no path:
    as one, it wrote a ``Cache()`` folder into the working directory)."""
    return str(tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("flavor", ["qwen3_moe_debug", "deepseek_v3_debug"])
def test_sft_dpo_and_grpo_train_each_family(tmp_path, data_cache, flavor):
    """The methods run on both families out of the box (their embedded defaults): SFT's loss falls from its start,
    DPO starts at log 2 (the policy is its reference) and moves, GRPO samples, scores and trains (its records carry
    the reward and the experts' balance), every loss finite."""
    from tests.distributed.harness import run_one
    from tests.tiny import tiny_overrides

    def run(objective: str, **extra) -> list[dict]:
        over = tiny_overrides(
            tmp_path / objective,
            data_cache,
            **{"model.flavor": flavor, "training.objective": objective, "metrics.progress": "false", **extra},
        )
        return run_one(over)

    sft = run("sft", **{"training.steps": 6, "optimizer.lr": 3e-3})
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in sft) and sft[-1]["loss"] < sft[0]["loss"]
    dpo = run("dpo", **{"training.steps": 2, "training.seq_len": 128})
    assert dpo[0]["loss"] == pytest.approx(0.6931, abs=1e-3) and dpo[-1]["loss"] != dpo[0]["loss"]
    grpo = run(
        "grpo",
        **{
            "training.steps": 2,
            "training.micro_batch_size": 4,
            "grpo.group_size": 4,
            "grpo.warmup_steps": 0,
            "grpo.max_new_tokens": 4,
        },
    )
    assert [r["step"] for r in grpo] == [1, 2]
    assert all("reward" in r and "moe_balance" in r and torch.isfinite(torch.tensor(r["loss"])) for r in grpo)


def test_lora_on_the_shared_experts_merges_into_a_folder_transformers_loads(tmp_path):
    """LoRA on DeepSeek-V3's shared experts (shared_gate, shared_up, shared_down; the two MoE blocks of three have
    them, the dense first block has none, routed experts get none): merged into the base, the exported folder gives
    loom's adapted logits in transformers (fp32, 1e-4). A PEFT adapter is refused in one line: PEFT (0.21, on
    transformers 5) maps every ``*.gate_proj`` / ``up_proj`` / ``down_proj`` target of this architecture onto the
    routed experts' fused weights, so the adapter would load onto the wrong weights."""
    from loom.checkpoint.peft import export_peft
    from loom.config.errors import ConfigError
    from loom.config.sections import LoraConfig
    from loom.models.common.lora import apply_lora, merge_lora

    folder = save_hf(random_deepseek_v3(), tmp_path / "hf")
    model = loom_of(folder)
    lora = LoraConfig(rank=4, alpha=8.0, targets="shared_gate,shared_up,shared_down")
    assert apply_lora(model, lora) == 3 * 2
    assert not any(".lora_" in n for n, _ in model.layers["0"].named_parameters())  # the dense block: none
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    tokens = tokens_of(2, 16)
    with torch.no_grad():
        ours = model.eval()(tokens)
    with pytest.raises(ConfigError, match="shared_gate, shared_up, shared_down: .*PEFT.*--to-hf") as err:
        export_peft(model.state_dict(), lora, str(tmp_path / "adapter"), folder, args=model.args)
    assert "\n" not in str(err.value) and not (tmp_path / "adapter").exists()
    assert merge_lora(model) == 3 * 2
    export_hf(model.state_dict(), model.args, str(tmp_path / "merged"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "merged"), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        base = loom_of(folder)(tokens)
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max() < 1e-4 and (base - theirs).abs().max() > 1e-2

"""LoRA: PEFT interop both ways (a loom adapter loads with ``PeftModel.from_pretrained`` on the base folder with
loom's logits; a PEFT-made adapter imports into loom with PEFT's logits), the merged export equals PEFT's
``merge_and_unload``, rsLoRA's scaling is PEFT's, training moves only the adapters (the base stays bitwise, the
optimizer holds adapter state only), resume equals the uninterrupted run, and misuse gives one-line errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("safetensors")

from safetensors.torch import load_file  # noqa: E402

from loom.checkpoint.hf.reader import llama_args_from_hf, load_hf_weights  # noqa: E402
from loom.checkpoint.manager import load_model_only  # noqa: E402
from loom.checkpoint.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_peft_adapter, peft_key  # noqa: E402
from loom.cli.convert import main as convert_main  # noqa: E402
from loom.cli.main import main as loom_main  # noqa: E402
from loom.config.errors import ConfigError  # noqa: E402
from loom.config.sections import LoraConfig  # noqa: E402
from loom.methods import check_config  # noqa: E402
from loom.models.common.lora import (  # noqa: E402
    LoRALinear,
    adapters_hidden,
    apply_lora,
    lora_scaling,
    parse_targets,
)
from loom.models.llama import Llama  # noqa: E402
from loom.train.trainer import Trainer  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402
from tests.unit.test_hf import random_hf_llama, save_hf  # noqa: E402

CORPUS = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}\n" for i in range(400))
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = torch.tensor([[1, 5, 77, 300, 12, 9, 200, 45, 3, 150, 260, 7, 99, 31, 8, 64]])


def lora_run(tmp, name, base, **extra):
    """A LoRA run on ``base`` (a Hugging Face folder): the run's Config."""
    text = tmp / "corpus.txt"
    if not text.exists():
        text.write_text(CORPUS)
    return tiny_config(
        tmp / name,
        tmp / "cache",
        **{
            "run.device": "cpu",
            "data.source": str(text),
            "model.init_from": base,
            "lora.rank": 4,
            "lora.alpha": 8,
            "lora.targets": "all",
            "optimizer.lr": 3e-2,
            "optimizer.weight_decay": 0.0,
            "optimizer.warmup_steps": 0,
            "training.steps": 3,
            "training.global_batch_size": 4,
            "checkpoint.at_end": "true",
            "metrics.progress": "false",
            **extra,
        },
    )


def loom_model(base: str, lora: LoraConfig | None = None) -> Llama:
    """A CPU loom Llama of ``base``'s shape (adapted by ``lora``), uninitialized."""
    with torch.device("meta"):
        model = Llama(llama_args_from_hf(base))
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    if lora is not None:
        apply_lora(model, lora)
    return model.eval()


def logits(model, peft_or_hf: bool = False) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits if peft_or_hf else model(TOKENS)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A base folder, a LoRA run on it (3 steps: B is not zero), and its checkpoint exported as a PEFT adapter and
    as a merged model."""
    tmp = tmp_path_factory.mktemp("lora")
    base = save_hf(random_hf_llama(tied=False), tmp / "base")
    trainer = Trainer(lora_run(tmp, "run", base))
    records = trainer.fit()
    ckpt = str(tmp / "run" / "checkpoints" / "step_00000003")
    assert loom_main(["convert", "--from", ckpt, "--to-peft", str(tmp / "adapter")]) == 0
    assert loom_main(["convert", "--from", ckpt, "--to-hf", str(tmp / "merged")]) == 0
    lora = trainer.cfg.lora
    model = loom_model(base, lora)
    load_model_only(ckpt, model)
    return dict(
        tmp=tmp,
        base=base,
        ckpt=ckpt,
        adapter=str(tmp / "adapter"),
        merged=str(tmp / "merged"),
        lora=lora,
        model=model,
        records=records,
        trainer=trainer,
    )


def hf_model(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_a_loom_adapter_loads_in_peft_with_loom_logits(trained):
    cfg = json.load(open(os.path.join(trained["adapter"], ADAPTER_CONFIG)))
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8 and not cfg["use_rslora"]
    assert sorted(cfg["target_modules"]) == sorted(HF_TARGETS)
    assert cfg["base_model_name_or_path"] == os.path.abspath(trained["base"])
    stored = load_file(os.path.join(trained["adapter"], ADAPTER_WEIGHTS))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in stored
    assert len(stored) == 2 * 7 * 2  # A and B of 7 linears in 2 blocks
    b = stored["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert b.abs().max() > 0  # trained: the adapter changes the model
    model = peft.PeftModel.from_pretrained(hf_model(trained["base"]), trained["adapter"]).eval()
    ours = logits(trained["model"])
    assert (logits(model, True) - ours).abs().max() < 1e-4
    assert (
        logits(hf_model(trained["base"]), True) - ours
    ).abs().max() > 1e-2  # without the adapter: not the same


def test_the_merged_export_equals_peft_merge_and_unload(trained):
    merged = peft.PeftModel.from_pretrained(hf_model(trained["base"]), trained["adapter"]).merge_and_unload()
    theirs = merged.state_dict()
    ours = load_file(os.path.join(trained["merged"], "model.safetensors"))
    assert set(ours) <= set(theirs) and "model.layers.0.self_attn.q_proj.weight" in ours
    for name, t in ours.items():
        assert torch.allclose(t, theirs[name], atol=1e-6), name
    assert (logits(hf_model(trained["merged"]), True) - logits(trained["model"])).abs().max() < 1e-4


def test_a_peft_made_adapter_imports_into_loom(trained, tmp_path):
    base = trained["base"]
    model = peft.get_peft_model(
        hf_model(base),
        peft.LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "down_proj"],
            use_rslora=True,
            lora_dropout=0.0,
        ),
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)  # PEFT starts B at zero: make the adapter matter
    model.save_pretrained(str(tmp_path / "adapter"))
    lora = LoraConfig(rank=4, alpha=8.0, targets="q,v,down", rslora=True, init_from=str(tmp_path / "adapter"))
    ours = loom_model(base, lora)
    with adapters_hidden([ours]):
        load_hf_weights(ours, base)
    assert load_peft_adapter(ours, lora) == 2 * 3 * 2
    assert (logits(ours) - logits(model.eval(), True)).abs().max() < 1e-4
    # and through the trainer: lora.init_from gives the run these adapters
    trainer = Trainer(
        lora_run(
            tmp_path,
            "run",
            base,
            **{
                "lora.targets": "q,v,down",
                "lora.rslora": "true",
                "lora.init_from": str(tmp_path / "adapter"),
            },
        )
    )
    got = dict(trainer.parts[0].named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(got[name], p), name


def test_rslora_scaling_matches_peft(trained):
    for rslora in (False, True):
        model = peft.get_peft_model(
            hf_model(trained["base"]),
            peft.LoraConfig(r=16, lora_alpha=8, target_modules=["q_proj"], use_rslora=rslora),
        )
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        assert lora_scaling(8.0, 16, rslora) == pytest.approx(layer.scaling["default"], rel=1e-12)
    assert lora_scaling(8.0, 16, True) == 2.0 and lora_scaling(8.0, 16, False) == 0.5


def test_training_moves_only_the_adapters(trained, tmp_path):
    trainer = Trainer(lora_run(tmp_path, "run", trained["base"], **{"checkpoint.at_end": "false"}))
    part = trainer.parts[0]
    frozen = {n: p.detach().clone() for n, p in part.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in part.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in adapters) and len(adapters) == 28
    assert "layers.0.attention.wq.weight" in frozen and "tok_embeddings.weight" in frozen
    records = trainer.fit()
    assert records[-1]["loss"] < records[0]["loss"]
    for name, p in part.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name  # bitwise: no gradient, no update, no weight decay
    assert any(not torch.equal(p, adapters[n]) for n, p in part.named_parameters() if n in adapters)
    names = {id(p): n for n, p in part.named_parameters()}
    held = [
        names[id(p)] for opt in trainer.optimizer.optimizers for g in opt.param_groups for p in g["params"]
    ]
    assert sorted(held) == sorted(adapters)
    state = [names[id(p)] for opt in trainer.optimizer.optimizers for p in opt.state]
    assert sorted(state) == sorted(adapters)


def test_the_checkpoint_holds_optimizer_state_for_adapters_only(trained):
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(trained["ckpt"]).read_metadata().state_dict_metadata
    optim = [k for k in keys if k.startswith("optimizer.state.")]
    assert optim and all(".lora_A." in k or ".lora_B." in k for k in optim)
    assert "model.layers.0.attention.wq.weight" in keys  # the whole model: an export needs nothing else


def test_resume_equals_the_uninterrupted_run(trained, tmp_path):
    whole = Trainer(lora_run(tmp_path, "whole", trained["base"], **{"training.steps": 4})).fit()
    Trainer(lora_run(tmp_path, "cut", trained["base"], **{"training.steps": 4, "checkpoint.every": 2})).fit()
    cut = tmp_path / "cut" / "checkpoints"
    os.rename(
        cut / "step_00000004", tmp_path / "aside"
    )  # keep step 2 only: the resumed run continues from it
    resumed = Trainer(lora_run(tmp_path, "cut", trained["base"], **{"training.steps": 4})).fit()
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[2:]]


def test_lora_on_a_random_base_warns_once_in_the_banner(trained, tmp_path):
    """Adapters on a seeded random base (no model.init_from) train, but say so in one banner line; with a base,
    nothing is said."""
    warned = [ln for ln in trained["trainer"]._banner() if "warning" in ln]
    assert warned == []
    cfg = lora_run(tmp_path, "random", "", **{"checkpoint.at_end": "false"})
    warned = [ln for ln in Trainer(cfg)._banner() if "warning" in ln]
    assert len(warned) == 1 and "untrained base (no model.init_from)" in warned[0] and "\n" not in warned[0]


def test_targets_and_names():
    assert parse_targets("all") == ["q", "k", "v", "o", "gate", "up", "down"]
    assert parse_targets("v, q") == ["q", "v"]
    with pytest.raises(ConfigError, match="lora.targets"):
        parse_targets("q,x")
    assert (
        peft_key("layers.3.feed_forward.w3.lora_B.weight")
        == "base_model.model.model.layers.3.mlp.up_proj.lora_B.weight"
    )
    assert (
        peft_key("_orig_mod.layers.0.attention.wo.lora_A.weight")
        == "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"
    )


def test_apply_lora_keeps_the_base_names_and_freezes_the_rest():
    with torch.device("meta"):
        model = Llama(llama_args_from_hf_like())
    names = {n for n, _ in model.named_parameters()}
    assert apply_lora(model, LoraConfig(rank=2, targets="q,down")) == 2 * 2
    after = dict(model.named_parameters())
    assert names <= set(after)
    assert {n for n, p in after.items() if p.requires_grad} == {
        f"layers.{i}.{m}.lora_{f}.weight"
        for i in range(2)
        for m in ("attention.wq", "feed_forward.w2")
        for f in "AB"
    }
    assert isinstance(model.layers["0"].attention.wq, LoRALinear)
    assert not isinstance(model.layers["0"].attention.wk, LoRALinear)
    assert apply_lora(model, LoraConfig(rank=0)) == 0


def test_dropout_only_where_gradients_are_taken():
    m = LoRALinear(16, 8, rank=2, scaling=1.0, dropout=0.5)
    torch.nn.init.normal_(m.lora_B.weight)
    x = torch.ones(64, 16)
    with torch.no_grad():
        assert torch.equal(m(x), m(x))  # validation: no dropout
    torch.manual_seed(0)
    assert not torch.equal(m(x), m(x))


def llama_args_from_hf_like():
    from loom.models.llama import FLAVORS

    return FLAVORS["debug"].with_(vocab_size=384)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"lora.init_from": "x"}, "lora.init_from"),  # rank 0: off
        ({"lora.base_dtype": "nf4"}, "lora.base_dtype"),
        ({"lora.rank": 4, "lora.base_dtype": "bfloat16"}, "lora.base_dtype"),  # under float32 compute
        ({"lora.rank": 4, "lora.targets": "q,qq"}, "lora.targets"),
        ({"lora.rank": 4, "training.float8": "tensorwise"}, "training.float8"),
        ({"lora.rank": 4, "model.flavor": "debug_moe"}, "lora.targets"),
        ({"lora.rank": 4, "lora.base_dtype": "nf4", "parallel.tp": 2}, "parallel.tp"),
    ],
)
def test_config_errors(overrides, field):
    with pytest.raises(ConfigError) as err:
        check_config(tiny_config(**overrides))
    assert err.value.field == field and "\n" not in str(err.value)
    check_config(tiny_config(**{"lora.rank": 4, "model.flavor": "debug_moe", "lora.targets": "q,k,v,o"}))


def test_an_adapter_that_does_not_match_the_section_is_one_line(trained):
    model = loom_model(
        trained["base"], LoraConfig(rank=8, alpha=8.0, targets="all", init_from=trained["adapter"])
    )
    with pytest.raises(
        ConfigError, match=r"lora.rank = 8: the adapter .* has r = 4: set lora.rank to match it"
    ):
        load_peft_adapter(model, LoraConfig(rank=8, alpha=8.0, targets="all", init_from=trained["adapter"]))
    with pytest.raises(ConfigError, match="target_modules"):
        load_peft_adapter(model, LoraConfig(rank=4, alpha=8.0, targets="q,v", init_from=trained["adapter"]))


def test_to_peft_needs_a_lora_checkpoint(trained, tmp_path):
    run = tiny_config(
        tmp_path / "plain",
        tmp_path / "cache",
        **{
            "data.source": str(trained["tmp"] / "corpus.txt"),
            "training.steps": 1,
            "checkpoint.at_end": "true",
            "training.global_batch_size": 4,
            "metrics.progress": "false",
        },
    )
    Trainer(run).fit()
    with pytest.raises(ConfigError, match="not written by a LoRA run"):
        convert_main(
            [
                "--from",
                str(tmp_path / "plain" / "checkpoints" / "step_00000001"),
                "--to-peft",
                str(tmp_path / "a"),
            ]
        )


def test_a_bfloat16_base_trains_frozen_in_bf16_with_fp32_adapters(trained, tmp_path):
    """lora.base_dtype bfloat16: every frozen weight (tied or not) is stored in bf16 and stays bitwise, the adapters
    stay fp32 and train, and the run follows the fp32-base run within bf16's rounding; the export loads as before."""
    run = lora_run(
        tmp_path, "bf16", trained["base"], **{"lora.base_dtype": "bfloat16", "training.dtype": "bfloat16"}
    )
    trainer = Trainer(run)
    part = trainer.parts[0]
    frozen = {n: p.detach().clone() for n, p in part.named_parameters() if not p.requires_grad}
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen.values())
    assert all(p.dtype == torch.float32 for p in part.parameters() if p.requires_grad)
    records = trainer.fit()
    for name, p in part.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
    fp32 = Trainer(
        lora_run(
            tmp_path, "fp32", trained["base"], **{"training.dtype": "bfloat16", "checkpoint.at_end": "false"}
        )
    ).fit()
    for a, b in zip(records, fp32):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 2e-2
    assert records[-1]["loss"] < records[0]["loss"]
    ckpt = str(tmp_path / "bf16" / "checkpoints" / "step_00000003")
    assert loom_main(["convert", "--from", ckpt, "--to-hf", str(tmp_path / "merged")]) == 0
    assert torch.isfinite(logits(hf_model(str(tmp_path / "merged")), True)).all()


def test_a_tied_embedding_stays_tied_in_bfloat16():
    import dataclasses

    from loom.models.llama.flavors import FLAVORS

    with torch.device("meta"):
        model = Llama(dataclasses.replace(FLAVORS["debug"], vocab_size=256, tie_embeddings=True))
    apply_lora(model, LoraConfig(rank=2, targets="q", base_dtype="bfloat16"), torch.bfloat16)
    assert model.output.weight is model.tok_embeddings.weight and model.output.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("x_grad", [True, False])
def test_the_fused_lora_product_equals_the_plain_one(x_grad):
    """LoRALinear's fused path (frozen plain base: the adapter added in the matmul epilogue, no weight gradient)
    gives the values and gradients of base + B(s A(x)) computed with plain linears, in float64."""
    torch.manual_seed(0)
    m = LoRALinear(12, 10, rank=3, scaling=2.5).double()
    m.weight.requires_grad_(False)
    torch.nn.init.normal_(m.lora_B.weight)
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=x_grad)
    y = m(x)
    g = torch.randn_like(y)
    y.backward(g)
    grads = [m.lora_A.weight.grad.clone(), m.lora_B.weight.grad.clone()] + (
        [x.grad.clone()] if x_grad else []
    )
    m.zero_grad()
    x2 = x.detach().clone().requires_grad_(x_grad)
    ref = torch.nn.functional.linear(x2, m.weight) + m.lora_B(m.lora_A(x2) * 2.5)
    ref.backward(g)
    want = [m.lora_A.weight.grad, m.lora_B.weight.grad] + ([x2.grad] if x_grad else [])
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    for got, exp in zip(grads, want):
        torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-12)
    assert m.weight.grad is None


def test_lora_linear_opcheck():
    from loom.kernels.lora.op import lora_linear_backward_op, lora_linear_op

    for outs in ((5,), (5, 3, 3)):  # one linear; three of one input (q, k, v)
        x = torch.randn(6, 8, requires_grad=True)
        ws = [torch.randn(o, 8) for o in outs]
        a = [torch.randn(2, 8, requires_grad=True) for _ in outs]
        b = [torch.randn(o, 2, requires_grad=True) for o in outs]
        torch.library.opcheck(lora_linear_op, (x, ws, a, b, 0.5))
        *ys, u = lora_linear_op(x, ws, a, b, 0.5)
        for input_grad in (True, False):
            torch.library.opcheck(
                lora_linear_backward_op,
                (
                    [torch.randn_like(y) for y in ys],
                    x.detach(),
                    ws,
                    [t.detach() for t in a],
                    [t.detach() for t in b],
                    u.detach(),
                    0.5,
                    input_grad,
                ),
            )


@pytest.mark.parametrize("epilogue_max_k", [0, 1 << 30])
def test_linears_of_one_input_in_one_call_equal_one_by_one(epilogue_max_k, monkeypatch):
    """q, k, v through one loom::lora_linear call (layers.project) give each linear's output and gradients, with the
    later input gradients added apart (max K 0) or accumulated in their GEMMs."""
    from loom.kernels.lora import reference
    from loom.models.common.layers import project

    monkeypatch.setattr(reference, "EPILOGUE_MAX_K", epilogue_max_k)

    torch.manual_seed(0)
    mods = [LoRALinear(8, o, rank=2, scaling=1.5, dtype=torch.float64) for o in (6, 4, 4)]
    for m in mods:
        m.weight.requires_grad_(False)
        torch.nn.init.normal_(m.lora_B.weight)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    together = project(x, tuple(mods))
    grads = torch.autograd.grad(
        sum((y * y.detach().sin()).sum() for y in together),
        [x] + [p for m in mods for p in (m.lora_A.weight, m.lora_B.weight)],
    )
    x2 = x.detach().clone().requires_grad_()
    apart = [
        F.linear(x2, m.weight) + F.linear(F.linear(x2, m.lora_A.weight), m.lora_B.weight) * m.scaling
        for m in mods
    ]
    want = torch.autograd.grad(
        sum((y * y.detach().sin()).sum() for y in apart),
        [x2] + [p for m in mods for p in (m.lora_A.weight, m.lora_B.weight)],
    )
    for got, exp in zip(list(together) + list(grads), apart + list(want)):
        torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-12)
    mods[1].disabled = True  # one linear without its adapter: each computes on its own
    torch.testing.assert_close(project(x, tuple(mods))[1], F.linear(x, mods[1].weight))


def test_the_fused_lora_product_compiles_without_graph_breaks():
    m = LoRALinear(16, 8, rank=2, scaling=2.0)
    m.weight.requires_grad_(False)
    x = torch.randn(3, 16, requires_grad=True)
    explained = torch._dynamo.explain(m)(x)
    assert explained.graph_break_count == 0
    torch._dynamo.reset()

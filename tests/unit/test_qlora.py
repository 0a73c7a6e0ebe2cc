"""QLoRA on the CPU: the frozen base linears are torchao NF4 (64 weights per scale, double-quantized scales), the
adapters train, the loss falls, the base stays NF4 and bitwise unchanged; a checkpoint holds the base dequantized
(an export merges from it alone) and resumes exactly; misuse gives one-line errors."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("torchao")

from loom.checkpoint.manager import load_model_only
from loom.config.errors import ConfigError, UserError
from loom.config.sections import LoraConfig
from loom.models.common.lora import apply_lora, dequantized, is_nf4
from loom.models.llama import FLAVORS, Llama
from loom.parallel.shards import quantize_base
from loom.train.trainer import Trainer
from tests.tiny import tiny_config

# NF4 needs whole blocks of 64 x 256 weights per linear: the 125M shape, one block
QLORA = {
    "model.flavor": "125M",
    "model.n_layers": 1,
    "lora.rank": 4,
    "lora.alpha": 8,
    "lora.targets": "all",
    "lora.base_dtype": "nf4",
    "optimizer.lr": 1e-2,
    "optimizer.warmup_steps": 0,
    "metrics.progress": "false",
}
CORPUS = "".join(
    f"record {i}: a small corpus for the quantized base, {i * 11 % 17} words\n" for i in range(300)
)


def run(tmp, name, **extra):
    text = tmp / "corpus.txt"
    if not text.exists():
        text.write_text(CORPUS)
    return tiny_config(tmp / name, tmp / "cache", **{"data.source": str(text), **QLORA, **extra})


def nf4_parts(t) -> dict[str, torch.Tensor]:
    """The stored pieces of an NF4 weight (codes, quantized scales, their factors and mean)."""
    names, _ = t.__tensor_flatten__()
    return {n: getattr(t, n).clone() for n in names}


def test_qlora_trains_on_cpu_with_the_base_frozen_in_nf4(tmp_path):
    trainer = Trainer(run(tmp_path, "run", **{"training.steps": 6, "checkpoint.at_end": "true"}))
    block = trainer.parts[0].layers["0"]
    linears = {"wq": block.attention.wq, "wk": block.attention.wk, "w2": block.feed_forward.w2}
    assert all(is_nf4(m.weight) and not m.weight.requires_grad for m in linears.values())
    before = {k: nf4_parts(m.weight) for k, m in linears.items()}
    others = {
        n: p.detach().clone()
        for n, p in trainer.parts[0].named_parameters()
        if not p.requires_grad and not is_nf4(p)
    }
    records = trainer.fit()
    assert records[-1]["loss"] < records[0]["loss"] - 0.1
    for k, m in linears.items():
        assert is_nf4(m.weight)
        for piece, value in nf4_parts(m.weight).items():
            assert torch.equal(value, before[k][piece]), (k, piece)
    for n, p in trainer.parts[0].named_parameters():
        if n in others:
            assert torch.equal(p, others[n]), n
    # the checkpoint holds the base as the values training used, so the merged export needs nothing else
    ckpt = str(tmp_path / "run" / "checkpoints" / "step_00000006")
    args = trainer.model_args
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    apply_lora(model, trainer.cfg.lora)
    load_model_only(ckpt, model)
    wq = model.layers["0"].attention.wq
    assert not is_nf4(wq.weight) and torch.equal(wq.weight.float(), dequantized(linears["wq"].weight))
    assert torch.equal(wq.lora_B.weight, linears["wq"].lora_B.weight)


def test_nf4_is_close_to_the_weight_it_quantizes():
    with torch.device("meta"):
        model = Llama(FLAVORS["125M"].with_(n_layers=1, vocab_size=384))
    model.to_empty(device="cpu")
    apply_lora(model, LoraConfig(rank=2, targets="q"))
    w = model.layers["0"].attention.wq.weight
    torch.nn.init.normal_(w, std=0.02)
    original = w.detach().clone()
    assert quantize_base(model) == 1
    q = model.layers["0"].attention.wq.weight
    assert (
        is_nf4(q)
        and q.quantized_data.dtype == torch.uint8
        and q.quantized_data.numel() == original.numel() // 2
    )
    err = (dequantized(q) - original).abs()
    assert err.mean() < 0.1 * original.abs().mean() and err.max() < 0.5 * original.abs().max()


def test_resume_equals_the_uninterrupted_run(tmp_path):
    whole = Trainer(run(tmp_path, "whole", **{"training.steps": 4})).fit()
    Trainer(run(tmp_path, "cut", **{"training.steps": 4, "checkpoint.every": 2, "checkpoint.keep": 0})).fit()
    resumed = Trainer(
        run(
            tmp_path,
            "resumed",
            **{
                "training.steps": 4,
                "checkpoint.resume": str(tmp_path / "cut" / "checkpoints" / "step_00000002"),
            },
        )
    ).fit()
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[2:]]


def test_a_shape_without_whole_nf4_blocks_is_a_config_error(tmp_path):
    with pytest.raises(
        ConfigError, match=r"lora.base_dtype = 'nf4': layers.0.attention.wq.weight \[64, 64\]"
    ):
        Trainer(run(tmp_path, "run", **{"model.flavor": "debug", "model.n_layers": 0}))


def test_without_torchao_it_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.dtypes.nf4tensor", None)
    with torch.device("meta"):
        model = Llama(FLAVORS["125M"].with_(n_layers=1, vocab_size=384))
    apply_lora(model, LoraConfig(rank=2, targets="q"))
    with pytest.raises(UserError) as err:
        quantize_base(model)
    assert (
        str(err.value) == "lora.base_dtype nf4 needs the 'torchao' package (pip install 'loom-train[qlora]')"
    )

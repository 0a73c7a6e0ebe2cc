"""A second model family is one folder plus one registry line: the test-only toy family (tests/unit/toy_family:
parallel blocks, its own Hugging Face names) exports, imports, trains from its folder, resumes and converts back
through the same paths as Llama."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("safetensors")

from loom.checkpoint.hf.config import read_hf_config
from loom.checkpoint.hf.dcp_import import import_hf_to_dcp, weights_only_model
from loom.checkpoint.hf.export import export_hf
from loom.checkpoint.hf.reader import llama_args_from_hf, load_hf_weights
from loom.checkpoint.manager import load_model_only
from loom.cli.main import main as loom_main
from loom.models import registry
from tests.tiny import tiny_args
from tests.unit.toy_family import SPEC
from tests.unit.toy_family.model import FLAVORS, ParallelBlock, Toy, ToyArgs

VOCAB = 384


@pytest.fixture
def toy():
    registry.register(SPEC)
    yield FLAVORS["toy_debug"].with_(vocab_size=VOCAB, max_seq_len=64)
    registry.unregister(SPEC.name)


def _random(args: ToyArgs, seed: int = 0) -> Toy:
    torch.manual_seed(seed)
    model = registry.build_model(args)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5) if p.ndim == 1 else p.normal_(0.0, 0.1)
    return model.eval()


def test_the_registry_builds_and_converts_the_toy_family(toy, tmp_path):
    model = _random(toy)
    assert isinstance(model, Toy) and isinstance(model.layers["1"], ParallelBlock)
    assert registry.spec_of(toy) is SPEC
    folder = str(tmp_path / "hf")
    export_hf(model.state_dict(), toy, folder)
    assert read_hf_config(folder)["architectures"] == ["ToyForCausalLM"]
    args = llama_args_from_hf(folder)
    assert type(args) is ToyArgs and args == toy
    back = registry.build_model(args)
    load_hf_weights(back, folder)
    tokens = torch.randint(0, VOCAB, (2, 16))
    assert torch.equal(back.eval()(tokens), model(tokens))
    ckpt = str(tmp_path / "ckpt")
    assert import_hf_to_dcp(folder, ckpt) == toy
    imported = weights_only_model(toy)
    load_model_only(ckpt, imported)
    assert all(torch.equal(imported.state_dict()[k], v) for k, v in model.state_dict().items())


def test_the_toy_family_trains_resumes_and_exports(toy, tmp_path):
    from loom.cli.train import load_config
    from loom.train.trainer import Trainer

    src = str(tmp_path / "hf")
    export_hf(_random(toy).state_dict(), toy, src)
    ckpt = tmp_path / "ckpt"

    def fit(run: str, **more) -> list[dict]:
        cfg, _ = load_config(
            tiny_args(tmp_path / run, **{"run.device": "cpu", "model.init_from": src, **more})
        )
        trainer = Trainer(cfg)
        assert isinstance(trainer.parts[0], Toy)
        return trainer.fit()

    whole = fit("whole", **{"checkpoint.every": 2, "checkpoint.dir": str(ckpt)})
    resumed = fit("resumed", **{"checkpoint.resume": str(ckpt / "step_00000002")})
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole[2:]], rel=1e-6)

    out = str(tmp_path / "out")
    assert loom_main(["convert", "--from", str(ckpt / "step_00000004"), "--to-hf", out]) == 0
    assert llama_args_from_hf(out) == llama_args_from_hf(src)

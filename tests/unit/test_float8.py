"""Float8 linears through torchao (training.float8): which modules are converted, config errors, and a short
bf16 run whose loss curve stays close to the bf16 run without float8 (torchao emulates float8 matmuls on CPU)."""

from __future__ import annotations

import pytest

from loom.config import build_config
from loom.models.common.float8 import apply_float8, float8_available
from loom.models.llama import FLAVORS, Llama
from tests.unit.test_train_modes import max_rel, train

needs_torchao = pytest.mark.skipif(not float8_available(), reason="torchao not installed")


@needs_torchao
def test_block_linears_are_converted_and_the_head_is_not():
    from torchao.float8.float8_linear import Float8Linear

    model = Llama(FLAVORS["debug"].with_(vocab_size=256))
    n = apply_float8(model, "tensorwise")
    per_block = 7  # wq wk wv wo w1 w2 w3
    assert n == per_block * model.args.n_layers
    assert not isinstance(model.output, Float8Linear)
    assert isinstance(model.layers["0"].attention.wq, Float8Linear)
    assert [k for k, _ in model.named_parameters()] == [k for k, _ in Llama(model.args).named_parameters()]


@needs_torchao
def test_unknown_recipe_is_rejected():
    with pytest.raises(ValueError, match="allowed tensorwise, rowwise"):
        apply_float8(Llama(FLAVORS["debug"].with_(vocab_size=256)), "blockwise")


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=pytest.mark.slow)])
def test_float8_loss_curve_stays_close_to_bf16(tmp_path, recipe):
    cache = str(tmp_path / "cache")
    _, base = train(tmp_path, cache, "bf16", **{"training.dtype": "bfloat16"})
    _, f8 = train(tmp_path, cache, recipe, **{"training.dtype": "bfloat16", "training.float8": recipe})
    assert max_rel([r["loss"] for r in f8], [r["loss"] for r in base]) < 0.02
    assert f8[-1]["loss"] < f8[0]["loss"]


def test_float8_config_errors():
    from loom.config.errors import ConfigError
    from loom.methods import check_config

    with pytest.raises(ConfigError, match="bfloat16"):
        check_config(build_config(None, {"training.float8": "tensorwise", "training.dtype": "float32"}))
    with pytest.raises(
        ConfigError, match="parallel.tp > 1: float8 under TP needs torchao.s float8 sharding plans"
    ):
        check_config(
            build_config(
                None, {"training.float8": "tensorwise", "training.dtype": "bfloat16", "parallel.tp": "2"}
            )
        )

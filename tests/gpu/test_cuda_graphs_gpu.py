"""training.cuda_graphs on one GPU: the compiled blocks replayed as CUDA graphs give the losses of the same compiled
run without graphs (fp32, with and without accumulation, a validation pass in between)."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import tiny_overrides

pytestmark = pytest.mark.gpu


def losses(tmp_path, name: str, micro: int, **extra) -> list[float]:
    from loom.config import build_config
    from loom.train.trainer import Trainer

    over = {
        **tiny_overrides(),
        "run.device": "cuda",
        "training.compile": "true",
        "training.steps": 6,
        "training.global_batch_size": 8,
        "training.micro_batch_size": micro,
        "training.eval_every": 3,
        "data.val_fraction": 0.1,
        "run.dir": str(tmp_path / name),
        **extra,
    }
    cfg = build_config(None, {k: str(v) for k, v in over.items()})
    return [r["loss"] for r in Trainer(cfg).fit()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("micro", [8, 4])  # one micro-batch per step; two accumulated
def test_cuda_graphs_give_the_compiled_losses(tmp_path, micro):
    plain = losses(tmp_path, "plain", micro)
    graphs = losses(tmp_path, "graphs", micro, **{"training.cuda_graphs": "true"})
    assert len(plain) == len(graphs) == 6
    for a, b in zip(plain, graphs):
        assert abs(a - b) <= 1e-5 * abs(a)

"""bench.gemms: a flavor's linears as the step runs them, the step's sum over blocks and head, and its refusals."""

import subprocess
import sys

import pytest
import torch

from bench.gemms import linears, step_ms


def test_linears_and_the_steps_sum():
    shapes = linears("8B", None)
    assert shapes["wq"] == (4096, 4096) and shapes["wk"] == (1024, 4096) and shapes["w2"] == (4096, 14336)
    assert shapes["head"] == (128256, 4096) and linears("8B", 1000)["head"] == (1000, 4096)
    three = {"forward": {"ms": 1.0}, "input_grad": {"ms": 2.0}, "weight_grad": {"ms": 3.0}}
    per = {"wq": three, "w1": three, "head": three}
    assert step_ms(per, ["wq", "w1"], n_layers=4) == 6.0 * 2 * 4 + 6.0


@pytest.mark.parametrize(
    "args,why", [([], "no CUDA device"), (["--settings", "foo"], "--settings 'foo': allowed")]
)
def test_refusals_exit_2_with_one_line(args, why):
    if not args and torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the bench would run")
    proc = subprocess.run([sys.executable, "-m", "bench.gemms", *args], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and why in proc.stderr, proc.stderr

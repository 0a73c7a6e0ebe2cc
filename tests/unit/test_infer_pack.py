"""Packed projections (loom.infer.pack): a packed model computes what the plain one does (fp32, with and without
q/k/v biases), keeps its parameters (same objects, same state_dict, a load reaches the packed tensor), generates the
same greedy tokens, and unpacks back to plain linears; a group that cannot pack (one linear in another dtype) stays."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from loom.infer import Generator, SamplingParams
from loom.infer.pack import PackedLinear, pack, unpack
from tests.unit.test_speculative import PROMPTS, tiny_model


@pytest.mark.parametrize("bias", [False, True])
def test_packed_model_computes_the_same_logits(bias):
    plain = tiny_model(0, attention_bias=bias)
    if bias:
        with torch.no_grad():
            for block in plain.layers.values():
                for m in (block.attention.wq, block.attention.wk, block.attention.wv):
                    m.bias.normal_()
    model = copy.deepcopy(plain)
    params = dict(model.named_parameters())
    assert pack(model) == 2 * len(model.layers)  # attention and feed-forward of every block
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    assert model.state_dict().keys() == plain.state_dict().keys()
    attn = model.layers["0"].attention
    assert type(attn.wk) is PackedLinear
    assert attn.wk.weight.untyped_storage().data_ptr() == attn.wq.packed_weight.untyped_storage().data_ptr()
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), plain(tokens), atol=1e-5, rtol=1e-5)
        other = tiny_model(3, attention_bias=bias)
        model.load_state_dict(other.state_dict())  # writes into the views: the packed tensor follows
        torch.testing.assert_close(model(tokens), other(tokens), atol=1e-5, rtol=1e-5)
    unpack(model)
    assert (
        all(type(m) is nn.Linear for m in (attn.wq, attn.wk, attn.wv))
        and "packed_weight" not in attn.wq._buffers
    )


def test_packed_generation_gives_the_same_tokens():
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    target = tiny_model(0)
    expected = [
        o.token_ids
        for o in Generator.from_model(copy.deepcopy(target), compile=False).generate_ids(PROMPTS, params)
    ]
    gen = Generator.from_model(target, compile=False, pack=True)
    assert type(target.layers["0"].feed_forward.w1) is PackedLinear
    assert [o.token_ids for o in gen.generate_ids(PROMPTS, params)] == expected
    gen.engine.close()
    assert type(target.layers["0"].feed_forward.w1) is nn.Linear  # the model back as it came


def test_modules_that_cannot_pack_stay():
    model = tiny_model(0)
    model.layers["0"].attention.wk = nn.Linear(32, 16, bias=False).to(torch.float64)  # another dtype
    assert pack(model) == 2 * len(model.layers) - 1
    assert type(model.layers["0"].attention.wq) is nn.Linear

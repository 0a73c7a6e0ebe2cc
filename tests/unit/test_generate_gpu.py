"""The CUDA paths the CPU suite cannot reach: decode steps under compiled blocks (packed projections, batch-1
matmuls as Triton reductions) and CUDA graphs give the tokens of the eager engine (greedy, fp32), for plain
decoding, seeded sampling, prompt lookup and a draft model; the cache in bf16 stays within bf16 noise of the full
forward. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from loom.infer import DraftModel, Generator, PromptLookup, SamplingParams
from loom.infer.engine import Engine
from tests.unit.test_speculative import PROMPTS, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _gen(model, graphs: bool, **kw) -> Generator:
    return Generator.from_model(model, compile=graphs, cuda_graphs=graphs, **kw)


@pytest.mark.parametrize("mode", ["greedy", "sampled", "lookup", "draft"])
def test_graphs_and_compile_give_the_eager_tokens(mode):
    target = tiny_model(0).cuda()
    params = SamplingParams(
        max_new_tokens=24,
        ignore_eos=True,
        **({"temperature": 0.8, "top_k": 20, "seed": 3} if mode == "sampled" else {}),
    )
    spec = {"lookup": lambda: PromptLookup(k=3), "draft": lambda: DraftModel(tiny_model(1).cuda(), k=3)}
    eager = _gen(copy.deepcopy(target), False).generate_ids(PROMPTS, params)
    fast = _gen(target, True, speculative=spec[mode]() if mode in spec else None, pack=True)
    for _ in range(2):  # the second call replays the captured graphs
        assert [o.token_ids for o in fast.generate_ids(PROMPTS, params)] == [o.token_ids for o in eager]
    assert fast.engine._graphs  # the steps ran from graphs


def test_bf16_cache_against_the_full_forward():
    model = tiny_model(0).cuda().to(torch.bfloat16)
    rows = torch.randint(0, 64, (3, 20), device="cuda")
    with torch.no_grad():
        full = model(rows).float()  # (B, S, V)
    engine = Engine(model, compile=True, cuda_graphs=True)
    logits, _, _ = engine.start([r[:8].tolist() for r in rows], reserve=12)
    errs = [(logits.float() - full[:, 7]).abs().max()]
    pos = torch.full((3,), 8, device="cuda")
    for i in range(8, 20):
        out = engine.step(rows[:, i : i + 1], pos[:, None])[:, 0].float()
        errs.append((out - full[:, i]).abs().max())
        pos += 1
    assert max(errs) < 0.05 * full.abs().max()


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_graphs_on_a_second_gpu_from_a_thread_after_graphs_on_the_first():
    """Async GRPO's case: the trainer's generator captured graphs on cuda:0, then the sampler's thread captures on
    cuda:1 (a process-wide capture stream made on cuda:0 made that capture fail)."""
    from concurrent.futures import ThreadPoolExecutor

    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    first = _gen(tiny_model(0).cuda(), True).generate_ids(PROMPTS, params)
    second = tiny_model(0).to("cuda:1")
    eager = _gen(copy.deepcopy(second), False).generate_ids(PROMPTS, params)

    def on_gpu1():
        with torch.cuda.device(1), torch.cuda.stream(torch.cuda.Stream(1)):
            fast = _gen(second, True)
            return [o.token_ids for o in fast.generate_ids(PROMPTS, params)], fast.engine._graphs

    with ThreadPoolExecutor(1) as pool:
        tokens, graphs = pool.submit(on_gpu1).result()
    assert graphs and tokens == [o.token_ids for o in eager] == [o.token_ids for o in first]

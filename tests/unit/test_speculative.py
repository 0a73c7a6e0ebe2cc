"""Speculative decoding: greedy output token for token equal to target-only greedy decoding (prompt lookup, a draft
model that always agrees, one that mostly does not, with the repetition penalty, rows of different lengths), and
under sampling every emitted token follows the target's distribution: the rejection step alone against a fixed p
and q, and end to end against the exact marginals of the model's second and third tokens (small vocabulary,
fixed seeds, bounds far below the draft's own distance from the target)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from loom.config.errors import ConfigError
from loom.infer import DraftModel, Generator, PromptLookup, SamplingParams
from loom.infer.speculative import _Ngrams, speculate, verify
from loom.models.llama import Llama, LlamaArgs


def tiny_model(seed: int, vocab: int = 64, scale: float = 0.2, **kw) -> Llama:
    torch.manual_seed(seed)
    model = Llama(
        LlamaArgs(
            dim=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            ffn_dim=64,
            vocab_size=vocab,
            rope_theta=10000.0,
            max_seq_len=64,
            **kw,
        )
    ).eval()
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, scale)
    return model


def gen(model, **kw) -> Generator:
    return Generator.from_model(model, compile=False, cuda_graphs=False, **kw)


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [5, 5, 5, 5, 6, 5, 5], [11, 12, 13, 14, 11, 12]]


@pytest.mark.parametrize("proposer", ["lookup", "same", "other"])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_output_equals_target_only(proposer, penalty):
    target = tiny_model(0)
    params = SamplingParams(max_new_tokens=24, repetition_penalty=penalty, ignore_eos=True)
    expected = [o.token_ids for o in gen(target).generate_ids(PROMPTS, params)]
    spec = {
        "lookup": lambda: PromptLookup(k=3),
        "same": lambda: DraftModel(copy.deepcopy(target), k=4),  # agrees always: every guess kept
        "other": lambda: DraftModel(tiny_model(1), k=2),
    }[proposer]()
    g = gen(target, speculative=spec)
    outs = g.generate_ids(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    assert g.stats.target_steps < 24 * len(PROMPTS)
    if proposer == "same" and penalty == 1.0:  # the draft proposes without the penalty
        assert g.stats.acceptance == 1.0
    if proposer == "other":
        assert g.stats.acceptance < 0.9


class Knowing:
    """A proposer that knows each row's greedy continuation and guesses each next token right with probability
    ``rate`` (else the token after it): what the benchmark's acceptance curve runs."""

    def __init__(self, k: int, rate: float, continuations: list[list[int]], vocab: int):
        self.k, self.rate, self.continuations, self.vocab = k, rate, continuations, vocab

    def run(self, engine, prompts, params, sequences):
        return speculate(engine, prompts, params, sequences, self)

    def start(self, prompts, reserve, params):
        self.emitted, self.random = [0] * len(prompts), random.Random(0)

    def propose(self, pending, pending_host, pos, done):
        guesses = []
        for b, finished in enumerate(done):
            self.emitted[b] += 0 if finished else 1  # the pending token
            cont = self.continuations[b][self.emitted[b] : self.emitted[b] + self.k]
            cont = cont + [0] * (self.k - len(cont))
            guesses.append([t if self.random.random() < self.rate else (t + 1) % self.vocab for t in cont])
        return torch.tensor(guesses), None, [not d for d in done]

    def accepted(self, kept, kept_host, drafts_host, done):
        for b, m in enumerate(kept_host):
            self.emitted[b] += 0 if done[b] else m

    def advance(self, prev, running):
        pass


def test_acceptance_counts_the_kept_guesses():
    """Guesses that are the target's greedy tokens are all kept: k + 1 tokens per target forward; guesses right
    with probability p on their own keep rate p + p^2 + ... + p^k of k on average."""
    target, k, new = tiny_model(0), 4, 41
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    plain = [o.token_ids for o in gen(target).generate_ids(PROMPTS, params)]
    g = gen(target)
    assert [
        o.token_ids for o in g.generate_ids(PROMPTS, params, speculative=Knowing(k, 1.0, plain, 64))
    ] == plain
    assert g.stats.acceptance == 1.0
    assert g.stats.target_steps == (new - 1) // (
        k + 1
    )  # the prefill gives the first token, each forward k + 1
    rate = 0.6
    assert [
        o.token_ids for o in g.generate_ids(PROMPTS, params, speculative=Knowing(k, rate, plain, 64))
    ] == plain
    expected = sum(rate**i for i in range(1, k + 1)) / k
    assert abs(g.stats.acceptance - expected) < 0.1, (g.stats.acceptance, expected)


def test_eos_and_stop_ids_inside_a_kept_run_end_the_sequence():
    target = tiny_model(0)
    plain = gen(target).generate_ids(PROMPTS, max_new_tokens=20, ignore_eos=True)
    stop = plain[0].token_ids[5]  # a token the first row emits mid-way: with it as EOS, rows stop there
    expected = gen(target, eos_ids=(stop,)).generate_ids(PROMPTS, max_new_tokens=20)
    spec = gen(target, eos_ids=(stop,), speculative=DraftModel(copy.deepcopy(target), k=4))
    got = spec.generate_ids(PROMPTS, max_new_tokens=20)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in expected]
    assert got[0].finish_reason == "eos"


def test_prompt_lookup_finds_the_latest_continuation():
    row = _Ngrams([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], min_n=1, max_n=3)
    assert row.propose(3) == [7, 8, 1]  # the latest earlier "1 2 3" continues with 7 8 1
    row = _Ngrams([4, 5, 6], min_n=1, max_n=2)
    assert row.propose(2) is None
    row = _Ngrams([4, 5, 4], min_n=1, max_n=2)
    assert row.propose(3) == [5, 4, 4]  # a short continuation is padded with its last token
    with pytest.raises(ConfigError):
        PromptLookup(k=0)


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_rejection_step_follows_the_target():
    """Fixed p (k + 1 positions) and q: the first emitted token follows p[0], and the second (when the first was
    a kept draft) follows p[1]: the target's, not the draft's."""
    g = torch.Generator().manual_seed(0)
    vocab, k, n = 6, 2, 40000
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1)
    assert _tv(p[0], q[0]) > 0.2 and _tv(p[1], q[1]) > 0.2
    logits = p.log()[None].expand(n, -1, -1)
    for point_mass in (False, True):
        qs = None if point_mass else q[None].expand(n, -1, -1)
        drafts = torch.multinomial(q, n, replacement=True, generator=g).T  # (n, k)
        kept, nxt = verify(logits, drafts, qs, SamplingParams(temperature=1.0), g)
        first = torch.where(kept > 0, drafts[:, 0], nxt)
        second = torch.where(kept > 1, drafts[:, 1], nxt)[kept >= 1]
        for tokens, ref in ((first, p[0]), (second, p[1])):
            freq = torch.bincount(tokens, minlength=vocab).float() / len(tokens)
            assert _tv(freq, ref) < 0.02, (point_mass, freq, ref)


def _exact_marginals(
    model: Llama, prompt: list[int], vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's exact distributions of its 1st, 2nd and 3rd new tokens (temperature 1) by enumeration."""
    with torch.no_grad():
        p1 = model(torch.tensor([prompt]))[0, -1].softmax(-1)  # (V,)
        two = torch.tensor([prompt + [a] for a in range(vocab)])
        p2_given = model(two)[:, -1].softmax(-1)  # (V, V): [a, b] = p(b | a)
        three = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p3_given = model(three)[:, -1].softmax(-1).view(vocab, vocab, vocab)  # [a, b, c]
    joint2 = p1[:, None] * p2_given  # (V, V)
    return p1, joint2.sum(0), (joint2[..., None] * p3_given).sum((0, 1))


@pytest.mark.parametrize("proposer", ["draft", "lookup"])
def test_sampled_tokens_follow_the_target_distribution(proposer):
    vocab, n = 12, 3000
    target, draft = tiny_model(0, vocab=vocab, scale=0.5), tiny_model(5, vocab=vocab, scale=0.5)
    prompt = [1, 2, 1, 2, 1]
    marginals = _exact_marginals(target, prompt, vocab)
    draft_marginals = _exact_marginals(draft, prompt, vocab)
    # a test that cannot pass by taking the draft's tokens
    assert _tv(marginals[1], draft_marginals[1]) > 0.15
    spec = DraftModel(draft, k=2) if proposer == "draft" else PromptLookup(k=2, max_ngram=2)
    g = gen(target, speculative=spec, max_batch=n)
    outs = g.generate_ids(
        [prompt] * n, SamplingParams(max_new_tokens=3, temperature=1.0, seed=7, ignore_eos=True)
    )
    tokens = torch.tensor([o.token_ids for o in outs])  # (n, 3)
    assert g.stats.accepted > 100  # guesses were kept, not only the target's own draws
    for i, ref in enumerate(marginals):
        freq = torch.bincount(tokens[:, i], minlength=vocab).float() / n
        assert _tv(freq, ref) < 0.05, (i, freq, ref)

"""The sampler and loader: permutations, packing, layout independence, resume, epochs, mixtures."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest
import torch

from loom.config.errors import UserError
from loom.config.sections import DataConfig
from loom.data import build_loader, prepare_data
from loom.data.loader import Loader, Windows, document_positions, make_micro_batch, permute
from loom.data.token_file import TokenFile, TokenFileWriter
from loom.data.tokenizers import ByteTokenizer

EOS = 65535
SEQ = 4


def counting_file(path, n_tokens: int) -> TokenFile:
    """Token i is i (one document, never EOS), so the first token of a window names the window."""
    w = TokenFileWriter(str(path), eos_id=EOS, vocab_size=65536, tokenizer="test-identity")
    w.add(torch.arange(n_tokens - 1))  # the writer adds the EOS that ends it
    w.close()
    return TokenFile(str(path))


def make_loader(
    tf: TokenFile,
    *,
    dp_rank=0,
    dp_size=1,
    micro_batch=1,
    accumulation=1,
    seed=0,
    val_fraction=0.0,
    seq_len=SEQ,
) -> Loader:
    windows = Windows(tf, seq_len, val_fraction, "counting")
    return Loader(
        [windows],
        [1.0],
        seed=seed,
        eos_id=EOS,
        dp_rank=dp_rank,
        dp_size=dp_size,
        micro_batch=micro_batch,
        accumulation=accumulation,
    )


def window_ids(mb, seq_len=SEQ) -> list[int]:
    return (mb.inputs[:, 0] // seq_len).tolist()


@pytest.fixture
def counting(tmp_path) -> TokenFile:
    return counting_file(tmp_path / "count.bin", 40 * SEQ + 1)  # 40 windows


# ---- permute -----------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 4097])
def test_permute_is_a_bijection(n):
    for seed in (0, 1, 12345):
        out = permute(torch.arange(n), n, seed)
        assert out.dtype == torch.int64
        assert sorted(out.tolist()) == list(range(n))


@pytest.mark.parametrize("n", [7, 1000, 4097])
def test_permute_depends_on_the_seed(n):
    perms = {tuple(permute(torch.arange(n), n, seed).tolist()) for seed in range(5)}
    assert len(perms) == 5
    assert tuple(range(n)) not in perms


def test_permute_of_a_subset_agrees_with_the_whole():
    """The sampler asks for a few indices at a time: any slice must agree with the full permutation."""
    full = permute(torch.arange(1000), 1000, 9)
    assert torch.equal(permute(torch.tensor([999, 3, 500]), 1000, 9), full[[999, 3, 500]])


# ---- packing --------------------------------------------------------------------------


def test_document_positions_restart_after_eos():
    e = 9
    inputs = torch.tensor([[1, 2, e, 3, 4, 5, e, e], [e, 1, 2, 3, 4, 5, 6, 7]])  # (B, S)
    pos, doc = document_positions(inputs, e)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert doc.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert (doc.diff(dim=1) >= 0).all()


def test_micro_batch_shifts_labels_by_one():
    windows = [torch.arange(5), torch.arange(10, 15)]  # (S+1,) each
    mb = make_micro_batch(windows, eos_id=12)
    assert mb.inputs.tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert mb.labels.tolist() == [[1, 2, 3, 4], [11, 12, 13, 14]]
    assert mb.positions.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]
    assert mb.document_ids.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1]]


def test_windows_overlap_by_one_token(counting):
    w = Windows(counting, SEQ, 0.0, "counting")
    assert w.n_train == 40
    assert w.window(0).tolist() == [0, 1, 2, 3, 4]
    assert w.window(39).tolist() == [156, 157, 158, 159, EOS]


# ---- layouts ----------------------------------------------------------------------------

LAYOUTS = [(1, 8, 1), (1, 1, 8), (2, 2, 2), (2, 4, 1), (4, 1, 2), (8, 1, 1)]  # (dp, micro, accumulation)


def run_layout(tf, dp, mb, acc, steps, seed=0):
    """Per step: rank 0's global hash and every window any rank received."""
    loaders = [
        make_loader(tf, dp_rank=r, dp_size=dp, micro_batch=mb, accumulation=acc, seed=seed) for r in range(dp)
    ]
    hashes, received = [], []
    for _ in range(steps):
        got = []
        for r, loader in enumerate(loaders):
            data = loader.next_step(with_hash=(r == 0))
            assert len(data.micro_batches) == acc
            for m in data.micro_batches:
                assert m.inputs.shape == (mb, SEQ)
                got += [tuple(row) for row in torch.cat([m.inputs, m.labels[:, -1:]], 1).tolist()]
            if r == 0:
                hashes.append(data.global_hash)
        received.append(got)
    return hashes, received


def test_global_batch_is_the_same_for_every_layout(counting):
    ref_hashes, ref = run_layout(counting, 1, 8, 1, steps=7)
    for h, step in zip(ref_hashes, ref):  # the hash is over the windows, in global order
        d = hashlib.blake2b(digest_size=16)
        for window in step:
            d.update(torch.tensor(window, dtype=torch.int32).numpy().tobytes())
        assert d.hexdigest() == h
    for dp, mb, acc in LAYOUTS[1:]:
        hashes, received = run_layout(counting, dp, mb, acc, steps=7)
        assert hashes == ref_hashes, (dp, mb, acc)
        for step, ref_step in zip(received, ref):  # every rank's share together is exactly the global batch
            assert Counter(step) == Counter(ref_step), (dp, mb, acc)


def test_ranks_get_disjoint_slices(counting):
    _, received = run_layout(counting, 4, 1, 2, steps=3)
    for step in received:
        assert len(set(step)) == len(step) == 8  # 8 of 40 windows, no repeats within a step


def test_different_seeds_give_different_batches(counting):
    a, _ = run_layout(counting, 1, 8, 1, steps=3, seed=0)
    b, _ = run_layout(counting, 1, 8, 1, steps=3, seed=1)
    assert a != b


# ---- resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize("resume_layout", [(1, 4, 2), (2, 2, 2), (4, 1, 2)])
def test_resume_continues_exactly(counting, resume_layout):
    straight = make_loader(counting, micro_batch=8)
    expected = [straight.next_step(with_hash=True).global_hash for _ in range(9)]

    first = make_loader(counting, dp_size=2, micro_batch=2, accumulation=2)
    assert [first.next_step(with_hash=True).global_hash for _ in range(4)] == expected[:4]
    state = json.loads(json.dumps(first.state_dict()))  # it must survive a checkpoint as plain data

    dp, mb, acc = resume_layout
    resumed = make_loader(counting, dp_size=dp, micro_batch=mb, accumulation=acc)
    resumed.load_state_dict(state)
    assert [resumed.next_step(with_hash=True).global_hash for _ in range(5)] == expected[4:]


def test_resume_refuses_another_number_of_sources(counting, tmp_path):
    other = counting_file(tmp_path / "other.bin", 20 * SEQ + 1)
    two = Loader(
        [Windows(counting, SEQ, 0.0, "a"), Windows(other, SEQ, 0.0, "b")],
        [1.0, 1.0],
        seed=0,
        eos_id=EOS,
        dp_rank=0,
        dp_size=1,
        micro_batch=2,
        accumulation=1,
    )
    with pytest.raises(UserError, match="2 sources"):
        make_loader(counting).load_state_dict(two.state_dict())


# ---- epochs and validation ------------------------------------------------------------------------


def test_each_epoch_visits_every_window_once_in_a_new_order(tmp_path):
    tf = counting_file(tmp_path / "tiny.bin", 10 * SEQ + 1)  # 10 windows
    loader = make_loader(tf, micro_batch=5, seed=4)
    seen = [w for _ in range(8) for w in window_ids(loader.next_step().micro_batches[0])]  # 4 epochs
    epochs = [seen[i : i + 10] for i in range(0, 40, 10)]
    for order in epochs:
        assert sorted(order) == list(range(10))
    assert len({tuple(order) for order in epochs}) == 4


def test_epochs_span_step_boundaries(tmp_path):
    """When the batch does not divide the epoch, a step takes the end of one epoch and the start of the next."""
    tf = counting_file(tmp_path / "tiny.bin", 7 * SEQ + 1)  # 7 windows, 3 per step
    loader = make_loader(tf, micro_batch=3, seed=2)
    seen = [w for _ in range(7) for w in window_ids(loader.next_step().micro_batches[0])]
    for e in range(3):
        assert sorted(seen[7 * e : 7 * e + 7]) == list(range(7))


def test_validation_windows_never_reach_training(tmp_path):
    tf = counting_file(tmp_path / "v.bin", 50 * SEQ + 1)  # 50 windows, 10 held out
    train = make_loader(tf, dp_size=1, micro_batch=8, val_fraction=0.2)
    assert (train.sources[0].n_train, train.sources[0].n_val) == (40, 10)
    trained = {w for _ in range(12) for w in window_ids(train.next_step().micro_batches[0])}  # > 2 epochs
    assert trained == set(range(40))

    val = {}
    for rank in range(2):
        loader = make_loader(tf, dp_rank=rank, dp_size=2, micro_batch=2, val_fraction=0.2)
        batches = loader.validation(2)
        assert [window_ids(b) for b in batches] == [window_ids(b) for b in loader.validation(2)]  # fixed
        val[rank] = {w for b in batches for w in window_ids(b)}
    assert val[0] | val[1] <= set(range(40, 50))
    assert not val[0] & val[1]  # ranks share the work, they do not repeat it


def test_no_validation_when_the_fraction_is_zero(counting):
    loader = make_loader(counting, val_fraction=0.0)
    assert loader.validation(3) == []


# ---- mixtures -----------------------------------------------------------------------------------


def one_letter_file(path, letter: str, docs: int) -> str:
    """A byte-tokenized token file of ``letter`` documents: each window's content names its source."""
    tok = ByteTokenizer()
    w = TokenFileWriter(str(path), eos_id=tok.eos_id, vocab_size=tok.vocab_size, tokenizer=tok.fingerprint())
    for i in range(docs):
        w.add(tok.encode(letter * (5 + i % 11)))
    w.close()
    return str(path)


def mixture_loader(tmp_path, seed: int, dp_rank=0, dp_size=1):
    a = one_letter_file(tmp_path / "a.bin", "a", 300)
    b = one_letter_file(tmp_path / "b.bin", "b", 100)
    tok = ByteTokenizer()
    cfg = DataConfig(source=f"{a}:0.7,{b}:0.3", val_fraction=0.0)
    files = prepare_data(cfg, tok, str(tmp_path / "cache"))
    assert [f[1] for f in files] == [0.7, 0.3]
    return build_loader(
        cfg,
        tok,
        files,
        seq_len=16,
        seed=seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
        micro_batch=50 // dp_size,
        accumulation=1,
    )


def source_of(mb) -> list[str]:
    has_a = (mb.inputs == ord("a")).any(dim=1)
    has_b = (mb.inputs == ord("b")).any(dim=1)
    assert not (has_a & has_b).any()
    return ["a" if x else "b" for x in has_a.tolist()]


def test_mixture_draws_in_proportion(tmp_path):
    loader = mixture_loader(tmp_path, seed=0)
    drawn = Counter(s for _ in range(40) for s in source_of(loader.next_step().micro_batches[0]))  # 2000
    assert sum(drawn.values()) == 2000
    assert abs(drawn["a"] / 2000 - 0.7) < 0.05
    assert loader.state_dict()["counts"] == [drawn["a"], drawn["b"]]


def test_mixture_is_deterministic_and_layout_independent(tmp_path):
    one = mixture_loader(tmp_path, seed=5)
    again = mixture_loader(tmp_path, seed=5)
    other_seed = mixture_loader(tmp_path, seed=6)
    two_ranks = mixture_loader(tmp_path, seed=5, dp_size=2)
    hashes = [one.next_step(with_hash=True).global_hash for _ in range(6)]
    assert [again.next_step(with_hash=True).global_hash for _ in range(6)] == hashes
    assert [two_ranks.next_step(with_hash=True).global_hash for _ in range(6)] == hashes
    assert [other_seed.next_step(with_hash=True).global_hash for _ in range(6)] != hashes

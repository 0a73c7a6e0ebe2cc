"""Context parallelism: the load-balanced sequence layout, the all-gather attention against one process's
causal attention (outputs and q/k/v gradients, GQA, packed documents crossing the chunks), ring attention
the same way (on gloo ranks, and on 2-4 threads standing in for ranks in one process), and layout
invariance of training with cp alone and composed with FSDP, HSDP, TP, PP and accumulation, with packed
documents too (fp32, loss and grad norm within 1e-5 of one process at every step), validation included;
config errors for what cp does not support yet."""

from __future__ import annotations

import json
import random

import pytest
import torch

from loom.config import ConfigError, build_config
from loom.kernels.attention import reference as R
from loom.parallel.context_parallel import (
    chunk_ids,
    local_positions,
    merge_blocks,
    pair_bounds,
    ring_blocks,
    shard_sequence,
)
from tests.distributed.harness import losses, run_fn, run_jobs
from tests.distributed.test_model_parallel import STEPS, job

# ---- the layout (pure logic) --------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shards_cover_the_sequence_once_with_equal_causal_work(cp):
    seq = 8 * cp
    t = torch.arange(2 * seq).view(2, seq)  # (B, S)
    shards = [shard_sequence(t, r, cp) for r in range(cp)]
    assert all(s.shape == (2, seq // cp) for s in shards)
    assert sorted(torch.cat(shards, 1)[0].tolist()) == list(range(seq))
    for r, s in enumerate(shards):
        assert torch.equal(local_positions(seq // cp, r, cp), s[0])
    work = [sum(a + 1 for a in chunk_ids(r, cp)) for r in range(cp)]  # key chunks each rank's queries see
    assert len(set(work)) == 1


def test_merging_key_blocks_by_lse_equals_attention_over_all_keys():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 18, 8), torch.randn(2, 2, 18, 8)
    scale = 8**-0.5
    whole, _ = R.attention_forward(torch.cat([torch.zeros(2, 4, 12, 8), q], 2), k, v, True, None, 0, scale)
    blocks = [
        R.attention_forward(q, k[:, :, i : i + 6], v[:, :, i : i + 6], i == 12, None, 0, scale)
        for i in (0, 6, 12)
    ]
    merged = merge_blocks([o for o, _ in blocks], [lse for _, lse in blocks])
    torch.testing.assert_close(merged, whole[:, :, 12:], rtol=1e-5, atol=1e-6)


def test_merging_blocks_that_see_nothing_gives_zero_not_nan():
    out, lse = torch.ones(1, 1, 2, 4), torch.tensor([[[float("-inf"), 0.0]]])
    merged = merge_blocks([out, out], [lse, lse])
    assert torch.equal(merged[0, 0, 0], torch.zeros(4)) and torch.equal(merged[0, 0, 1], torch.ones(4))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ring_steps_cover_every_causal_chunk_pair_once_with_equal_work(cp):
    """Over the cp steps of the ring (K/V of rank - s at step s) each rank computes every (query chunk, key
    chunk <= it) pair of its two chunks exactly once, and every step costs the same on every rank (two chunk
    pairs, a diagonal block counting half)."""
    for rank in range(cp):
        pairs = [(g, j) for s in range(cp) for _, _, g, j in ring_blocks(rank, (rank - s) % cp, cp)]
        want = [(g, j) for g in chunk_ids(rank, cp) for j in range(g + 1)]
        assert sorted(pairs) == sorted(want)
        cost = [
            sum(0.5 if g == j else 1 for _, _, g, j in ring_blocks(rank, (rank - s) % cp, cp))
            for s in range(cp)
        ]
        assert set(cost) == {2}


@pytest.mark.parametrize("docs", [False, True])
def test_ring_attention_op_in_one_process_matches_attention(docs, tmp_path):
    """The ring's custom ops on a ring of one (its own K/V: three chunk pairs merged, each block's backward
    normalized by the row's lse) against plain attention, values and q/k/v gradients; torch.library.opcheck on
    the forward op (fake layouts, autograd registration, torch.compile)."""
    import torch.distributed as dist

    from loom.kernels.attention.op import flash_attention
    from loom.parallel.context_parallel import ring_attention, ring_attn_op

    own = not dist.is_initialized()  # a one-process group left by an earlier in-process test serves as well
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 8, h, 4).transpose(1, 2).requires_grad_() for h in (4, 2, 2))  # GQA 4/2
        dout = torch.randn(2, 4, 8, 4)
        ids = R.doc_ids_from_positions(doc_positions(2, 8, seed=1)) if docs else None
        bounds = R.document_bounds(ids) if docs else None
        out = ring_attention(q, k, v, bounds, dist.group.WORLD, 0, 1)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref = flash_attention(q, k, v, causal=True, doc_ids=ids)
        want = torch.autograd.grad(ref, (q, k, v), dout)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        for got, exp in zip(grads, want):
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)
        torch.library.opcheck(ring_attn_op, (q, k, v, bounds, dist.group.WORLD.group_name, 0, 1, 0.5))
    finally:
        if own:
            dist.destroy_process_group()


class ThreadRing:
    """cp rank ``rank`` of a ring of threads in one process: the cp group's point-to-point transport replaced by
    mailboxes, with its semantics (``shift`` hands the tensor itself to the next rank's box for ``tag``; the
    request's ``wait`` copies the previous rank's into the receive buffer and returns once the next rank has
    taken this one), so the ring's own schedule, block choice, merge, dK/dV hand-off and buffers run as on cp
    ranks."""

    def __init__(self, rank: int, size: int, boxes: dict):
        self.rank, self.size, self.boxes = rank, size, boxes

    def shift(self, t: torch.Tensor, tag: int):
        import threading

        taken = threading.Event()
        self.boxes[(self.rank + 1) % self.size, tag].put((t, taken))
        recv = torch.empty_like(t)
        return recv, [MailRequest(recv, self.boxes[self.rank, tag], taken)]


class MailRequest:
    """A ``ThreadRing`` shift's request (a class of its own: one defined per call is a reference cycle that would
    keep its receive buffer alive until the garbage collector runs)."""

    def __init__(self, recv: torch.Tensor, box, taken):
        self.recv, self.box, self.taken = recv, box, taken

    def wait(self) -> None:
        sent, done = self.box.get(timeout=60)
        self.recv.copy_(sent)
        del sent  # copied: the sender's buffer is its own again (not kept while this rank waits on its send)
        done.set()
        assert self.taken.wait(timeout=60), "the next rank never received"


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_over_simulated_ranks_matches_one_process(cp, docs):
    """The ring's forward and backward (``_ring_forward`` / ``_ring_backward``) on cp threads passing K/V and
    dK/dV round mailboxes: each rank's output, log-sum-exp and q/k/v gradients equal its shard of one process's
    attention (GQA 4/2, causal; packed documents crossing chunks and ranks), fp32 within 1e-5."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    from loom.parallel.context_parallel import _ring_backward, _ring_forward

    torch.manual_seed(cp)
    seq, scale = 6 * cp, 8**-0.5
    q, k, v = torch.randn(2, 4, seq, 8), torch.randn(2, 2, seq, 8), torch.randn(2, 2, seq, 8)
    dout = torch.randn(2, 4, seq, 8)
    bounds = R.document_bounds(R.doc_ids_from_positions(doc_positions(2, seq, seed=cp))) if docs else None
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = R.attention_forward(*full, True, bounds, 0, scale)
    ref.backward(dout)
    boxes = {(r, tag): queue.Queue() for r in range(cp) for tag in (0, 1)}

    def rank(r: int):
        ring = ThreadRing(r, cp, boxes)
        mine = [shard_sequence(t, r, cp, dim=2) for t in (q, k, v)]
        out, lse = _ring_forward(*mine, bounds, ring, scale)
        grads = _ring_backward(shard_sequence(dout, r, cp, dim=2), *mine, out, lse, None, bounds, ring, scale)
        return out, lse, grads

    with ThreadPoolExecutor(cp) as pool:
        results = [f.result(timeout=120) for f in [pool.submit(rank, r) for r in range(cp)]]
    assert all(box.empty() for box in boxes.values())  # every message received once
    for r, (out, lse, grads) in enumerate(results):
        torch.testing.assert_close(out, shard_sequence(ref, r, cp, dim=2), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, shard_sequence(ref_lse, r, cp, dim=2), rtol=1e-5, atol=1e-5)
        for got, whole in zip(grads, full):
            torch.testing.assert_close(got, shard_sequence(whole.grad, r, cp, dim=2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_holds_two_blocks_of_one_ranks_kv_forward_and_five_backward(cp):
    """What the planner's ``cp_attention_working`` counts for the ring: traced by the planner's tracker on each
    simulated rank, its forward holds two K/V blocks of one rank's size at once, its backward at most five (the
    block attended, the one arriving, and three fp32 dK/dV accumulators: this step's, the one arriving, the one
    leaving; a block kept a step too long makes one more), and neither allocates the whole sequence's K/V
    (O(S/cp), not O(S))."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    from loom.parallel.context_parallel import _ring_backward, _ring_forward
    from loom.plan.activations import _Tracker

    class Blocks(_Tracker):  # the most storages of one K/V block's bytes alive at once, the largest storage
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            sizes = [n for _, n in self.live.values()]
            self.most = max(getattr(self, "most", 0), sizes.count(block))
            self.largest = max(getattr(self, "largest", 0), *sizes, 0)
            return out

    seq, hq, hkv, d = 16 * cp, 2, 2, 16
    block = 2 * hkv * d * (seq // cp) * 4  # fp32 bytes of one rank's K and V; nothing else has this size
    q, k, v, dout = (torch.randn(1, h, seq, d) for h in (hq, hkv, hkv, hq))
    boxes = {(r, tag): queue.Queue() for r in range(cp) for tag in (0, 1)}

    def rank(r: int) -> Blocks:
        ring = ThreadRing(r, cp, boxes)
        mine = [shard_sequence(t, r, cp, dim=2).contiguous() for t in (q, k, v, dout)]
        forward, backward = Blocks(mine, []), Blocks(mine, [])
        with forward:
            forward.backward = True  # (the tracker's switch that counts the peak)
            out, lse = _ring_forward(*mine[:3], None, ring, d**-0.5)
        with backward:
            backward.backward = True
            _ring_backward(mine[3], *mine[:3], out, lse, None, None, ring, d**-0.5)
        return forward, backward

    with ThreadPoolExecutor(cp) as pool:
        trackers = [f.result(timeout=120) for f in [pool.submit(rank, r) for r in range(cp)]]
    assert [f.most for f, _ in trackers] == [2] * cp  # forward: the block attended, the one arriving
    # backward; at cp = 2 its last step receives nothing: four
    assert [b.most for _, b in trackers] == [4 if cp == 2 else 5] * cp
    assert max(t.largest for pair in trackers for t in pair) == block  # nothing of the whole sequence's K/V


def doc_positions(bsz: int, seq: int, seed: int) -> torch.Tensor:
    """Per-document positions (B, S) of packed documents of 1-13 tokens: boundaries anywhere."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.rand(bsz, seq, generator=gen) < 0.15
    starts[:, 0] = True
    idx = torch.arange(seq).expand(bsz, seq)
    return idx - torch.where(starts, idx, 0).cummax(1).values


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_chunk_pair_bounds_give_the_whole_sequence_mask_in_pieces(cp):
    """Each (query chunk, key chunk) pair's bounds mask the same entries as the whole sequence's causal
    document mask, and its key-side bounds list exactly the queries that see each key (the kernel's dK/dV
    walk relies on that)."""
    chunk, bsz = 5, 3
    seq = 2 * cp * chunk
    ids = R.doc_ids_from_positions(doc_positions(bsz, seq, cp))
    ids[0, -3:] = -1  # padding too
    bounds = R.document_bounds(ids)
    whole = R.visible(seq, True, bounds, 0, "cpu")[:, 0]  # (B, S, S)
    for g in range(2 * cp):
        for j in range(g + 1):
            qb, kb = pair_bounds(bounds, g, j, chunk)
            want = whole[:, g * chunk : (g + 1) * chunk, j * chunk : (j + 1) * chunk]  # (B, chunk, chunk)
            assert torch.equal(R.visible(chunk, j == g, qb, 0, "cpu")[:, 0], want)
            if j < g:  # off the diagonal: key n is seen by queries [kb[0, n], kb[1, n]] exactly
                rows = torch.arange(chunk)[None, :, None]
                assert torch.equal((rows >= kb[0][:, None]) & (rows <= kb[1][:, None]), want)


# ---- attention across ranks vs one process ------------------------------------------------------------


def cp_attention_parity(rank: int, world: int, docs: bool = False) -> dict:
    """Both methods' errors against one process: {"allgather.out": ..., "ring.dk": ...}."""
    import torch.distributed as dist

    from loom.kernels.attention.op import flash_attention
    from loom.parallel.context_parallel import ContextParallel

    torch.manual_seed(0)
    seq = 8 * world
    q, k, v = torch.randn(2, 4, seq, 8), torch.randn(2, 2, seq, 8), torch.randn(2, 2, seq, 8)  # GQA 4/2
    dout = torch.randn(2, 4, seq, 8)
    positions = doc_positions(2, seq, seed=world) if docs else None
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ids = R.doc_ids_from_positions(positions) if docs else None
    ref = flash_attention(*full, causal=True, doc_ids=ids)
    ref.backward(dout)

    errs = {}
    for method in ("allgather", "ring"):
        local = [shard_sequence(t, rank, world, dim=2).requires_grad_() for t in (q, k, v)]
        mine = shard_sequence(positions, rank, world) if docs else None
        out = ContextParallel(dist.group.WORLD, rank, world, method).attend(*local, mine)
        out.backward(shard_sequence(dout, rank, world, dim=2))
        errs[f"{method}.out"] = (out - shard_sequence(ref, rank, world, dim=2)).abs().max().item()
        for name, mine, whole in zip("qkv", local, full):
            errs[f"{method}.d{name}"] = (
                (mine.grad - shard_sequence(whole.grad, rank, world, dim=2)).abs().max().item()
            )
    gathered = [None] * world
    dist.all_gather_object(gathered, errs)
    return {k: max(e[k] for e in gathered) for k in errs}


def cp_attention_parity_docs(rank: int, world: int) -> dict:
    return cp_attention_parity(rank, world, docs=True)


# 4 ranks slow: the default run's 4-rank causal ring is the threads' cp 4 case and the composed matrix's ring cases
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_cp_attention_matches_one_process_forward_and_backward(world, tmp_path):
    errs = run_fn(world, cp_attention_parity, str(tmp_path))
    assert len(errs) == 8 and max(errs.values()) < 1e-5, sorted(errs.items())  # all-gather and ring


# 4 ranks slow: the default run's 4-rank CP with documents is the composed matrix's cp4 ring case
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_cp_attention_with_packed_documents_matches_one_process(world, tmp_path):
    errs = run_fn(world, cp_attention_parity_docs, str(tmp_path))
    assert len(errs) == 8 and max(errs.values()) < 1e-5, sorted(errs.items())  # all-gather and ring


# ---- training layouts vs one process ------------------------------------------------------------------


def short_documents(tmp) -> str:
    """A jsonl corpus of documents of 3-40 bytes: with seq_len 32, boundaries inside every cp chunk."""
    path = tmp / "short_docs.jsonl"
    if not path.exists():
        rng = random.Random(3)
        words = "the of loom mesh chunk ring shard rank token layer key query value".split()
        with open(path, "w") as f:
            for _ in range(3000):
                text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 7)))
                f.write(json.dumps({"text": text}) + "\n")
    return str(path)


def docs_job(tmp, name, **kw) -> dict:
    """``job`` on packed short documents, positions restarting per document (the document mask on)."""
    return {
        **job(tmp, name, **kw),
        "data.source": short_documents(tmp.parent),
        "data.document_positions": "true",
        "data.cache_dir": f"{tmp.parent}/docs_cache",
    }


def cp_jobs(tmp, world: int) -> dict:
    if world == 2:
        return {
            "cp2-docs": docs_job(tmp, "cp2-docs", cp=2, dp_shard=1),
            # compiled blocks trace the positions' all-gather, the chunk-pair bounds and the op's key bounds
            "cp2-docs-compile": {
                **docs_job(tmp, "cp2-docs-compile", cp=2, dp_shard=1),
                "training.compile": "true",
            },
            "cp2": job(tmp, "cp2", cp=2, dp_shard=1),
            "cp2-m2": job(tmp, "cp2-m2", m=2, cp=2, dp_shard=1),
            "cp2-untied": job(tmp, "cp2-untied", tied=False, cp=2, dp_shard=1),
            # per-block torch.compile traces the all-gather and the attention op's fake implementation
            "cp2-compile": {**job(tmp, "cp2-compile", cp=2, dp_shard=1), "training.compile": "true"},
            # recomputation repeats the K/V all-gather in backward, in the same order on every rank
            "cp2-ac-op": {
                **job(tmp, "cp2-ac-op", cp=2, dp_shard=1),
                "training.activation_checkpointing": "op",
            },
            # ring attention (parallel.cp_method ring): K/V round the ring, dK/dV back
            "cp2-ring": job(tmp, "cp2-ring", cp=2, dp_shard=1, cp_method="ring"),
            "cp2-ring-docs-m2": docs_job(tmp, "cp2-ring-docs-m2", m=2, cp=2, dp_shard=1, cp_method="ring"),
            # the ring runs eagerly between the compiled pieces of a block (a graph break), and op-level
            # recomputation replays its sends in backward, in the same order on every rank
            "cp2-ring-compile-ac-op": {
                **job(tmp, "cp2-ring-compile-ac-op", cp=2, dp_shard=1, cp_method="ring"),
                "training.compile": "true",
                "training.activation_checkpointing": "op",
            },
        }
    return {
        "fsdp2xcp2": job(tmp, "fsdp2xcp2", dp=2, cp=2, dp_shard=2),
        "cp4-docs-m2": docs_job(tmp, "cp4-docs-m2", m=2, cp=4, dp_shard=1),
        "fsdp2xcp2-docs": docs_job(tmp, "fsdp2xcp2-docs", dp=2, cp=2, dp_shard=2),
        "hsdp2x1xcp2-m2": job(tmp, "hsdp2x1xcp2-m2", m=2, dp=2, cp=2, dp_replicate=2, dp_shard=1),
        "cp2xtp2": job(tmp, "cp2xtp2", cp=2, tp=2, dp_shard=1),
        # stages pass (B, S/cp, E) hidden states; each attention knows its tokens' positions
        "pp2xcp2-1f1b-m2": job(tmp, "pp2xcp2-1f1b-m2", m=2, pp=2, cp=2, dp_shard=1),
        "pp2xcp2-zbv-m4": job(tmp, "pp2xcp2-zbv-m4", m=4, pp=2, cp=2, pp_schedule="zbv", dp_shard=1),
        # ring attention over 4 cp ranks (three hops each way), and beside a pipeline's own sends (ZBV's
        # split backward runs the ring's backward in the input-gradient pass)
        "cp4-ring-docs-m2": docs_job(tmp, "cp4-ring-docs-m2", m=2, cp=4, dp_shard=1, cp_method="ring"),
        "cp4-ring": job(tmp, "cp4-ring", cp=4, dp_shard=1, cp_method="ring"),  # causal (no document bounds)
        "pp2xcp2-ring-zbv-m4": job(
            tmp, "pp2xcp2-ring-zbv-m4", m=4, pp=2, cp=2, pp_schedule="zbv", dp_shard=1, cp_method="ring"
        ),
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    res = run_jobs(
        1,
        [job(tmp, "single-tied"), job(tmp, "single-untied", tied=False), docs_job(tmp, "single-docs")],
        str(tmp),
    )
    for r in res:
        assert "error" not in r, r["error"]
    return {"true": res[0]["records"], "false": res[1]["records"], "docs": res[2]["records"]}


def reference_key(j: dict) -> str:
    return "docs" if j.get("data.document_positions") == "true" else j["model.tie_embeddings"]


def check(reference, jobs, results):
    report, bad = [], []
    for (name, j), res in zip(jobs.items(), results):
        if "error" in res:
            bad.append(f"{name}: {res['error']}")
            continue
        ref = reference[reference_key(j)]
        dev = max(abs(x - y["loss"]) / y["loss"] for x, y in zip(losses(res), ref))
        gdev = max(abs(x["grad_norm"] - y["grad_norm"]) / y["grad_norm"] for x, y in zip(res["records"], ref))
        assert len(res["records"]) == len(ref) == STEPS
        report.append(f"{name}: max rel deviation loss {dev:.2e}, grad norm {gdev:.2e}")
        if not (dev < 1e-5 and gdev < 1e-4):
            bad.append(report[-1])
    print("\n".join(report))
    assert not bad, "\n".join(bad + report)


# the rest of each matrix (slow): the compiled all-gather cases (compiling costs ~2 minutes of CPU each; the
# compiled ring, under op-level recomputation, is the default run's compiled CP case), and 4-rank cases whose paths
# the others cover (FSDP2 x CP2 with documents, CP4 and PP2 x CP2 under ring)
BROAD = {
    "cp2-compile",
    "cp2-docs-compile",
    "fsdp2xcp2",
    "cp4-docs-m2",
    "pp2xcp2-1f1b-m2",
    "pp2xcp2-ring-zbv-m4",
    # accumulation under cp: cp2-ring-docs-m2 and hsdp2x1xcp2-m2; the 4-rank ring: cp4-ring-docs-m2
    "cp2-m2",
    "cp4-ring",
}
BREADTH = pytest.mark.parametrize(
    "broad", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["core", "broad"]
)


@BREADTH
def test_cp_on_2_ranks_matches_single_process(reference, tmp_path, broad):
    jobs = {k: v for k, v in cp_jobs(tmp_path, 2).items() if (k in BROAD) == broad}
    check(reference, jobs, run_jobs(2, list(jobs.values()), str(tmp_path)))


@BREADTH
def test_cp_composed_on_4_ranks_matches_single_process(reference, tmp_path, broad):
    jobs = {k: v for k, v in cp_jobs(tmp_path, 4).items() if (k in BROAD) == broad}
    check(reference, jobs, run_jobs(4, list(jobs.values()), str(tmp_path)))


def test_validation_under_cp_matches_single_process(tmp_path):
    val = {"training.eval_every": 2, "training.eval_batches": 2}
    ref = run_jobs(1, [{**job(tmp_path, "single-val", m=2), **val}], str(tmp_path))[0]
    cp = run_jobs(2, [{**job(tmp_path, "cp2-val", m=2, cp=2, dp_shard=1), **val}], str(tmp_path))[0]

    def vals(res):
        assert "error" not in res, res["error"]
        return [r["val_loss"] for r in res["records"] if r["val_loss"] is not None]

    assert len(vals(ref)) == 3  # steps 2 and 4, and the end (training.eval_at_end)
    assert max(abs(a - b) / b for a, b in zip(vals(cp), vals(ref))) < 1e-5, (vals(cp), vals(ref))


def test_packed_documents_under_pipeline_match_single_process(tmp_path):
    """Per-document positions reach every pipeline stage (a keyword the schedule cuts like the inputs): PP2
    1F1B and ZBV (its validation runs stage by stage) on 2 ranks, PP2 x CP2 on 4, training and validation
    losses against one process with the same documents; without the mask the losses differ (so the stages
    did mask)."""
    val = {"training.eval_every": 2, "training.eval_batches": 1}
    ref, plain = run_jobs(
        1,
        [
            {**docs_job(tmp_path, "single-docs-val", m=4), **val},
            {**docs_job(tmp_path, "single-nomask-val", m=4), **val, "data.document_positions": "false"},
        ],
        str(tmp_path),
    )
    jobs2 = [
        {**docs_job(tmp_path, "pp2-docs-1f1b-m4", m=4, pp=2, dp_shard=1), **val},
        {**docs_job(tmp_path, "pp2-docs-zbv-m4", m=4, pp=2, pp_schedule="zbv", dp_shard=1), **val},
    ]
    jobs4 = [{**docs_job(tmp_path, "pp2xcp2-docs-1f1b-m4", m=4, pp=2, cp=2, dp_shard=1), **val}]
    runs = run_jobs(2, jobs2, str(tmp_path)) + run_jobs(4, jobs4, str(tmp_path))  # each call starts its ranks

    def curve(res):
        assert "error" not in res, res["error"]
        return losses(res) + [r["val_loss"] for r in res["records"] if r["val_loss"] is not None]

    want = curve(ref)
    assert len(want) == STEPS + 3  # validation at steps 2 and 4, and at the end (training.eval_at_end)
    assert max(abs(a - b) / b for a, b in zip(curve(plain), want)) > 1e-3  # the mask matters on this corpus
    for job_, res in zip(jobs2 + jobs4, runs):
        got = curve(res)
        assert len(got) == len(want) and max(abs(a - b) / b for a, b in zip(got, want)) < 1e-5, (
            job_["run.dir"],
            got,
            want,
        )


def test_cp_checkpoint_resumes_under_fsdp(tmp_path):
    """Saved under CP2 at step 3, resumed under FSDP2: steps 4-5 repeat the uninterrupted CP2 run."""
    from tests.distributed.test_model_parallel import SAVE_AT, ckpt, tail

    save = {"checkpoint.every": SAVE_AT, "checkpoint.keep": 0}
    first = run_jobs(2, [{**job(tmp_path, "cp2-save", cp=2, dp_shard=1), **save}], str(tmp_path))[0]
    resumed = run_jobs(
        2,
        [
            {
                **job(tmp_path, "fsdp2-from-cp2", dp=2, dp_shard=2),
                "checkpoint.resume": ckpt(str(tmp_path / "cp2-save"), SAVE_AT),
            }
        ],
        str(tmp_path),
    )[0]
    want, got = tail(first), tail(resumed)
    assert [s for s, _, _ in got] == [s for s, _, _ in want] == list(range(SAVE_AT + 1, STEPS + 1))
    for (_, a, ha), (_, b, hb) in zip(got, want):
        assert ha == hb and abs(a - b) / b < 1e-5, (got, want)


# ---- what cp rejects ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"parallel.cp": "2", "training.seq_len": "30"}, "parallel.cp"),
        ({"parallel.cp": "2", "parallel.cp_method": "ulysses"}, "parallel.cp_method"),
    ],
)
def test_unsupported_cp_settings_name_the_field(overrides, field):
    from loom.methods import check_config

    with pytest.raises(ConfigError) as err:
        check_config(build_config(None, overrides))
    assert err.value.field == field

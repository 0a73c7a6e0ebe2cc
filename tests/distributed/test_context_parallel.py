"""Context parallelism: the load-balanced sequence layout, the all-gather attention against one process's
causal attention (outputs and q/k/v gradients, GQA), and layout invariance of training with cp alone and
composed with FSDP, HSDP, TP, PP and accumulation (fp32, loss and grad norm within 1e-5 of one process at
every step), validation included; config errors for what cp does not support yet."""

from __future__ import annotations

import pytest
import torch

from loom.config import ConfigError, build_config
from loom.kernels.attention import reference as R
from loom.parallel.context_parallel import chunk_ids, local_positions, merge_blocks, shard_sequence
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
    scale = 8 ** -0.5
    whole, _ = R.attention_forward(torch.cat([torch.zeros(2, 4, 12, 8), q], 2), k, v, True, None, 0, scale)
    blocks = [R.attention_forward(q, k[:, :, i:i + 6], v[:, :, i:i + 6], i == 12, None, 0, scale) for i in (0, 6, 12)]
    merged = merge_blocks([o for o, _ in blocks], [lse for _, lse in blocks])
    torch.testing.assert_close(merged, whole[:, :, 12:], rtol=1e-5, atol=1e-6)


# ---- attention across ranks vs one process ------------------------------------------------------------

def cp_attention_parity(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from loom.kernels.attention.op import flash_attention
    from loom.parallel.context_parallel import ContextParallel

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)  # GQA 4/2
    dout = torch.randn(2, 4, 16, 8)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = flash_attention(*full, causal=True)
    ref.backward(dout)

    local = [shard_sequence(t, rank, world, dim=2).requires_grad_() for t in (q, k, v)]
    out = ContextParallel(dist.group.WORLD, rank, world).attend(*local)
    out.backward(shard_sequence(dout, rank, world, dim=2))
    errs = {"out": (out - shard_sequence(ref, rank, world, dim=2)).abs().max().item()}
    for name, mine, whole in zip("qkv", local, full):
        errs["d" + name] = (mine.grad - shard_sequence(whole.grad, rank, world, dim=2)).abs().max().item()
    gathered = [None] * world
    dist.all_gather_object(gathered, errs)
    return {k: max(e[k] for e in gathered) for k in errs}


def test_cp_attention_matches_one_process_forward_and_backward(tmp_path):
    errs = run_fn(2, cp_attention_parity, str(tmp_path))
    assert max(errs.values()) < 1e-5, errs


# ---- training layouts vs one process ------------------------------------------------------------------

def cp_jobs(tmp, world: int) -> dict:
    if world == 2:
        return {"cp2": job(tmp, "cp2", cp=2, dp_shard=1),
                "cp2-m2": job(tmp, "cp2-m2", m=2, cp=2, dp_shard=1),
                "cp2-untied": job(tmp, "cp2-untied", tied=False, cp=2, dp_shard=1),
                # per-block torch.compile traces the all-gather and the attention op's fake implementation
                "cp2-compile": {**job(tmp, "cp2-compile", cp=2, dp_shard=1), "training.compile": "true"},
                # recomputation repeats the K/V all-gather in backward, in the same order on every rank
                "cp2-ac-op": {**job(tmp, "cp2-ac-op", cp=2, dp_shard=1), "training.activation_checkpointing": "op"}}
    return {"fsdp2xcp2": job(tmp, "fsdp2xcp2", dp=2, cp=2, dp_shard=2),
            "hsdp2x1xcp2-m2": job(tmp, "hsdp2x1xcp2-m2", m=2, dp=2, cp=2, dp_replicate=2, dp_shard=1),
            "cp2xtp2": job(tmp, "cp2xtp2", cp=2, tp=2, dp_shard=1),
            # stages pass (B, S/cp, E) hidden states; each attention knows its tokens' positions
            "pp2xcp2-1f1b-m2": job(tmp, "pp2xcp2-1f1b-m2", m=2, pp=2, cp=2, dp_shard=1),
            "pp2xcp2-zbv-m4": job(tmp, "pp2xcp2-zbv-m4", m=4, pp=2, cp=2, pp_schedule="zbv", dp_shard=1)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    res = run_jobs(1, [job(tmp, "single-tied"), job(tmp, "single-untied", tied=False)], str(tmp))
    return {"true": res[0]["records"], "false": res[1]["records"]}


def check(reference, jobs, results):
    report, bad = [], []
    for (name, j), res in zip(jobs.items(), results):
        if "error" in res:
            bad.append(f"{name}: {res['error']}")
            continue
        ref = reference[j["model.tie_embeddings"]]
        dev = max(abs(x - y["loss"]) / y["loss"] for x, y in zip(losses(res), ref))
        gdev = max(abs(x["grad_norm"] - y["grad_norm"]) / y["grad_norm"] for x, y in zip(res["records"], ref))
        assert len(res["records"]) == len(ref) == STEPS
        report.append(f"{name}: max rel deviation loss {dev:.2e}, grad norm {gdev:.2e}")
        if not (dev < 1e-5 and gdev < 1e-4):
            bad.append(report[-1])
    print("\n".join(report))
    assert not bad, "\n".join(bad + report)


def test_cp_on_2_ranks_matches_single_process(reference, tmp_path):
    jobs = cp_jobs(tmp_path, 2)
    check(reference, jobs, run_jobs(2, list(jobs.values()), str(tmp_path)))


def test_cp_composed_on_4_ranks_matches_single_process(reference, tmp_path):
    jobs = cp_jobs(tmp_path, 4)
    check(reference, jobs, run_jobs(4, list(jobs.values()), str(tmp_path)))


def test_validation_under_cp_matches_single_process(tmp_path):
    val = {"training.eval_every": 2, "training.eval_batches": 4}
    ref = run_jobs(1, [{**job(tmp_path, "single-val", m=2), **val}], str(tmp_path))[0]
    cp = run_jobs(2, [{**job(tmp_path, "cp2-val", m=2, cp=2, dp_shard=1), **val}], str(tmp_path))[0]

    def vals(res):
        assert "error" not in res, res["error"]
        return [r["val_loss"] for r in res["records"] if r["val_loss"] is not None]

    assert len(vals(ref)) == 2
    assert max(abs(a - b) / b for a, b in zip(vals(cp), vals(ref))) < 1e-5, (vals(cp), vals(ref))


def test_cp_checkpoint_resumes_under_fsdp(tmp_path):
    """Saved under CP2 at step 3, resumed under FSDP2: steps 4-5 repeat the uninterrupted CP2 run."""
    from tests.distributed.test_model_parallel import SAVE_AT, ckpt, tail

    save = {"checkpoint.every": SAVE_AT, "checkpoint.keep": 0}
    first = run_jobs(2, [{**job(tmp_path, "cp2-save", cp=2, dp_shard=1), **save}], str(tmp_path))[0]
    resumed = run_jobs(2, [{**job(tmp_path, "fsdp2-from-cp2", dp=2, dp_shard=2),
                            "checkpoint.resume": ckpt(str(tmp_path / "cp2-save"), SAVE_AT)}], str(tmp_path))[0]
    want, got = tail(first), tail(resumed)
    assert [s for s, _, _ in got] == [s for s, _, _ in want] == list(range(SAVE_AT + 1, STEPS + 1))
    for (_, a, ha), (_, b, hb) in zip(got, want):
        assert ha == hb and abs(a - b) / b < 1e-5, (got, want)


# ---- what cp rejects ------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, field", [
    ({"parallel.cp": "2", "training.seq_len": "30"}, "parallel.cp"),
    ({"parallel.cp": "2", "data.document_positions": "true"}, "data.document_positions"),
])
def test_unsupported_cp_settings_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        build_config(None, overrides)
    assert err.value.field == field

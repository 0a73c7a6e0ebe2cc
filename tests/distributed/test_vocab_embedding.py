"""parallel.fsdp_embedding vocab on gloo ranks: the row-split embedding looks up what one process's embedding does
and its gradient shard is the ranks' mean gradient's rows, on tables that do not divide evenly (and one with fewer
rows than ranks); a 2-rank run trains as FSDP2's own embedding unit does; what ``auto`` resolves to; refused in one
line where it cannot apply. The layout-invariance tests run it too (their ``fsdp2vocab`` layout)."""

from __future__ import annotations

import pytest
import torch

from loom.config import build_config
from loom.config.errors import ConfigError
from loom.resolve import resolve
from tests.distributed.harness import losses, run_fn, run_jobs
from tests.distributed.test_reduce_dtype import job as reduce_dtype_job


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def lookup_parity(rank: int, world: int) -> dict:
    """Worst errors against one process over a few table sizes and dtypes, and the rows each rank holds."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from loom.parallel.vocab_embedding import VocabShardedEmbedding

    mesh = init_device_mesh("cpu", (world,))
    errs, held = {}, []
    for vocab in (13, world - 1):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            full = torch.nn.Embedding(vocab, 8)
            tokens = torch.randint(0, vocab, (world, 3, 5))  # each rank's own (3, 5) tokens
            dout = torch.randn(world, 3, 5, 8)
            split = VocabShardedEmbedding(full, mesh, dtype)
            held.append(split.weight.to_local().shape[0])
            out = split(tokens[rank])
            out.backward(dout[rank].to(dtype))
            ref = full(tokens)  # every rank's tokens in one process; the mean of their gradients
            (ref * dout.to(dtype).float()).sum().div(world).backward()
            lo = split.first_row
            mine = slice(lo, lo + split.weight.to_local().shape[0])
            key = f"{vocab}.{str(dtype)[6:]}"
            errs[f"{key}.out"] = worst(out.float(), ref[rank].to(dtype).float())
            errs[f"{key}.grad"] = worst(split.weight.grad.to_local(), full.weight.grad[mine])
            errs[f"{key}.dtype"] = float(out.dtype == dtype and split.weight.grad.dtype == torch.float32)
    try:  # an id past the table, on one rank: every rank refuses it (none holds its row)
        split(torch.full((3, 5), 13 if rank == 0 else 0))
        errs["bad_id_raises"] = 0.0
    except RuntimeError as e:
        errs["bad_id_raises"] = float("outside the embedding's rows" in str(e))
    gathered = [None] * world
    dist.all_gather_object(gathered, (errs, held))
    return {
        "worst": {k: max(e[0][k] for e in gathered) for k in errs if k.endswith((".out", ".grad"))},
        "bad_id_raises": min(e[0]["bad_id_raises"] for e in gathered),
        "dtypes": min(e[0][k] for e in gathered for k in errs if k.endswith(".dtype")),
        "held": [e[1] for e in gathered],
    }


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_lookup_and_gradient_match_one_process(world, tmp_path):
    res = run_fn(world, lookup_parity, str(tmp_path))
    # the fp32 gradient sums the same products in another order; bf16 outputs are the rows rounded once, and the
    # gradients arriving in bf16 are taken as they are, summed in fp32
    assert max(res["worst"].values()) < 1e-6, res["worst"]
    assert res["dtypes"] == 1.0 and res["bad_id_raises"] == 1.0
    chunks = [len(c) for c in torch.arange(13).chunk(world)]
    small = [len(c) for c in torch.arange(world - 1).chunk(world)] + [0]
    assert [h[0] for h in res["held"]] == chunks and [h[2] for h in res["held"]] == small[:world]


def job(tmp, name, **extra):
    """test_reduce_dtype's 2-rank run, in fp32."""
    return reduce_dtype_job(tmp, name, **{"training.dtype": "float32", "parallel.dp_shard": 2, **extra})


def test_trains_as_the_fsdp2_unit(tmp_path):
    """fp32: the same losses to the order of the gradient's sum. Its checkpoint holds FSDP2's layout (the same
    Shard(0) table): a gather run resumed from a vocab run's step 2 continues with the vocab run's losses."""
    vocab, gather, resumed = run_jobs(
        2,
        [
            job(tmp_path, "vocab", **{"parallel.fsdp_embedding": "vocab", "checkpoint.every": 2}),
            job(tmp_path, "gather", **{"parallel.fsdp_embedding": "gather"}),
            job(
                tmp_path,
                "resumed",
                **{
                    "parallel.fsdp_embedding": "gather",
                    "checkpoint.resume": f"{tmp_path}/vocab/checkpoints/step_00000002",
                },
            ),
        ],
        str(tmp_path),
    )
    a, b = losses(vocab), losses(gather)
    assert max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)
    tail = [r["loss"] for r in resumed["records"]]
    assert len(tail) == 2 and max(abs(x - y) / abs(y) for x, y in zip(tail, a[2:], strict=True)) < 1e-5


def test_auto_splits_where_the_split_applies_and_pays():
    """auto: vocab for an untied model whose gathered micro-batch tokens are at most a quarter of its rows (the 8B
    pair's shape: 2 x 8192 of 128256); gather for more tokens, a tied or multi-token-prediction model, a rollout
    objective's unequal widths, or a layout without a 1-D FSDP2 mesh; vocab by hand refused there in one line."""
    from types import SimpleNamespace

    from loom.parallel.dims import ParallelDims
    from loom.parallel.vocab_embedding_rules import fsdp_embedding

    def pick(setting="auto", world=2, tokens=8192, equal=True, **model):
        parallel = cfg(**{"parallel.fsdp_embedding": setting, "parallel.dp_shard": str(world)}).parallel
        args = SimpleNamespace(**{"vocab_size": 128256, "tie_embeddings": False, "mtp_depth": 0, **model})
        training = SimpleNamespace(micro_batch_size=1, seq_len=tokens)
        objective = SimpleNamespace(equal_widths=equal, rows_per_example=1)
        dims = ParallelDims.from_config(parallel, world)
        return fsdp_embedding(parallel, dims, args, training, objective)

    assert pick() == "vocab" and pick(tokens=16032) == "vocab"
    # pair data: two rows an example, the same tokens gathered as twice the sequences
    parallel = cfg(**{"parallel.dp_shard": "2", "parallel.fsdp_embedding": "auto"}).parallel
    pairs = fsdp_embedding(
        parallel,
        ParallelDims.from_config(parallel, 2),
        SimpleNamespace(vocab_size=128256, tie_embeddings=False, mtp_depth=0),
        SimpleNamespace(micro_batch_size=1, seq_len=8192),
        SimpleNamespace(equal_widths=True, rows_per_example=2),
    )
    assert pairs == "gather"
    assert pick(tokens=16033) == "gather" and pick("vocab", tokens=16033) == "vocab"
    assert pick(tie_embeddings=True) == pick(mtp_depth=1) == pick(equal=False) == pick(world=1) == "gather"
    assert pick("gather") == "gather"
    for why, kw in (
        ("output head \\(tied\\)", dict(tie_embeddings=True)),
        ("multi-token prediction", dict(mtp_depth=1)),
        ("differ in width between ranks", dict(equal=False)),
    ):
        with pytest.raises(ConfigError, match=f"parallel.fsdp_embedding = 'vocab': .*{why}.*: allowed auto"):
            pick("vocab", **kw)


def cfg(**extra):
    return build_config(None, {"run.device": "cpu", "parallel.fsdp_embedding": "vocab", **extra})


def test_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match="parallel.fsdp_embedding = 'vocab': splits the embedding over"):
        resolve(cfg(), 1, device="cpu")
    with pytest.raises(ConfigError, match="HSDP adds dp_replicate 2: allowed auto | gather"):
        resolve(cfg(**{"parallel.dp_replicate": "2", "parallel.dp_shard": "2"}), 4, device="cpu")
    with pytest.raises(ConfigError, match="tensor parallelism \\(tp 2\\)"):
        resolve(cfg(**{"parallel.tp": "2", "parallel.dp_shard": "2"}), 4, device="cpu")
    resolve(cfg(), 2, device="cpu")
    # the model's and the method's refusals at resolve, before any worker starts
    from loom.data.tokenizers import ByteTokenizer
    from loom.methods import resolve as resolve_method

    with pytest.raises(
        ConfigError, match="'vocab': this model's embedding is also its output head \\(tied\\)"
    ):
        resolve(cfg(**{"model.tie_embeddings": "true"}), 2, ByteTokenizer(), device="cpu")
    with pytest.raises(ConfigError, match="'vocab': not with training.objective grpo: .*differ in width"):
        resolve_method(cfg(**{"training.objective": "grpo"}), 2, device="cpu")

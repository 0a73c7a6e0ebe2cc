"""The Hopper (sm_90) Gluon attention kernels against loom's Triton kernels on the same inputs: every candidate
config and the autotuned choice of the forward, dK/dV (plain and persistent) and dQ, and the grouped walks over
(batch, head) pairs. Skipped off sm_90."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


HOPPER_CASES = [  # (B, Hq, Hkv, S, D, causal, model layout (B, S, H, D) seen as (B, H, S, D), packed documents)
    (2, 4, 4, 1000, 64, True, False, False),
    (1, 4, 4, 777, 128, True, True, False),
    (2, 2, 2, 1024, 128, False, False, False),
    (1, 8, 8, 300, 64, False, True, False),
    (2, 2, 2, 64, 128, True, False, False),
    (1, 2, 2, 129, 64, True, True, False),
    (1, 8, 2, 1000, 64, True, True, False),
    (2, 8, 1, 333, 128, True, False, False),
    (1, 16, 2, 2048, 128, True, True, False),
    (1, 4, 1, 517, 64, False, True, False),
    (2, 4, 4, 1000, 64, True, False, True),
    (1, 8, 2, 777, 128, True, True, True),
    (2, 2, 2, 1024, 128, False, False, True),
    (1, 16, 2, 2048, 128, True, True, True),
    (2, 4, 1, 517, 64, True, False, True),
]

# Each case compiles every candidate config of four kernels (~45 s on an H200): by default the cases that cover d64
# and d128, causal and not, GQA, both layouts, packed documents and a length under one block, in bf16 and one in
# fp16 (about 5 minutes, one device call); the rest of the 30 with --slow.
CORE = {(1, 8, 2, 1000, 64, True, True, False), (1, 4, 4, 777, 128, True, True, False),
        (2, 2, 2, 1024, 128, False, False, False), (1, 8, 2, 777, 128, True, True, True),
        (1, 2, 2, 129, 64, True, True, False)}  # fmt: skip
HOPPER_PARAMS = [
    pytest.param(
        case,
        dtype,
        id=f"{'x'.join(map(str, case))}-{str(dtype)[6:]}",
        marks=()
        if case in CORE and (dtype == torch.bfloat16 or case[4] == 128 and case[7])
        else pytest.mark.slow,
    )
    for case in HOPPER_CASES
    for dtype in (torch.bfloat16, torch.float16)
]


def _packed_bounds(b: int, s: int, gen: torch.Generator) -> torch.Tensor:
    """Document bounds of random packed documents (1-400 tokens, boundaries anywhere) and a padded tail."""
    from loom.kernels.attention.reference import document_bounds

    ids = torch.cumsum(torch.rand(b, s, generator=gen) < 1 / 150, dim=1)
    ids[:, s - s // 10 :] = -1  # padding: sees nothing, seen by nothing
    return document_bounds(ids.cuda())


def _check_hopper_forward(q, k, v, causal, bounds, scale, triton_out, triton_lse) -> None:
    """Each Gluon forward config and the autotuned choice: out within twice the Triton forward's error against
    the fp32 reference (plus 1e-3), lse within 1e-4 of the reference, -inf exactly on the rows that see nothing."""
    from loom.kernels.attention import reference as R
    from loom.kernels.attention import triton as T
    from loom.kernels.attention.hopper import launch as hopper

    ref_out, ref_lse = R.attention_forward(q.float(), k.float(), v.float(), causal, bounds, 0, scale)
    seen = torch.isfinite(ref_lse)
    triton_err = (triton_out.float() - ref_out).abs()[seen].max().item()
    for config in [*hopper._CONFIGS["fwd"], None]:
        out, lse = torch.full_like(q, float("nan")), torch.full_like(triton_lse, float("nan"))
        hopper.forward(q, k, v, out, lse, causal, bounds, scale, T.seq_key(q.shape[2]), config=config)
        assert not out.isnan().any() and not lse.isnan().any(), config
        err = (out.float() - ref_out).abs()[seen].max().item()
        assert err <= 2 * triton_err + 1e-3, (config, err, triton_err)
        assert torch.equal(torch.isfinite(lse), seen), config
        torch.testing.assert_close(lse[seen], ref_lse[seen], atol=1e-4, rtol=1e-4, msg=f"lse {config}")
        assert (out[~seen] == 0).all(), config


def _check_item_groups(q, k, v, do, lse2, delta, causal, bounds, scale) -> None:
    """The persistent forward and dQ walking the (batch, head) pairs in groups (``heads_per_group``: L2-sized
    (None), 3 (a smaller last group on most cases), 1) compute every item as when all pairs go in one group:
    outputs bit-identical."""
    from loom.kernels.attention import triton as T
    from loom.kernels.attention.hopper import launch as hopper

    key = T.seq_key(q.shape[2])
    results = {}
    everything = q.shape[0] * q.shape[1]
    for group in (everything, None, 3, 1):
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        hopper.forward(q, k, v, out, lse, causal, bounds, scale, key, heads_per_group=group)
        dq = torch.empty_like(q)
        hopper.dq(q, k, v, do, lse2, delta, dq, causal, bounds, scale, key, heads_per_group=group)
        results[group] = (out, lse, dq)
    for group in (None, 3, 1):
        for name, got, want in zip(("out", "lse", "dq"), results[group], results[everything]):
            assert torch.equal(got, want), (name, group)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="sm_90"
)
@pytest.mark.parametrize("case, dtype", HOPPER_PARAMS)
def test_hopper_kernels_match_the_triton_kernels(case, dtype, two_configs_per_kernel):
    """The warp-specialized Gluon dK/dV and dQ kernels (every candidate config and the autotuned choice) against
    the Triton kernels on the same inputs: the same arithmetic in the same order, so equal up to rounding. The
    Gluon forward (other blocks than the Triton forward's, so another rounding) against an fp32 reference: its
    error within twice the Triton forward's, the same rows empty."""
    from loom.kernels import dispatch
    from loom.kernels.attention import triton as T
    from loom.kernels.attention.hopper import launch as hopper

    b, hq, hk, s, d, causal, model_layout, docs = case
    gen = torch.Generator().manual_seed(s)
    q, k, v, do = (
        torch.randn(*((b, s, h, d) if model_layout else (b, h, s, d)), generator=gen).cuda().to(dtype)
        for h in (hq, hk, hk, hq)
    )
    if model_layout:
        q, k, v, do = (t.transpose(1, 2) for t in (q, k, v, do))
    bounds = _packed_bounds(b, s, gen) if docs else None
    assert dispatch.backward_kernels(q, k, v, do, bounds, None, 0)[0].startswith("hopper")  # Gluon takes it
    scale = d**-0.5
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    T.triton_forward(
        q, k, v, out, lse, causal, bounds, 0, scale
    )  # the Triton kernel (dispatch would pick Gluon)
    delta, lse2 = T.backward_preprocess(do, out, lse, None)
    _check_hopper_forward(q, k, v, causal, bounds, scale, out, lse)
    tk, tv = torch.empty_like(k), torch.empty_like(v)
    T.triton_dkdv(do, q, k, v, lse2, delta, tk, tv, causal, bounds, 0, scale)
    tq = torch.empty_like(q)
    T.triton_dq(do, q, k, v, lse2, delta, tq, causal, bounds, 0, scale)
    for config in [*hopper._CONFIGS["dkdv"], None]:
        gk, gv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        hopper.dkdv(q, k, v, do, lse2, delta, gk, gv, causal, bounds, scale, T.seq_key(s), config=config)
        torch.testing.assert_close(gk, tk, atol=1e-3, rtol=1e-3, msg=f"dk {config}")
        torch.testing.assert_close(gv, tv, atol=1e-3, rtol=1e-3, msg=f"dv {config}")
    for config, pairs in [(c, None) for c in [*hopper._CONFIGS["dkdv_p"], None]] + [(None, 1), (None, 3)]:
        gk, gv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))  # the persistent variant
        hopper.dkdv(
            q,
            k,
            v,
            do,
            lse2,
            delta,
            gk,
            gv,
            causal,
            bounds,
            scale,
            T.seq_key(s),
            config=config,
            persistent=True,
            pairs_per_group=pairs,
        )
        torch.testing.assert_close(gk, tk, atol=1e-3, rtol=1e-3, msg=f"persistent dk {config} {pairs}")
        torch.testing.assert_close(gv, tv, atol=1e-3, rtol=1e-3, msg=f"persistent dv {config} {pairs}")
    for config in [*hopper._CONFIGS["dq"], None]:
        gq = torch.full_like(q, float("nan"))
        hopper.dq(q, k, v, do, lse2, delta, gq, causal, bounds, scale, T.seq_key(s), config=config)
        torch.testing.assert_close(gq, tq, atol=1e-3, rtol=1e-3, msg=f"dq {config}")
    _check_item_groups(q, k, v, do, lse2, delta, causal, bounds, scale)

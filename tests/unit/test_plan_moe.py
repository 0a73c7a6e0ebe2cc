"""The planner's MoE step-time terms (loom.plan.timing, loom.plan.planner.moe_time_s) on hand-computed cases: expert
parallelism's slot permutation and expert-gradient rescale, FSDP2's copies of the experts, the grouped GEMMs'
part-filled row tiles, the all-to-alls a block recomputed in full runs again and the GPU's idle at expert
parallelism's host waits; and the two MoE pairs measured on two H200s (bench/results/peers_*_2gpu_h200.json) against
the estimate."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from loom.config import build_config
from loom.plan.hardware import GPUS
from loom.plan.planner import (
    ep_host_waits,
    estimate,
    memory_inputs,
    moe_time_s,
    rank_time,
    validate,
)
from loom.plan.shapes import expert_params, rank_shares
from loom.plan.timing import (
    COPY_HBM_SHARE,
    EP_HOST_WAIT_S,
    collective_s,
    ep_host_s,
    ep_overhead_s,
    fsdp_expert_bytes,
    grouped_padding_flops,
    moe_overhead_s,
)

H200 = GPUS["H200"]
PLAN_RUNS = os.path.join(os.path.dirname(__file__), "..", "data", "plan_runs.json")


def _cfg(**over):
    return build_config(None, {k.replace("__", "."): str(v) for k, v in over.items()})


def test_ep_permutation_and_gradient_rescale_bytes():
    """1000 slots of dim 10 in bf16, every block recomputed: forward 4 + backward 6 + forward again 4 = 14 elements
    of 2 bytes per slot x dim; 100 expert parameters rescaled at 8 bytes; both at the copy rate of 1 TB/s."""
    layer, step = ep_overhead_s(1000, 10, 2, 1.0, 100, 1.0)
    rate = COPY_HBM_SHARE * 1e12
    assert layer == pytest.approx(14 * 1000 * 10 * 2 / rate)
    assert step == pytest.approx(800 / rate)
    assert ep_overhead_s(1000, 10, 2, 0.0, 100, 1.0)[0] == pytest.approx(10 * 1000 * 10 * 2 / rate)


def test_fsdp_copies_of_the_experts():
    """bf16 on a one-rank mesh, gathered twice: 2 x (6 cast + 4 into the gather buffer + 4 copy-out) + 6 into the
    fp32 reduction buffer + 8 its copy to the shard = 42; gathered once: 28; over 2 ranks, gathered twice:
    2 x (10 / 2 + 4) + 6 (the reduce-scatter itself is communication) = 24; fp32 on one rank, once (no cast):
    (8 + 8) + 8 + 8 = 32."""
    assert fsdp_expert_bytes(1, 2, 2) == 42
    assert fsdp_expert_bytes(1, 1, 2) == 28
    assert fsdp_expert_bytes(2, 2, 2) == 24
    assert fsdp_expert_bytes(1, 1, 4) == 32


def test_grouped_gemm_padding_half_a_tile_per_expert():
    """64 experts, 65536 rows (1024 each: 128-row tiles), dim 2048, width 768: 64 x 64 padded rows x 3 weights x
    2 x 2048 x 768 FLOPs, in the forward, the input gradient and the recomputed forward (3 passes); 8 experts of 64
    rows each take 64-row tiles (32 padded rows each); no experts, no padding."""
    assert grouped_padding_flops(64, 65536, 2048, 768, 1.0) == pytest.approx(64 * 64 * 3 * 2 * 2048 * 768 * 3)
    assert grouped_padding_flops(64, 65536, 2048, 768, 0.0) == pytest.approx(64 * 64 * 3 * 2 * 2048 * 768 * 2)
    assert grouped_padding_flops(8, 512, 64, 32, 0.0) == pytest.approx(8 * 32 * 3 * 2 * 64 * 32 * 2)
    assert grouped_padding_flops(0, 512, 64, 32, 0.0) == 0.0


def _layout(ac: str, ep: int = 2, exchange: str = "uneven"):
    """qwen3_moe_debug (3 blocks, the first dense; 8 experts of width 32, dim 64, top 2) on 2 GPUs, dp_shard 2, one
    sequence of 256 a rank; ``exchange``: parallel.ep_exchange."""
    cfg = _cfg(
        **({"parallel__ep_exchange": exchange} if exchange != "uneven" else {}),
        model__flavor="qwen3_moe_debug",
        parallel__dp_shard=2,
        parallel__ep=ep,
        training__seq_len=256,
        training__global_batch_size=2,
        training__micro_batch_size=1,
        training__dtype="bfloat16",
        training__activation_checkpointing=ac,
    )
    dims, args, m = validate(cfg, 2)
    x = memory_inputs(cfg, dims, args)
    share = rank_shares(args, dims.pp, cfg.parallel, cfg.training.seq_len)[0]
    return cfg, dims, args, m, x, share


def test_moe_terms_under_expert_parallelism():
    """ep 2, op AC: per MoE block and micro-batch the FSDP2 copies of the rank's 4 experts (one-rank mesh, gathered
    twice, each cast straight into the gather buffer: 34 B a parameter; 42 with FSDP2's own two-pass copy-in) and the routing at the fitted eager slot bytes, plus the permutation of its 256 x 2
    slots (14 elements of 2 bytes per slot x dim); no rescale of its experts' gradients (their reduction divides
    them), except for a run of older code; the extra FLOPs: the grouped GEMMs' rerun sixth and their padding."""
    cfg, dims, args, m, x, share = _layout("op")
    t = cfg.training
    got = moe_time_s(share, args, dims, 256.0, t, H200, x)
    local = 4 * expert_params(args)  # 4 of the 8 experts
    slots, layers, rate = 256 * 2, share.moe_layers, COPY_HBM_SHARE * H200.hbm_tbps * 1e12
    assert layers == 2 and dims.edp == 1
    routing = moe_overhead_s(local, slots, 64, False, 1.0, H200.hbm_tbps, weight_bytes=34)
    assert got.overhead == pytest.approx(layers * (routing + 14 * slots * 64 * 2 / rate))
    x_torch = replace(x, gather_fused=False)
    two_pass = moe_overhead_s(local, slots, 64, False, 1.0, H200.hbm_tbps, weight_bytes=42)
    assert moe_time_s(share, args, dims, 256.0, t, H200, x_torch).overhead == pytest.approx(
        layers * (two_pass + 14 * slots * 64 * 2 / rate)
    )
    assert got.per_step == 0.0
    older = moe_time_s(share, args, dims, 256.0, t, H200, x, ep_grad_rescale=True)
    assert older.per_step == pytest.approx(8 * layers * local / rate) and older.overhead == got.overhead
    rerun = 6 * expert_params(args) * slots * (1 / 3 - 1 / 6) * layers
    padding = layers * 4 * 64 / 2 * 3 * 2 * 64 * 32 * 3  # 128 rows an expert: 64-row tiles
    assert got.extra_matmul == pytest.approx(rerun + padding)
    # without ep (4 -> 8 local experts, FSDP2 over the block's 2 ranks: 20 B a parameter, 24 with FSDP2's own copy-in):
    # no permutation, no rescale
    cfg1, dims1, args1, m1, x1, share1 = _layout("op", ep=1)
    plain = moe_time_s(share1, args1, dims1, 256.0, cfg1.training, H200, x1)
    assert plain.per_step == 0.0
    assert plain.overhead == pytest.approx(
        layers * moe_overhead_s(2 * local, slots, 64, False, 1.0, H200.hbm_tbps, weight_bytes=20)
    )


def test_ep_all_to_alls_again_where_the_block_is_recomputed_in_full():
    """Four all-to-alls a MoE block without recomputation and under op-level checkpointing (which saves the
    exchanges and replays them: tests/unit/test_moe.py counts them in loom's code); six under full checkpointing
    (the recomputation sends the slots again), each sending half the 256 x 2 slots of dim 64 in bf16 over NVLink."""
    per_a2a = collective_s(256 * 2 * 64 * 2, 2, H200.link_gbps)
    for ac, exchanges in (("none", 4), ("op", 4), ("full", 6)):
        cfg, dims, args, m, x, share = _layout(ac)
        st = rank_time(share, args, dims, x, cfg, m, H200)
        assert st.ep == pytest.approx(m * 2 * exchanges * per_a2a)


def _peers(name: str) -> tuple[dict, dict]:
    """The loom side of a bench.peers pair as tests/data/plan_runs.json pins it (its config, tokens/s and profiled
    kernel time at the commit it ran; the result file in bench/results moves on with newer runs)."""
    with open(PLAN_RUNS) as f:
        (row,) = [r for r in json.load(f)["runs"] if r["file"] == name and r["row"] == "loom"]
    return dict(row["config"]), row


def test_ep_host_waits_per_block_and_their_idle():
    """One host wait per MoE block and micro-batch in the forward, none more where op-level checkpointing replays
    the forward's split lists, one more where the block is recomputed in full (ExpertParallel.host_splits, counted in
    tests/unit/test_moe.py); 12 blocks x 2 micro-batches x 2 waits idle 48 waits of EP_HOST_WAIT_S."""
    assert ep_host_waits("none", 1, 4) == ep_host_waits("op", 1, 4) == 1
    assert ep_host_waits("full", 1, 4) == 2
    assert ep_host_waits("every_k", 2, 4) == 1.5
    assert ep_host_s(2, 12, 2) == pytest.approx(48 * EP_HOST_WAIT_S)


def test_ep_host_idle_in_the_step_and_only_under_ep():
    """The debug model's 2 MoE blocks, one micro-batch, op AC: 2 waits of EP_HOST_WAIT_S under ep 2 (4 with a run's
    2 waits a block), none without ep."""
    cfg, dims, args, m, x, share = _layout("op")
    assert rank_time(share, args, dims, x, cfg, m, H200).host == pytest.approx(2 * EP_HOST_WAIT_S)
    assert rank_time(share, args, dims, x, cfg, m, H200, ep_waits=2).host == pytest.approx(4 * EP_HOST_WAIT_S)
    cfg1, dims1, args1, m1, x1, share1 = _layout("op", ep=1)
    assert rank_time(share1, args1, dims1, x1, cfg1, m1, H200).host == 0.0


def test_padded_ep_exchange_trades_the_host_waits_for_ep_times_the_bytes():
    """parallel.ep_exchange padded under ep 2: no host idle, the all-to-all time twice the uneven exchange's (every
    slot of the rank to each of the 2 ranks), and for this small model (exchanges of microseconds against waits of
    milliseconds) a faster step."""
    uneven = rank_time(*_args(_layout("op")), H200)
    padded = rank_time(*_args(_layout("op", exchange="padded")), H200)
    assert uneven.host > 0 and padded.host == 0.0
    assert padded.ep == pytest.approx(2 * uneven.ep) and uneven.ep > 0
    assert padded.total < uneven.total


def test_padded_ep_exchange_holds_ep_blocks_of_slots():
    """parallel.ep_exchange padded under ep 2 keeps, per stored MoE block, one more rank's worth of slots over the
    experts' inputs and outputs and their three hidden-width tensors: 2 MoE blocks x 256 tokens x top 2 x (2 x 64 +
    3 x 32) x 2 bytes more than the uneven exchange (nothing recomputed)."""
    from dataclasses import replace

    from loom.plan.memory import stage_activation

    cfg, dims, args, m, x, share = _layout("none")
    assert not x.ep_padded and memory_inputs(_layout("none", exchange="padded")[0], dims, args).ep_padded

    class Profile:  # the traced bytes are the same for both exchanges: only the padded term differs
        def held(self, layers, micro_batch, head, dense):
            return 0.0

    held = {
        padded: stage_activation(Profile(), 3, True, replace(x, ep_padded=padded), args, "none", 1.0, dense=1)
        for padded in (False, True)
    }
    assert held[True] - held[False] == 2 * 256 * 2 * (2 * 64 + 3 * 32) * 2


def _args(layout: tuple) -> tuple:
    """``_layout``'s (cfg, dims, args, m, x, share) in ``rank_time``'s order."""
    cfg, dims, args, m, x, share = layout
    return share, args, dims, x, cfg, m


@pytest.mark.parametrize(
    "name,throughput",
    [
        # Qwen3-MoE, 12 MoE blocks, EP2: EP_HOST_WAIT_S is fitted to it (24 waits in its 443 ms step); +50% before
        ("peers_qwen3_moe_12l_2gpu_h200.json", 0.02),
        # the DeepSeek-V3 proxy (one MoE block of four, EP2), checked with the constant: +17% (+22% before); the rest
        # is GPU work the plan misses (277 ms of kernels against 248 estimated) and idle outside the host waits
        ("peers_deepseek_v3_proxy_2gpu_h200.json", 0.20),
    ],
)
def test_moe_pairs_on_two_h200s(name, throughput):
    """The estimate, with the host waits of the code each run measured (two a MoE block: the recomputation's wait
    went in 52cc04f), against the measured median; the MoE runs' throughput tolerance (20%, tests/unit/test_plan.py)
    on the run not fitted."""
    config, loom = _peers(name)
    est = estimate(
        build_config(None, config),
        2,
        H200,
        ep_waits=loom["ep_host_waits"],
        ep_grad_rescale=loom["ep_grad_rescale"],
    )
    assert est.tokens_per_s_per_gpu == pytest.approx(loom["tokens_per_s_per_gpu"], rel=throughput)
    assert any("waits on the host" in n for n in est.notes)


@pytest.mark.parametrize(
    "name",
    [
        "peers_qwen3_moe_8l_1gpu_h200.json",
        "peers_deepseek_v3_3l_1gpu_h200.json",
        "peers_qwen3_moe_11l_1gpu_h200.json",
        "peers_deepseek_v3_4l_1gpu_h200.json",
    ],
)
def test_moe_families_on_one_h200(name):
    """Both families' one-GPU pairs, planned before they ran: at 060b63b (8 and 3 blocks) memory +5% / +8%,
    throughput -9% / +3%; at 51a86bb (11 and 4 blocks, the largest the plan fitted on one H200) memory +4% / +4%,
    throughput -13% / -1%; held to the MoE runs' tolerances (memory -5%..+15%, throughput 20%: tests/unit/test_plan.py)."""
    config, loom = _peers(name)
    est = estimate(build_config(None, config), 1, H200)
    assert -0.05 < est.memory.total / 2**30 / loom["peak_gib_max_rank"] - 1 < 0.15
    assert est.tokens_per_s_per_gpu == pytest.approx(loom["tokens_per_s_per_gpu"], rel=0.20)


def test_moe_pair_kernel_time_on_two_h200s():
    """The DeepSeek-V3 proxy's estimated GPU work (the step less the host idle) against the kernel time of its
    profiled step (rank 0, 0885551): -11%; its span equals its median step. Qwen3-MoE's profiled step at 0885551 is not
    used: its span (584 ms) exceeds its median step (443 ms), likely kernels of the step before counted in it (the
    over-count fixed in 5edc628), and its all-to-alls' 137 ms of kernels are mostly waits for the other rank
    (docs/benchmarks.md)."""
    config, loom = _peers("peers_deepseek_v3_proxy_2gpu_h200.json")
    est = estimate(
        build_config(None, config),
        2,
        H200,
        ep_waits=loom["ep_host_waits"],
        ep_grad_rescale=loom["ep_grad_rescale"],
    )
    gpu_work = est.time.total - est.time.host
    assert gpu_work * 1e3 == pytest.approx(loom["gpu_busy_ms_per_step"], rel=0.12)

"""bench.kernels' occupancy against hand-computed cases on sm_90's limits (65,536 registers, 64 warps, 228 KiB of
shared memory and 32 blocks per SM; registers allocated per warp in units of 256, 1 KiB reserved per block)."""

from __future__ import annotations

import pytest
import torch

from bench import kernels
from bench.kernels import SMLimits, occupancy


@pytest.mark.parametrize(
    "n_regs, warps, shared, blocks, limiter",
    [
        (128, 4, 0, 4, "registers"),  # 4,096 registers a warp: 16 warps
        (255, 8, 0, 1, "registers"),  # 255 rounds to 256 a thread: 8 warps, one block of 8
        (64, 4, 100 * 1024, 2, "shared"),  # registers allow 8 blocks, 233,472 // 103,424 = 2
        (32, 1, 0, 32, "blocks"),  # 64 warps by registers and warps, 32 blocks at most
    ],
)
def test_occupancy_by_hand(n_regs, warps, shared, blocks, limiter):
    got = occupancy(n_regs, warps, shared)
    assert (got["blocks_per_sm"], got["limited_by"]) == (blocks, limiter)
    assert got["occupancy"] == blocks * warps / 64


def test_occupancy_rounds_registers_per_warp_and_reads_the_limits_given():
    # 36 registers a thread: 1,152 a warp, allocated as 1,280; 8 warps a block: 65,536 // 10,240 = 6 blocks (7
    # without the rounding)
    assert occupancy(36, 8, 0)["blocks_per_sm"] == 6
    # an SM with half the registers halves the register-bound blocks
    assert occupancy(128, 4, 0, SMLimits(regs=32768))["blocks_per_sm"] == 2


def _row(ms: dict, chosen: str | None, seq: int = 4096) -> dict:
    """A bench row from synthetic forward+backward milliseconds per backend (None: the backend did not run)."""
    row = {
        "head_dim": 128,
        "heads": 16,
        "kv_heads": 16,
        "seq": seq,
        "causal": True,
        "docs": False,
        "backends": {
            n: (
                {"fwd_ms": t / 3, "fwd_bwd_ms": t, "fwd_tflops": 3 / t, "fwd_bwd_tflops": 3.5 / t}
                if t
                else {"error": "x"}
            )
            for n, t in ms.items()
        },
    }
    if chosen is not None:
        row["auto"] = {"chosen": chosen, "startup_ms_fwd_bwd": {}, "verdict": ""}
    return row


def test_cudnn_ratios_hold_autos_choice_against_cudnn_from_the_same_rounds():
    from bench.kernels import cudnn_ratios

    row = _row({"loom": 2.2, "sdpa_flash": 3.0, "sdpa_cudnn": 2.0}, "sdpa_cudnn")
    assert cudnn_ratios(row) == {"loom": 2.0 / 2.2, "auto": 1.0}  # auto took cuDNN: exactly its figures
    row = _row(
        {"loom": 1.6, "sdpa_flash": 3.0, "sdpa_cudnn": 2.0}, "flash"
    )  # loom's kernel under auto's name
    assert cudnn_ratios(row) == {"loom": 1.25, "auto": 1.25}
    assert cudnn_ratios(_row({"loom": 1.6, "sdpa_cudnn": None}, "flash")) == {}  # cuDNN did not run
    assert cudnn_ratios(_row({"loom": 1.6, "sdpa_cudnn": 2.0}, None)) == {"loom": 1.25}


def test_bar_verdict_passes_only_when_auto_matches_cudnn_everywhere():
    from bench.kernels import bar_verdict

    good = [
        _row({"loom": 2.2, "sdpa_cudnn": 2.0}, "sdpa_cudnn"),
        _row({"loom": 1.9, "sdpa_cudnn": 2.0}, "flash", seq=8192),
    ]
    assert bar_verdict(good).startswith("bar (auto >= 1.0x cuDNN fwd+bwd on every case): PASS")
    assert "lowest auto ÷ cuDNN 1.00 over 2 cases" in bar_verdict(good)
    assert "loom's kernel ÷ cuDNN 0.91-1.05" in bar_verdict(good)
    # auto's start-up timing took loom's kernel, the bench's rounds found cuDNN faster: the bar fails, honestly
    wrong = good + [_row({"loom": 2.1, "sdpa_cudnn": 2.0}, "flash", seq=16384)]
    assert ": FAIL (lowest auto ÷ cuDNN 0.95 over 3 cases" in bar_verdict(wrong)
    missing = good + [_row({"loom": 2.1, "sdpa_cudnn": 2.0}, None)]  # no auto figure: not a pass
    assert ": FAIL" in bar_verdict(missing) and "1 case(s) without an auto figure" in bar_verdict(missing)
    assert "no case timed both" in bar_verdict([_row({"loom": 2.0, "sdpa_cudnn": None}, "flash")])


def test_markdown_shows_autos_choice_and_the_bar():
    from bench.kernels import markdown

    rows = [
        _row({"loom": 2.2, "sdpa_flash": 3.0, "sdpa_cudnn": 2.0, "flex": 2.5}, "sdpa_cudnn"),
        _row({"loom": 1.6, "sdpa_flash": 3.0, "sdpa_cudnn": 2.0, "flex": None}, "flash", seq=8192),
    ]
    for r in rows:
        loom = r["backends"]["loom"]["fwd_bwd_tflops"]
        r["ratios_fwd_bwd"] = {
            n: loom / x["fwd_bwd_tflops"] for n, x in r["backends"].items() if n != "loom" and "fwd_ms" in x
        }
    lines = markdown(rows).splitlines()
    assert lines[0].endswith("| loom ÷ cuDNN (fwd+bwd) | auto's choice | auto ÷ cuDNN (fwd+bwd) |")
    assert lines[2].endswith("| 0.91 | sdpa_cudnn | 1.00 |") and lines[3].endswith("| 1.25 | flash | 1.25 |")
    assert "n/a" in lines[3]  # flex did not run there
    assert lines[-1].startswith("bar (auto >= 1.0x cuDNN fwd+bwd on every case): PASS")
    del rows[0]["auto"], rows[1]["auto"]  # a suite without auto: the table as before
    assert "auto" not in markdown(rows)


def test_positions_from_document_ids():
    import torch

    from bench.kernels import positions_from_ids

    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    assert positions_from_ids(ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]


def test_tensor_desc_table_holds_both_variants_and_their_speedup():
    from bench.kernels import desc_speedup, variant_markdown

    rows = [
        _row({"triton_plain": 2.0, "triton_desc": 1.6}, None),  # descriptors faster
        _row({"triton_plain": 2.0, "triton_desc": 2.5}, None, seq=8192),  # slower
        _row({"triton_plain": 2.0, "triton_desc": None}, None, seq=16384),  # failed: no speedup
    ]
    assert desc_speedup(rows[0]) == {"fwd": 1.25, "fwd_bwd": 1.25}
    assert desc_speedup(rows[2]) == {}
    lines = variant_markdown(rows).splitlines()
    assert lines[2].endswith("| 1.250 | 1.250 |") and lines[3].endswith("| 0.800 | 0.800 |")
    assert lines[4].endswith("| n/a | n/a | n/a |")
    assert lines[-1] == (
        "tensor descriptors ÷ plain pointers, forward+backward: 0.800-1.250x over 2 of 3 cases "
        "(> 1: descriptors faster)"
    )


def test_with_adds_known_backends_once_and_refuses_others(capsys):
    assert kernels.extra_backends("fa4,sdpa_efficient,fa4", ["loom", "sdpa_cudnn"]) == [
        "fa4",
        "sdpa_efficient",
    ]
    assert kernels.extra_backends("", ["loom"]) == []
    assert kernels.extra_backends("torch_reference", ["loom", "torch_reference"]) == []
    with pytest.raises(SystemExit) as e:
        kernels.extra_backends("fa4,fa3", ["loom"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bench.kernels: --with fa4,fa3: 'fa3' is not one of fa4, sdpa_efficient, torch_reference"]


def test_fa4_refuses_packed_documents_before_importing_its_package():
    q = torch.zeros(1, 2, 8, 16)
    with pytest.raises(NotImplementedError, match="packed documents"):
        kernels.fa4_fn(q, q, q, True, torch.zeros(1, 8, dtype=torch.long))

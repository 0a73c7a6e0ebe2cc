"""What the attention GPU test files share: random document ids and the relative error on chosen rows."""

from __future__ import annotations

import torch


def random_docs(b, s, gen):
    """Random document boundaries anywhere, and a run of padding (id -1) in the first row."""
    cuts = torch.rand(b, s, generator=gen) < 0.004
    ids = cuts.cumsum(1)
    ids[0, s // 3 : s // 3 + 17] = -1
    return ids


def rel_err(x, ref, rows):
    return ((x.float() - ref)[rows].abs().max() / ref[rows].abs().max().clamp_min(1e-6)).item()

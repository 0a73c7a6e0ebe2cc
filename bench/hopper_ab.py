"""A/B of the Gluon Hopper attention kernels (loom/kernels/attention/hopper.py) in one process on the same inputs:
per kernel (forward, dQ, dK/dV) and candidate config, the largest difference between the two sides' outputs, then
ms per call of each, timed in ROUNDS rounds of alternating order (the fastest counts: identical code measured up
to 6% apart between calls on the larger shapes, NOTES v18). The sides: another version of hopper.py (``--base``)
against the working tree's, or (``--l2-groups``) the working tree's persistent forward and dQ walking all
(batch, head) pairs by query block against walking them in groups sized to L2 (``hopper.l2_heads_per_group``).

    git show cc0ca83:loom/kernels/attention/hopper.py > base_hopper.py   # an untracked file travels to the device
    python bench/hopper_ab.py --base base_hopper.py --base-rev cc0ca83 --out bench/results/hopper_ab_h100.json
    python bench/hopper_ab.py --persistent-dkdv --out bench/results/hopper_dkdv_persistent_h100.json
    python bench/hopper_ab.py --l2-groups --out bench/results/hopper_l2_groups_h100.json

``--persistent-dkdv``: the working tree's dK/dV kernel against its persistent variant (each side its own configs;
the persistent one's items in groups of (batch, KV head) pairs sized to L2, ``hopper.l2_pairs_per_group``).

Ratios are base ms ÷ new ms (above 1: the new side is faster), for the best config of each side.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernels import TOKENS, bench_ms, doc_ids, random_doc_lens  # noqa: E402
from bench.train_1b import environment  # noqa: E402

# (head dim, query heads, kv heads, seq, packed documents), all causal, batch = TOKENS // seq
SHAPES = [(128, 16, 16, 4096, True), (128, 16, 16, 8192, True), (128, 16, 16, 16384, True),
          (128, 16, 16, 4096, False), (128, 16, 16, 8192, False), (128, 32, 8, 8192, True), (64, 32, 8, 8192, True)]
KINDS = ("fwd", "dq", "dkdv")
ROUNDS = 6


def load_base(path: str):
    """The other hopper.py as a module of its own (Gluon reads a kernel's source from its file)."""
    spec = importlib.util.spec_from_file_location("hopper_ab_base", os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inputs(d: int, hq: int, hkv: int, s: int, docs: bool) -> dict:
    """q, k, v, dout in the model's (B, S, H, D) memory layout seen as (B, H, S, D), the document bounds, and what
    the backward kernels take (the Triton forward's log-sum-exp and delta)."""
    from loom.kernels.attention import reference as R
    from loom.kernels.attention import triton as T

    b = TOKENS // s
    gen = torch.Generator().manual_seed(s)
    q, k, v, do = (torch.randn(b, s, h, d, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)
                   for h in (hq, hkv, hkv, hq))
    bounds = R.document_bounds(doc_ids(random_doc_lens(b, s, gen), "cuda")) if docs else None
    scale = d ** -0.5
    out, lse = T.attention_forward(q, k, v, True, bounds, 0, scale)
    delta, lse2 = T.backward_preprocess(do, out, lse, None)
    return dict(q=q, k=k, v=v, do=do, bounds=bounds, scale=scale, lse2=lse2, delta=delta, seq_key=T._seq_key(s))


def run(kind: str, side: tuple, config, x: dict) -> tuple:
    """One call of kernel ``kind`` of ``side`` (module, keyword arguments of that kernel) with a fixed config: its
    outputs."""
    module, kwargs = side
    q, k, v, do, bounds, scale, key = x["q"], x["k"], x["v"], x["do"], x["bounds"], x["scale"], x["seq_key"]
    if kind == "fwd":
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        module.forward(q, k, v, out, lse, True, bounds, scale, key, config=config, **kwargs)
        return out, lse
    if kind == "dq":
        dq = torch.empty_like(q)
        module.dq(q, k, v, do, x["lse2"], x["delta"], dq, True, bounds, scale, key, config=config, **kwargs)
        return (dq, )
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    module.dkdv(q, k, v, do, x["lse2"], x["delta"], dk, dv, True, bounds, scale, key, config=config, **kwargs)
    return dk, dv


def max_diff(a: tuple, b: tuple) -> float:
    return max((s.float() - t.float()).abs().nan_to_num(0.0).max().item() for s, t in zip(a, b))


def compare(shape: tuple, sides_of, kinds: list[str]) -> dict:
    """One shape: output differences and ms of both sides, every config of each side's candidates
    (``sides_of(x)[name]``: (module, kernel keyword arguments, {kind: configs} where they differ from the
    module's))."""
    x = inputs(*shape)
    sides = sides_of(x)
    fns, diffs = {}, {}
    for kind in kinds:
        configs = {name: side[2].get(kind, side[0]._CONFIGS[kind]) for name, side in sides.items()}
        for config in configs["new"]:
            same = config if config in configs["base"] else configs["base"][0]
            diffs[f"{kind}{config}"] = max_diff(run(kind, sides["base"][:2], same, x),
                                                run(kind, sides["new"][:2], config, x))
        for name, side in sides.items():
            for config in configs[name]:
                fns[f"{kind}_{name}{config}"] = lambda kind=kind, side=side[:2], config=config: run(kind, side, config,
                                                                                                      x)
    ms: dict[str, float] = {}
    for rnd in range(ROUNDS):
        for name in (list(fns) if rnd % 2 == 0 else list(reversed(fns))):
            t = bench_ms(fns[name])
            ms[name] = min(t, ms.get(name, t))
    d, hq, hkv, s, docs = shape
    row = {"head_dim": d, "heads": hq, "kv_heads": hkv, "seq": s, "docs": docs, "causal": True,
           "sides": {name: side[1] for name, side in sides.items()}, "max_abs_diff": diffs, "ms": ms}
    for kind in kinds:
        best = {side: min(t for name, t in ms.items() if name.startswith(f"{kind}_{side}")) for side in ("base", "new")}
        row[f"{kind}_base_over_new"] = best["base"] / best["new"]
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="", help="the other version of loom/kernels/attention/hopper.py")
    p.add_argument("--persistent-dkdv", action="store_true", help="dK/dV against its persistent variant")
    p.add_argument("--l2-groups", action="store_true", help="the working tree's forward and dQ: default item order "
                   "against (batch, head) groups sized to L2")
    p.add_argument("--base-rev", default="unknown", help="the git revision --base was taken from (recorded)")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--shapes", default="", help="'d,hq,hkv,seq,docs;...' instead of SHAPES")
    p.add_argument("--out", default="")
    p.add_argument("--commit", default=os.environ.get("LOOM_COMMIT", "unknown"))
    a = p.parse_args()
    if bool(a.base) + a.persistent_dkdv + a.l2_groups != 1:
        p.error("give one of --base FILE, --persistent-dkdv and --l2-groups")
    from loom.kernels.attention import hopper as new

    kinds = [k for k in a.kinds.split(",") if k]
    if a.persistent_dkdv:
        def sides_of(x):
            return {"base": (new, {}, {}), "new": (new, {"persistent": True}, {"dkdv": new._CONFIGS["dkdv_p"]})}
        kinds = ["dkdv"]
    elif a.l2_groups:
        def sides_of(x):
            pairs = x["q"].shape[0] * x["q"].shape[1]  # all (batch, head) pairs in one group: the order before
            return {"base": (new, {"heads_per_group": pairs}, {}),
                    "new": (new, {"heads_per_group": new.l2_heads_per_group(x["q"], x["k"])}, {})}
        kinds = [k for k in kinds if k != "dkdv"]  # the item groups are the forward's and dQ's
    else:
        base = load_base(a.base)

        def sides_of(x):
            return {"base": (base, {}, {}), "new": (new, {}, {})}
    shapes = [tuple(int(v) for v in item.split(",")) for item in a.shapes.split(";") if item] or SHAPES
    result = {"env": environment(a.commit, "python " + " ".join(sys.argv)), "base_rev": a.base_rev, "rows": []}
    for shape in shapes:
        row = compare((*shape[:4], bool(shape[4])), sides_of, kinds)
        result["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "ms"}), flush=True)
        if a.out:  # after every shape: a run cut short keeps what it measured
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""PyTorch's flight recorder: each rank's ring of its last collectives per process group, read from this process
and summarized, the dumps NCCL's watchdog writes into the run dir read back, and PyTorch's own analyzer of them."""

from __future__ import annotations

import os
import pickle
import sys

FR_FOLDER = "flight_recorder"
FR_PREFIX = (
    "rank_"  # the dump of rank r is <run.dir>/flight_recorder/rank_<r> (torch's analyzer reads this layout)
)
FR_ENTRIES = 20000  # collectives each rank's flight recorder keeps


def dump_flight_recorder() -> dict | None:
    """This process's flight recorder (NCCL's on CUDA builds, merged with the CPU one that gloo feeds), or None
    where this PyTorch has none."""
    import torch

    c10d = torch._C._distributed_c10d
    merged = None
    for name in ("_dump_nccl_trace", "_dump_fr_trace"):
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            try:
                raw = fn(includeCollectives=True, includeStackTraces=False, onlyActive=False)
            except TypeError:  # a build whose binding takes no arguments
                raw = fn()
            dump = pickle.loads(raw)
        except Exception:  # no recorder of this kind in this process
            continue
        if merged is None:
            merged = dump
        else:
            merged["entries"] = list(merged.get("entries", [])) + list(dump.get("entries", []))
            merged.setdefault("pg_config", {}).update(dump.get("pg_config", {}))
            merged.setdefault("pg_status", {}).update(dump.get("pg_status", {}))
    return merged


def summarize_dump(dump: dict | None, last: int = 4) -> dict[str, dict]:
    """Per process group of a flight-recorder dump: its description, member ranks (when recorded), last
    enqueued / completed sequence numbers, its ``last`` collectives (sequence number, op, sizes, state) and its
    ``last`` point-to-point ops (a pipeline's sends and receives: shown, not compared)."""
    if not dump:
        return {}
    groups: dict[str, dict] = {}
    config = dump.get("pg_config") or {}
    status = dump.get("pg_status") or {}
    for e in dump.get("entries") or []:
        name, desc = (tuple(e.get("process_group") or ("?", "?")) + ("?",))[:2]
        g = groups.setdefault(str(name), {"desc": desc, "ranks": None, "collectives": {}, "p2p": {}})
        p2p = bool(e.get("is_p2p"))
        seq = int(e.get("p2p_seq_id" if p2p else "collective_seq_id", 0))
        g["p2p" if p2p else "collectives"][seq] = {
            "seq": seq,
            "op": _op_name(e.get("profiling_name")),
            "sizes": e.get("input_sizes"),
            "dtypes": e.get("input_dtypes"),
            "state": e.get("state"),
            "duration_ms": e.get("duration_ms"),
        }
    for name, g in groups.items():
        for kind in ("collectives", "p2p"):
            g[kind] = [g[kind][seq] for seq in sorted(g[kind])][-last:]
        cfg = config.get(name) or next((c for c in config.values() if c.get("desc") == g["desc"]), None)
        if cfg and cfg.get("ranks"):
            try:
                g["ranks"] = [int(r) for r in str(cfg["ranks"]).strip("[]").split(",") if r.strip()]
            except ValueError:
                g["ranks"] = None
        st = status.get(name) or {}
        g["last_enqueued"] = st.get(
            "last_enqueued_collective", g["collectives"][-1]["seq"] if g["collectives"] else 0
        )
        g["last_completed"] = st.get("last_completed_collective")
    return groups


def _op_name(profiling_name) -> str:
    """``nccl:all_reduce`` -> ``all_reduce``."""
    return str(profiling_name or "?").split(":", 1)[-1]


def read_dumps(folder: str, since: float = 0.0) -> dict[int, dict]:
    """The flight-recorder dumps ``rank_<r>`` in ``folder`` written at or after ``since`` (a time.time()),
    as ``{rank: dump}`` (unreadable files are skipped)."""
    out = {}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return out
    for name in names:
        rank = name[len(FR_PREFIX) :]
        path = os.path.join(folder, name)
        if not (name.startswith(FR_PREFIX) and rank.isdecimal()) or os.path.getmtime(path) < since:
            continue
        try:
            with open(path, "rb") as fh:
                out[int(rank)] = pickle.load(fh)
        except Exception:
            continue
    return out


def analyzer_text(folder: str, timeout_s: float = 300.0) -> str:
    """PyTorch's own analyzer (``torch.distributed.flight_recorder.fr_trace``) on the dumps in ``folder``: its
    output, or why there is none. It reads NCCL's dumps; gloo's (PyTorch 2.13) lack the group names it needs."""
    import subprocess

    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.flight_recorder.fr_trace",
                folder,
                "--prefix",
                FR_PREFIX,
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"PyTorch's analyzer did not run: {err}"
    text = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        last = text.splitlines()[-1] if text else f"exit code {proc.returncode}"
        return f"PyTorch's analyzer could not read these dumps: {last}"
    return "PyTorch's analyzer (torch.distributed.flight_recorder):\n" + "\n".join(text.splitlines()[-200:])

"""The hang report: every rank's last collectives compared per process group, naming the ranks the others waited
for; written as ``<run.dir>/hang_report.txt`` (and ``.json``). ``python -m loom.runtime.hang_report RUN_DIR``
builds it from the flight-recorder dumps in RUN_DIR, with PyTorch's analyzer's output appended."""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field

from loom.runtime.flight_recorder import FR_FOLDER, analyzer_text, read_dumps, summarize_dump

REPORT = "hang_report"  # <run.dir>/hang_report.txt and .json


@dataclass
class Finding:
    """One process group where the ranks disagree: ``behind`` never joined collective ``seq`` (``op``) that
    ``waiting`` were in, or (``desync``) the ranks issued different collectives under one sequence number."""

    group: str
    desc: str
    seq: int
    op: str
    waiting: list[int]
    behind: dict[int, str]  # rank -> its last collective on this group ("broadcast #56", "none")
    desync: bool = False


@dataclass
class HangReport:
    world: int
    stuck: list[int]
    silent: list[int]  # ranks that did not answer (dead, or stuck holding the interpreter)
    findings: list[Finding]
    ranks: dict[int, dict] = field(default_factory=dict)  # each rank's answer
    detected_by: list[int] = field(default_factory=list)
    error: str = ""

    def line(self, where: str = "") -> str:
        """The console's one line."""
        text = "collective timeout: "
        if self.findings:
            f = self.findings[0]
            who = _ranks(list(f.behind))
            if f.op == BARRIER:
                text += (
                    f"rank{_s(f.behind)} {who} never reached the monitored barrier ({f.desc}) that "
                    f"rank{_s(f.waiting)} {_ranks(f.waiting)} waited at"
                )
            elif f.desync:
                text += (
                    f"rank{_s(f.behind)} {who} issued another collective than rank{_s(f.waiting)} "
                    f"{_ranks(f.waiting)} at #{f.seq} ({f.op}) on group {f.desc}"
                )
            else:
                lasts = "; ".join(f"rank {r}'s last: {last}" for r, last in list(f.behind.items())[:3])
                text += (
                    f"rank{_s(f.behind)} {who} never joined {f.op} #{f.seq} on group {f.desc}, which "
                    f"rank{_s(f.waiting)} {_ranks(f.waiting)} waited in ({lasts})"
                )
            extra = [r for r in self.silent if r not in f.behind]
            if extra:
                text += f"; no answer from rank{_s(extra)} {_ranks(extra)}"
        elif self.silent:
            text += (
                f"no answer from rank{_s(self.silent)} {_ranks(self.silent)} (dead, or stuck holding Python)"
            )
        else:
            text += f"every rank reached the same collective; {self.error or 'see the report'}"
        stuck = [r for r in self.stuck if r in self.ranks and self.ranks[r].get("stack")]
        if stuck:
            r = stuck[0]
            info = self.ranks[r]
            after = f" (after step {info['step']})" if info.get("step") is not None else ""
            text += f"; rank {r}{after} is in {_where(info['stack'])}"
        return text + (f"; report {where}" if where else "")

    def text(self) -> str:
        """The report file: the summary, then each rank's answer."""
        out = [
            self.line(),
            "",
            f"world {self.world}; stuck: {_ranks(self.stuck) or 'none named'}; "
            f"detected by rank(s) {_ranks(self.detected_by) or '?'}",
        ]
        if self.error:
            out.append(f"error: {self.error}")
        for f in self.findings:
            kind = "desync" if f.desync else "hang"
            out.append(
                f"{kind} on group {f.desc} ({f.group}): collective #{f.seq} {f.op}; waiting: "
                f"{_ranks(f.waiting)}; " + ", ".join(f"rank {r}: {v}" for r, v in f.behind.items())
            )
        for r in range(self.world):
            info = self.ranks.get(r)
            out.append("")
            if info is None:
                out.append(f"rank {r}: no answer")
                continue
            out.append(
                f"rank {r} ({info.get('host', '?')}, pid {info.get('pid', '?')}): {info.get('source', '?')}, "
                f"after step {info.get('step')}, {info.get('phase', '')}"
                + (f"; error: {info['error']}" if info.get("error") else "")
            )
            for name, g in sorted((info.get("groups") or {}).items()):
                colls = ", ".join(
                    f"#{c['seq']} {c['op']} {c['sizes']} {c['state']}" for c in g["collectives"]
                )
                out.append(f"  group {g['desc']} ({name}): last enqueued #{g.get('last_enqueued')}: {colls}")
                if g.get("p2p"):
                    out.append(
                        "    point-to-point: "
                        + ", ".join(f"#{c['seq']} {c['op']} {c['sizes']} {c['state']}" for c in g["p2p"])
                    )
            for frame in info.get("stack") or []:
                out.append(f"  at {frame}")
        out += [
            "",
            "Flight-recorder dumps (where written): flight_recorder/rank_<r>; PyTorch's analyzer of NCCL's "
            "dumps: python -m torch.distributed.flight_recorder.fr_trace <run.dir>/flight_recorder --prefix rank_ "
            "(python -m loom.runtime.hang_report <run.dir> appends its output here)",
        ]
        return "\n".join(out) + "\n"

    def to_json(self) -> dict:
        d = asdict(self)
        d["ranks"] = {str(k): v for k, v in self.ranks.items()}
        return d


def _s(ranks) -> str:
    return "s" if len(ranks) > 1 else ""


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ", ".join(map(str, ranks[:16])) + (f" (+{len(ranks) - 16} more)" if len(ranks) > 16 else "")


BARRIER = "monitored barrier"
_MISSED = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def build_report(
    answers: dict[int, dict | None], world: int, detected_by: list[int] | None = None, error: str = ""
) -> HangReport:
    """Compare every rank's last collectives per process group (``answers[r]["groups"]``, as
    ``summarize_dump`` makes them; None: rank r did not answer) and name the ranks the others waited for; a
    monitored barrier's error (in ``error`` or a rank's answer) names the ranks that never reached it."""
    silent = sorted(r for r in range(world) if answers.get(r) is None)
    findings: list[Finding] = []
    missed: set[int] = set()
    for text in [error] + [(a or {}).get("error") or "" for a in answers.values()]:
        m = _MISSED.search(text)
        if m:
            missed |= {int(r) for r in re.findall(r"\d+", m.group(1))}
    if missed:
        phase = next((a.get("phase") for a in answers.values() if a and a.get("error")), None) or "?"
        findings.append(
            Finding(
                BARRIER,
                phase,
                0,
                BARRIER,
                sorted(r for r, a in answers.items() if a is not None and r not in missed),
                {
                    r: "no answer"
                    if answers.get(r) is None
                    else (_where(answers[r]["stack"]) if answers[r].get("stack") else "?")
                    for r in sorted(missed)
                },
            )
        )
    groups: dict[str, dict] = {}
    for r, info in answers.items():
        for name, g in ((info or {}).get("groups") or {}).items():
            entry = groups.setdefault(
                name, {"desc": g.get("desc"), "members": set(g.get("ranks") or []), "by_rank": {}}
            )
            entry["by_rank"][r] = g
    for name, entry in groups.items():
        by_rank = entry["by_rank"]
        seqs = {r: int(g.get("last_enqueued") or 0) for r, g in by_rank.items()}
        top = max(seqs.values())
        waiting = sorted(r for r, s in seqs.items() if s == top)
        op = _coll_at(by_rank[waiting[0]], top)
        members = entry["members"] or set(by_rank)
        behind = {r: _last_of(by_rank[r]) for r, s in sorted(seqs.items()) if s < top}
        behind.update({r: "no answer" for r in sorted(members) if r not in by_rank and r in silent})
        if behind:
            findings.append(Finding(name, entry["desc"], top, op["op"] if op else "?", waiting, behind))
            continue
        sigs = {r: _signature(_coll_at(by_rank[r], top)) for r in waiting}
        if len(set(sigs.values())) > 1:  # one sequence number, different collectives: a desync
            counts: dict = {}
            for s in sigs.values():
                counts[s] = counts.get(s, 0) + 1
            major = max(counts, key=lambda s: (counts[s], s == sigs[waiting[0]]))
            odd = {r: f"{s[0]} {s[1]}" for r, s in sigs.items() if s != major}
            findings.append(
                Finding(
                    name,
                    entry["desc"],
                    top,
                    f"{major[0]} {major[1]}",
                    sorted(r for r, s in sigs.items() if s == major),
                    odd,
                    desync=True,
                )
            )
    detected = sorted(detected_by or [])
    # the group where the detecting ranks waited first, then hangs before desyncs, then the furthest collective
    findings.sort(key=lambda f: (f.op != BARRIER, not set(f.waiting) & set(detected), f.desync, -f.seq))
    stuck = sorted({r for f in findings for r in f.behind} | set(silent))
    return HangReport(
        world, stuck, silent, findings, {r: a for r, a in answers.items() if a is not None}, detected, error
    )


def _coll_at(g: dict, seq: int) -> dict | None:
    for c in reversed(g.get("collectives") or []):
        if c["seq"] == seq:
            return c
    return None


def _last_of(g: dict) -> str:
    colls = g.get("collectives") or []
    if not colls:
        return "none"
    c = colls[-1]
    return f"{c['op']} #{c['seq']}"


def _signature(c: dict | None) -> tuple:
    if c is None:
        return ("?", "")
    return (c["op"], json.dumps(c.get("sizes")))


def write_report(run_dir: str, report: HangReport) -> str:
    """``hang_report.txt`` and ``.json`` in the run dir; returns the text file's path."""
    path = os.path.join(run_dir, REPORT + ".txt")
    with open(path, "w") as fh:
        fh.write(report.text().replace(report.line(), report.line(path), 1))
    with open(os.path.join(run_dir, REPORT + ".json"), "w") as fh:
        json.dump(report.to_json(), fh, indent=1, default=str)
    return path


def report_from_dumps(run_dir: str, since: float = 0.0, world: int | None = None) -> HangReport | None:
    """The report from the dumps NCCL's watchdog wrote (``TORCH_NCCL_DUMP_ON_TIMEOUT``), or None without any."""
    dumps = read_dumps(os.path.join(run_dir, FR_FOLDER), since)
    if not dumps:
        return None
    answers = {
        r: {"rank": r, "source": "flight-recorder dump", "groups": summarize_dump(d)}
        for r, d in dumps.items()
    }
    if world is None:
        members = [r for a in answers.values() for g in a["groups"].values() for r in (g.get("ranks") or [])]
        world = max([*answers, *members]) + 1
    return build_report(
        answers, world, error=f"from the flight-recorder dumps in {os.path.join(run_dir, FR_FOLDER)}"
    )


def _where(stack: list[str]) -> str:
    """The innermost frame, and the innermost of loom's own when that is another one."""
    own = next((f for f in reversed(stack) if f.startswith("loom/")), None)
    return stack[-1] + (f", called from {own}" if own and own != stack[-1] else "")


def _main(argv: list[str]) -> int:
    """``python -m loom.runtime.hang_report RUN_DIR``: the report from the flight-recorder dumps in RUN_DIR, with
    PyTorch's analyzer's output appended."""
    if len(argv) != 1:
        print("usage: python -m loom.runtime.hang_report RUN_DIR", file=sys.stderr)
        return 2
    report = report_from_dumps(argv[0])
    if report is None:
        print(f"no flight-recorder dumps in {os.path.join(argv[0], FR_FOLDER)}", file=sys.stderr)
        return 1
    path = write_report(argv[0], report)
    with open(path, "a") as fh:
        fh.write("\n" + analyzer_text(os.path.join(argv[0], FR_FOLDER)) + "\n")
    with open(path) as fh:
        print(fh.read(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

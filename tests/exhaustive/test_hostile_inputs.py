"""Issue 49's hostile inputs as one re-runnable sweep: every input the issue names (a wrong result, the hang, the
tracebacks, the silent acceptances, the full disks) run through the real ``loom`` command line as a user would, as a
subprocess with a time limit, and its outcome classified:

- ``one-line``: exit 2, exactly one non-warning line on stderr (``loom: error: ...``), no traceback;
- ``stopped``: exit 1, one ``loom: stopped: ...`` line (a run that stopped itself, e.g. non-finite steps);
- ``warned``: exit 0 with the expected one-line warning on stderr;
- ``correct``: exit 0 and the case's own check of the result holds (a fixed wrong result, an accepted form);
- ``traceback``, ``hang`` (the time limit passed), ``silent`` (exit 0 without the refusal or warning), ``other``.

Each case asserts its expected class and writes its id, expected and found class and its line to
``hostile_classes.txt`` in pytest's base temporary folder; the module's teardown prints the count per class (seen with
``-s`` without ``-n``). Run it by hand (docs/reliability.md):
``python -m pytest -q -m exhaustive tests/exhaustive/test_hostile_inputs.py`` (``-n 2`` at most)."""

from __future__ import annotations

import collections
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from tests.tiny import tiny_args

pytestmark = pytest.mark.exhaustive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = "tests.exhaustive.test_hostile_inputs"
COUNTS: collections.Counter = collections.Counter()


# ---- reward functions and an eval hook that do not fit (named by module:function in the cases) -------------------


def bad_count(prompts, completions, **kw):
    return [1.0]


def returns_none(prompts, completions, **kw):
    return None


def no_arguments():
    return {}


# ---- running and classifying ----------------------------------------------------------------------------------------


@dataclass
class Outcome:
    code: int | None
    out: str
    err: str
    timed_out: bool = False

    def lines(self) -> list[str]:
        """stderr without Python warnings (a ``...Warning: ...`` line and its indented source line) and blanks."""
        kept, skip = [], False
        for line in self.err.splitlines():
            if not line.strip():
                continue
            if skip and line.startswith(" "):
                continue
            skip = "Warning: " in line or line.startswith("loom: warning")
            if not skip:
                kept.append(line)
        return kept


def classify(o: Outcome, warning: str | None, check: Callable | None) -> str:
    if o.timed_out:
        return "hang"
    if "Traceback (most recent call last)" in o.err:
        return "traceback"
    lines = o.lines()
    if o.code == 2:
        return "one-line" if len(lines) == 1 and lines[0].startswith("loom: error: ") else "other"
    if o.code == 1 and len(lines) == 1 and lines[0].startswith("loom: stopped: "):
        return "stopped"
    if o.code == 0:
        if warning is not None and warning in o.out + o.err:
            return "warned"
        if check is not None and check(o):
            return "correct"
        return "silent"
    return "other"


def fsize_limit(limit: int):
    """A full disk without root: writes past ``limit`` bytes per file fail (EFBIG), as on a filesystem that is full."""

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def loom(cwd, argv, timeout: float = 240, fsize: int | None = None, stdin: str | None = None) -> Outcome:
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "default"}
    env.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(cwd / "hf_home")})
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "loom", *map(str, argv)],
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=fsize_limit(fsize) if fsize else None,
    )
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
        return Outcome(proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Outcome(None, out, err, timed_out=True)


# ---- what the cases run on: a loom checkpoint, an HF export, a reward model ----------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from loom.config import build_config
    from loom.train.trainer import Trainer
    from tests.tiny import tiny_overrides
    from tests.unit.test_nothing_lost import export_tiny
    from tests.unit.test_reward import reward_run, write_pairs

    tmp = tmp_path_factory.mktemp("hostile_models")
    over = tiny_overrides(tmp / "run", tmp / "cache", **{"training.steps": 1, "checkpoint.at_end": "true"})
    Trainer(build_config(None, {k: str(v) for k, v in over.items()})).fit()
    source = write_pairs(tmp / "pairs.jsonl", n=16)
    Trainer(
        reward_run(
            tmp / "rm_run", tmp / "cache", source, **{"training.steps": 1, "checkpoint.at_end": "true"}
        )
    ).fit()
    from tests.unit.test_chat import build_folder
    from tests.unit.test_generate import EOS, random_hf_llama

    build_folder(tmp / "gen", "llama3")  # a causal LM with a tokenizer.json, for loom generate
    model = random_hf_llama()
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(tmp / "gen")
    return {
        "gen": str(tmp / "gen"),
        "ckpt": str(tmp / "run" / "checkpoints" / "step_00000001"),
        "hf": export_tiny(tmp / "hf", 0),
        "rm": str(tmp / "rm_run" / "checkpoints" / "step_00000001"),
        "pairs": source,
    }


# ---- the cases ------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    id: str
    expect: str  # the class the fixed loom gives
    build: Callable  # (tmp_path, models) -> argv (a list), or (argv, run options) for timeout / fsize / stdin
    needle: str = ""  # must appear in the one line (or the warning, for "warned")
    check: Callable | None = None  # for "correct": a check of the outcome (and tmp_path)
    after: Callable | None = None  # (tmp_path) -> a problem left behind (a partial file), or None
    xfail: str = ""
    kw: dict = field(default_factory=dict)


def train(tmp, *extra, **over):
    return ["train", *tiny_args(tmp / "run", tmp / "cache", **{"metrics.progress": "false", **over}), *extra]


def grpo(tmp, **over):
    return train(
        tmp,
        **{
            "training.objective": "grpo",
            "grpo.warmup_steps": 0,
            "grpo.group_size": 2,
            "grpo.max_new_tokens": 2,
            "training.steps": 2,
            **over,
        },
    )


def write(tmp, name, content) -> str:
    path = tmp / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


def jsonl(tmp, name, rows) -> str:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if (tmp / name).is_file() and (
        tmp / name
    ).read_text() == text:  # unchanged: its token cache still matches
        return str(tmp / name)
    return write(tmp, name, text)


def hosts(tmp, text="a slots=2\nb slots=2\n") -> str:
    return write(tmp, "hosts", text)


def launch(tmp, *extra, text="a slots=2\nb slots=2\n"):
    return ["launch", "--hostfile", hosts(tmp, text), "--dry-run", *extra]


SLURM = ["launch", "--slurm", "--nodes", "1", "--gpus-per-node", "1"]
K8S = ["launch", "--kubernetes", "--image", "img", "--nodes", "1", "--gpus-per-node", "1"]


def chat_rows(content):
    return [{"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": content}]}] * 8


def sft(tmp, rows, **over):
    return train(
        tmp,
        **{
            "training.objective": "sft",
            "data.source": jsonl(tmp, "chat.jsonl", rows),
            "training.steps": 1,
            "data.val_fraction": 0.0,
            **over,
        },
    )


def pairs(tmp, objective, rows, **over):
    return train(
        tmp,
        **{
            "training.objective": objective,
            "data.source": jsonl(tmp, "pairs.jsonl", rows),
            "training.steps": 1,
            "training.seq_len": 64,
            "data.val_fraction": 0.0,
            **over,
        },
    )


def same_pairs(n):
    return [{"prompt": f"p{i}", "chosen": "same", "rejected": "same"} for i in range(n)]


def mixed_pairs():
    good = [{"prompt": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(8)]
    return same_pairs(6) + good


def adapter(tmp, content) -> list[str]:
    folder = tmp / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(content)
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return train(tmp, **{"lora.rank": 4, "lora.init_from": str(folder), "training.steps": 1})


def bad_hf_config(tmp, m):
    import shutil

    shutil.copytree(m["hf"], tmp / "hf")
    cfg = json.loads((tmp / "hf" / "config.json").read_text())
    cfg["hidden_size"] = "64"
    (tmp / "hf" / "config.json").write_text(json.dumps(cfg))
    return ["convert", "--from-hf", tmp / "hf", "--to", tmp / "ckpt"]


def metrics_run(tmp, extra_lines: str) -> str:
    run = tmp / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 5.0 - s, "lr": 1e-3, "grad_norm": 1.0} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + extra_lines)
    return str(run)


def nothing_at(*names):
    """After the case: none of ``names`` (under tmp_path) exists, or a .tmp / partial file beside them."""

    def check(tmp):
        left = [n for n in names if os.path.exists(tmp / n)]
        return f"left behind: {left}" if left else None

    return check


def no_partial_under(folder):
    """After the case: no file under ``folder`` (tmp_path relative) that a failed write left (a .tmp, or empty)."""

    def check(tmp):
        root = tmp / folder
        bad = []
        for dirpath, _, names in os.walk(root):
            for n in names:
                p = os.path.join(dirpath, n)
                if n.endswith(".tmp") or os.path.getsize(p) == 0:
                    bad.append(os.path.relpath(p, tmp))
        return f"left behind: {bad}" if bad else None

    return check


LM_EVAL = dict(timeout=400)
FULL = 64 * 1024  # bytes a file may grow to under the "full disk" cases

CASES = [
    # ---- "Lost or wrong", item 5 ----
    Case(
        "launch-cmd-ssh-host",
        "correct",
        lambda t, m: launch(t, "--launcher-cmd", "ssh {host}", "--training.global_batch_size", "32"),
        check=lambda o: "ssh a " in o.out and "ssh a a " not in o.out,
    ),
    Case(
        "eval-empty-source",
        "one-line",
        lambda t, m: ["eval", m["ckpt"], "--source", write(t, "empty.jsonl", "")],
        needle="",
    ),
    Case(
        "grpo-huge-lr",
        "stopped|one-line",
        lambda t, m: grpo(t, **{"optimizer.lr": 1e12, "training.steps": 4, "optimizer.warmup_steps": 0}),
    ),
    # ---- the hang ----
    Case(
        "node-rank-past-nnodes",
        "one-line",
        lambda t, m: (
            ["train", "--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "localhost:29555"],
            {"timeout": 60},
        ),
        needle="--node-rank",
    ),
    # ---- tracebacks: data ----
    Case("content-is-a-number", "one-line", lambda t, m: sft(t, chat_rows(5)), needle="content"),
    Case(
        "content-openai-parts",
        "correct",
        lambda t, m: sft(
            t, chat_rows([{"type": "text", "text": "Hello "}, {"type": "text", "text": "there."}])
        ),
        check=lambda o: True,
    ),
    Case(
        "json-nested-100000",
        "one-line",
        lambda t, m: train(
            t,
            **{"data.source": write(t, "deep.jsonl", '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")},
        ),
        needle="too deeply",
    ),
    Case(
        "chat-template-not-utf8",
        "one-line",
        lambda t, m: sft(
            t, chat_rows("Fine."), **{"data.chat_template": write(t, "latin.jinja", b"{{ caf\xe9 }}")}
        ),
        needle="UTF-8",
    ),
    Case(
        "corrupt-parquet-data-source",
        "one-line",
        lambda t, m: train(t, **{"data.source": write(t, "cut.parquet", b"PAR1" + b"\0" * 64)}),
        needle="parquet",
    ),
    Case(
        "corrupt-parquet-grpo-prompts",
        "one-line",
        lambda t, m: grpo(t, **{"grpo.prompts": write(t, "cut.parquet", b"PAR1" + b"\0" * 64)}),
        needle="parquet",
    ),
    # ---- tracebacks: rewards, hooks, judges ----
    Case(
        "reward-wrong-count",
        "one-line",
        lambda t, m: grpo(t, **{"grpo.rewards": f"{HERE}:bad_count"}),
        needle="rewards for",
    ),
    Case(
        "reward-returns-none",
        "one-line",
        lambda t, m: grpo(t, **{"grpo.rewards": f"{HERE}:returns_none"}),
        needle="returned None",
    ),
    Case(
        "reward-math-sqrt",
        "one-line",
        lambda t, m: grpo(t, **{"grpo.rewards": "math:sqrt"}),
        needle="keyword arguments",
    ),
    Case(
        "reward-weights-abc",
        "one-line",
        lambda t, m: grpo(t, **{"grpo.reward_weights": "abc"}),
        needle="grpo.reward_weights",
    ),
    Case(
        "eval-hook-wrong-signature",
        "one-line",
        lambda t, m: train(
            t,
            **{
                "training.eval_hook": f"{HERE}:no_arguments",
                "training.eval_every": 2,
                "data.val_fraction": 0.1,
            },
        ),
        needle="training.eval_hook",
    ),
    Case(
        "reward-model-as-judge",
        "one-line",
        lambda t, m: grpo(
            t, **{"grpo.judge": m["rm"], "grpo.judge_template": "Rate {completion} for {prompt}"}
        ),
        needle="reward model",
    ),
    Case(
        "reward-model-to-generate",
        "one-line",
        lambda t, m: ["generate", "--model", m["rm"], "hi", "--max-new-tokens", "2"],
        needle="loom score",
    ),
    Case(
        "reward-model-to-eval",
        "one-line",
        lambda t, m: ["eval", m["rm"], "--source", m["pairs"], "--text-field", "chosen"],
        needle="loom score",
    ),
    Case(
        "eval-tasks-gsm8k-offline",
        "one-line",
        lambda t, m: (
            train(t, **{"training.eval_tasks": "gsm8k", "training.eval_every": 2, "data.val_fraction": 0.1}),
            LM_EVAL,
        ),
        needle="fetched",
    ),
    Case(
        "rdzv-file-missing-folder",
        "one-line",
        lambda t, m: (
            ["train", "--rdzv-backend", "file", "--rdzv-endpoint", str(t / "nowhere" / "rdzv")],
            {"timeout": 60},
        ),
        needle="does not exist",
    ),
    # ---- tracebacks: HF config.json and adapter_config.json ----
    Case("hf-config-string-number", "one-line", bad_hf_config, needle="hidden_size"),
    Case("adapter-config-list", "one-line", lambda t, m: adapter(t, "[1, 2]"), needle="JSON list"),
    Case(
        "adapter-alpha-null",
        "one-line",
        lambda t, m: adapter(t, '{"r": 4, "lora_alpha": null, "target_modules": ["q_proj"]}'),
        needle="lora_alpha",
    ),
    Case(
        "adapter-alpha-string",
        "one-line",
        lambda t, m: adapter(t, '{"r": 4, "lora_alpha": "16", "target_modules": ["q_proj"]}'),
        needle="lora_alpha",
    ),
    Case(
        "adapter-targets-mixed",
        "one-line",
        lambda t, m: adapter(t, '{"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", 3]}'),
        needle="target_modules",
    ),
    # ---- tracebacks: generate, eval, score ----
    Case(
        "generate-max-new-tokens-1e9",
        "one-line",
        lambda t, m: ["generate", "--model", m["gen"], "hi", "--max-new-tokens", "1000000000"],
        needle="--max-new-tokens",
    ),
    Case(
        "generate-file-not-utf8",
        "one-line",
        lambda t, m: ["generate", "--model", m["gen"], "--file", write(t, "latin.txt", b"caf\xe9\n")],
        needle="UTF-8",
    ),
    Case(
        "generate-output-is-folder",
        "one-line",
        lambda t, m: ["generate", "--model", m["gen"], "hi", "--max-new-tokens", "2", "--output", t],
        needle="folder",
    ),
    Case(
        "eval-prefix-token-past-vocab",
        "one-line",
        lambda t, m: [
            "eval",
            m["ckpt"],
            "--source",
            jsonl(t, "d.jsonl", [{"text": "the cat sat on the mat"}] * 4),
            "--prefix-token-id",
            "99999999",
        ],
        needle="--prefix-token-id",
    ),
    Case(
        "score-output-dot",
        "one-line",
        lambda t, m: [
            "score",
            "--model",
            m["rm"],
            "--file",
            jsonl(t, "r.jsonl", [{"text": "hi"}]),
            "--output",
            ".",
        ],
        needle="--output",
    ),
    Case(
        "score-file-not-utf8",
        "one-line",
        lambda t, m: [
            "score",
            "--model",
            m["rm"],
            "--file",
            write(t, "latin.jsonl", b'{"text": "caf\xe9"}\n'),
        ],
        needle="UTF-8",
    ),
    Case(
        "score-text-past-seq-len",
        "warned|one-line",
        lambda t, m: [
            "score",
            "--model",
            m["rm"],
            "--file",
            jsonl(t, "long.jsonl", [{"text": "word " * 4000}]),
        ],
        needle="",
    ),
    # ---- tracebacks: launch ----
    Case(
        "launch-hostfile-binary",
        "one-line",
        lambda t, m: ["launch", "--hostfile", write(t, "bin", b"\x00\xff\xfe\x80 slots=1"), "--dry-run"],
        needle="UTF-8",
    ),
    Case(
        "slurm-script-unwritable",
        "one-line",
        lambda t, m: [*SLURM, "--script", os.path.join(hosts(t), "job.sbatch")],
        needle="--script",
    ),
    Case(
        "kubernetes-out-unwritable",
        "one-line",
        lambda t, m: [*K8S, "--out", os.path.join(hosts(t), "sub")],
        needle="--out",
    ),
    # ---- tracebacks: convert on a full disk ----
    Case(
        "convert-to-hf-disk-full",
        "one-line",
        lambda t, m: (["convert", "--from", m["ckpt"], "--to-hf", t / "out"], {"fsize": FULL}),
        needle="out",
        after=nothing_at("out"),
    ),
    Case(
        "convert-reward-to-hf-disk-full",
        "one-line",
        lambda t, m: (["convert", "--from", m["rm"], "--to-hf", t / "out"], {"fsize": FULL}),
        needle="out",
        after=nothing_at("out"),
    ),
    Case(
        "convert-from-hf-disk-full",
        "one-line",
        lambda t, m: (["convert", "--from-hf", m["hf"], "--to", t / "out"], {"fsize": FULL}),
        needle="out",
        after=nothing_at("out"),
    ),
    Case(
        "convert-to-peft-disk-full",
        "one-line",
        lambda t, m: (
            ["convert", "--from", "LORA_CKPT", "--to-peft", t / "out"],
            {"fsize": 4096},
        ),
        needle="out",
        after=nothing_at("out"),
    ),
    # ---- silent acceptances: fields that do nothing ----
    *[
        Case(f"inactive-{k}", "one-line", (lambda k, v: lambda t, m: train(t, **{k: v}))(k, v), needle=k)
        for k, v in (
            ("lora.alpha", 32),
            ("lora.targets", "q,v"),
            ("lora.dropout", 0.1),
            ("lora.rslora", "true"),
            ("parallel.diloco_outer_lr", 0.5),
            ("parallel.diloco_fragments", 2),
            ("training.eval_tasks_limit", 5),
        )
    ],
    Case(
        "inactive-grpo.reward_model_weight",
        "one-line",
        lambda t, m: grpo(t, **{"grpo.reward_model_weight": 2.0}),
        needle="grpo.reward_model_weight",
    ),
    Case(
        "inactive-grpo.digits-with-prompts",
        "one-line",
        lambda t, m: grpo(
            t, **{"grpo.prompts": jsonl(t, "p.jsonl", [{"prompt": "1+1="}] * 4), "grpo.digits": 3}
        ),
        needle="grpo.digits",
    ),
    # ---- silent acceptances: data with no signal ----
    Case(
        "dpo-all-chosen-equal-rejected",
        "one-line",
        lambda t, m: pairs(t, "dpo", same_pairs(8)),
        needle="chosen equals rejected",
    ),
    Case(
        "dpo-all-empty",
        "one-line",
        lambda t, m: pairs(t, "dpo", [{"prompt": f"p{i}", "chosen": "", "rejected": ""} for i in range(8)]),
        needle="",
    ),
    Case(
        "dpo-most-equal",
        "warned",
        lambda t, m: pairs(t, "dpo", mixed_pairs()),
        needle="chosen equal to rejected",
    ),
    Case(
        "reward-all-chosen-equal-rejected",
        "one-line",
        lambda t, m: pairs(t, "reward", same_pairs(8)),
        needle="chosen equals rejected",
    ),
    Case(
        "reward-most-equal",
        "warned",
        lambda t, m: pairs(t, "reward", mixed_pairs()),
        needle="chosen equal to rejected",
    ),
    # ---- silent acceptances: tools ----
    Case(
        "judge-template-missing-path",
        "one-line",
        lambda t, m: grpo(t, **{"grpo.judge": m["hf"], "grpo.judge_template": str(t / "judge.jinja")}),
        needle="grpo.judge_template",
    ),
    Case(
        "convert-to-hf-into-checkpoint",
        "one-line",
        lambda t, m: ["convert", "--from", m["ckpt"], "--to-hf", os.path.join(m["ckpt"], "hf")],
        needle="--to-hf",
    ),
    Case(
        "generate-greedy-top-p",
        "warned",
        lambda t, m: [
            "generate",
            "--model",
            m["gen"],
            "hi",
            "--max-new-tokens",
            "2",
            "--temperature",
            "0",
            "--top-p",
            "0.5",
        ],
        needle="--top-p 0.5 is ignored",
    ),
    Case(
        "generate-empty-messages",
        "one-line",
        lambda t, m: ["generate", "--model", m["gen"], "--file", jsonl(t, "e.jsonl", [{"messages": []}])],
        needle="empty",
    ),
    Case(
        "generate-stop-token-past-vocab",
        "one-line",
        lambda t, m: ["generate", "--model", m["gen"], "hi", "--stop-token-id", "99999999"],
        needle="--stop-token-id",
    ),
    Case(
        "report-malformed-metrics",
        "warned",
        lambda t, m: ["report", metrics_run(t, 'not json\n{"step": \n'), "--out", t / "r"],
        needle="not a metrics record",
    ),
    Case(
        "report-out-dot-slash",
        "one-line|correct",
        lambda t, m: ["report", metrics_run(t, ""), "--out", "./"],
        check=lambda o: True,
        after=nothing_at(".png", ".html"),
    ),
    Case(
        "plan-lora-rank",
        "warned|correct",
        lambda t, m: ["plan", "--lora.rank", "16", "--gpus", "1", "--gpu", "h100"],
        needle="lora.rank 16 is not modelled",
        check=lambda o: "lora" in (o.out + o.err).lower(),
    ),
    Case("launch-master-port", "one-line", lambda t, m: launch(t, "--master-port", "99999"), needle="99999"),
    Case("launch-grace-negative", "one-line", lambda t, m: launch(t, "--grace-s", "-1"), needle="--grace-s"),
    Case(
        "launch-misspelled-field",
        "one-line",
        lambda t, m: launch(t, "--training.stepz", "3"),
        needle="training.stepz",
    ),
    Case("launch-tp3-on-4", "one-line", lambda t, m: launch(t, "--parallel.tp", "3"), needle="parallel.tp"),
    Case(
        "launch-slots-fit-no-dp",
        "one-line",
        lambda t, m: launch(t, text="a slots=3\n"),
        needle="",
    ),
    Case(
        "kubernetes-name-not-dns",
        "one-line",
        lambda t, m: [*K8S, "--name", "My_Job", "--dry-run"],
        needle="DNS-1123",
    ),
    Case(
        "slurm-time-forever",
        "one-line",
        lambda t, m: [*SLURM, "--time", "forever", "--dry-run"],
        needle="--time",
    ),
    # ---- silent acceptances: a full disk names the path and bytes and leaves nothing partial ----
    Case(
        "disk-full-run-dir",
        "one-line",
        lambda t, m: (
            train(t, **{"checkpoint.at_end": "true", "training.steps": 1, "data.cache_dir": str(m["cache"])}),
            {"fsize": FULL},
        ),
        needle="run",
        after=no_partial_under("run"),
    ),
    Case(
        "disk-full-dpo-reference",
        "one-line",
        lambda t, m: (
            pairs(
                t,
                "dpo",
                DPO_PAIRS,
                **{"data.cache_dir": warm_pairs(t, m["cache"])},
            ),
            {"fsize": 6000},  # more than config.toml (~4 KB), less than 2,000 pairs' reference log-probs
        ),
        needle="reference",
        after=no_partial_under("run"),
    ),
    Case(
        "disk-full-token-cache",
        "one-line",
        lambda t, m: (train(t, **{"training.steps": 1}), {"fsize": FULL}),
        needle="cache",
        after=no_partial_under("cache"),
    ),
    Case(
        "disk-full-data-prepare",
        "one-line",
        lambda t, m: (["data", "prepare", "--source", "", "--output", t / "tok.bin"], {"fsize": FULL}),
        needle="tok.bin",
        after=nothing_at("tok.bin", "tok.bin.json"),
    ),
    Case(
        "disk-full-generate-output",
        "one-line",
        lambda t, m: (
            [
                "generate",
                "--model",
                m["gen"],
                "hi",
                "there",
                "--max-new-tokens",
                "64",
                "--output",
                t / "o.jsonl",
            ],
            {"fsize": 16},
        ),
        needle="o.jsonl",
        after=nothing_at("o.jsonl"),
    ),
]


@pytest.fixture(scope="module")
def lora_ckpt(models, tmp_path_factory):
    """A LoRA run's checkpoint, for ``convert --to-peft``."""
    from loom.config import build_config
    from loom.train.trainer import Trainer
    from tests.tiny import tiny_overrides

    tmp = tmp_path_factory.mktemp("hostile_lora")
    over = tiny_overrides(
        tmp / "run",
        tmp / "cache",
        **{
            "training.steps": 1,
            "checkpoint.at_end": "true",
            "lora.rank": 4,
            "model.init_from": models["hf"],
        },
    )
    Trainer(build_config(None, {k: str(v) for k, v in over.items()})).fit()
    return str(tmp / "run" / "checkpoints" / "step_00000001")


def classes_file(factory) -> str:
    """One file for the whole session (shared by pytest-xdist's workers): a line per case, its id, expected and
    found class."""
    base = factory.getbasetemp()
    return str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "hostile_classes.txt")


@pytest.fixture(scope="module", autouse=True)
def _summary(tmp_path_factory):
    """At the end, the count per class over every case run so far in the session (the last worker's print is the
    whole sweep's; under -n, pass -s to see it, or read the file it names)."""
    yield
    path = classes_file(tmp_path_factory)
    found = (
        collections.Counter(line.split("\t")[0].split()[-1] for line in open(path))
        if os.path.exists(path)
        else COUNTS
    )
    print(
        f"\nissue 49 hostile inputs, by class ({path}): "
        + ", ".join(f"{k} {v}" for k, v in sorted(found.items()))
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(case, models, tmp_path, tmp_path_factory, request):
    if case.xfail:
        request.applymarker(pytest.mark.xfail(reason=case.xfail, strict=True))
    m = dict(models)
    m.setdefault("cache", tmp_path.parent / "shared_cache")  # the default corpus tokenized once for the sweep
    built = case.build(tmp_path, m)
    argv, options = built if isinstance(built, tuple) else (built, {})
    if "LORA_CKPT" in argv:
        argv = [request.getfixturevalue("lora_ckpt") if a == "LORA_CKPT" else a for a in argv]
    if options.get("fsize") and case.id in ("disk-full-run-dir",):
        warm_cache(m["cache"])
    outcome = loom(tmp_path, argv, **options)
    got = classify(outcome, case.needle if "warned" in case.expect else None, case.check)
    COUNTS[got] += 1
    with open(classes_file(tmp_path_factory), "a") as fh:
        said = (outcome.lines() or [""])[0][:300] if got != "warned" else case.needle
        fh.write(f"{case.id} {case.expect} {got}\t{said}\n")
    left = case.after(tmp_path) if case.after else None
    detail = f"{case.id}: {got} (exit {outcome.code})\nstdout: {outcome.out[-1500:]}\nstderr: {outcome.err[-3000:]}"
    assert got in case.expect.split("|"), detail
    if got == "one-line" and case.needle:
        assert case.needle in outcome.lines()[0], detail
    assert left is None, f"{case.id}: {left}"


DPO_PAIRS = [{"prompt": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(2000)]


def warm_pairs(tmp, cache) -> str:
    """The DPO pairs' token file written before the file size limit applies (so the reference write is what fails)."""
    from loom.config.sections import DataConfig
    from loom.data import prepare_data
    from loom.data.tokenizers import ByteTokenizer

    jsonl(tmp, "pairs.jsonl", DPO_PAIRS)
    cache = str(tmp / "pairs_cache")
    prepare_data(DataConfig(source=str(tmp / "pairs.jsonl")), ByteTokenizer(), cache, "dpo")
    return cache


def warm_cache(cache) -> None:
    """The token cache the disk-full cases share, written before the file size limit applies."""
    if os.path.isdir(cache) and os.listdir(cache):
        return
    from loom.data import prepare_data
    from loom.data.tokenizers import ByteTokenizer
    from tests.tiny import tiny_config

    cfg = tiny_config(None, cache)
    prepare_data(cfg.data, ByteTokenizer(), str(cache), "lm")

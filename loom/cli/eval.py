"""``loom eval``: perplexity and bits per byte of a checkpoint on a data source, and lm-evaluation-harness tasks."""

from __future__ import annotations

import json
import math
import os
import sys

from loom.config.errors import ConfigError

USAGE = """usage: loom eval CHECKPOINT --source SPEC [--text-field NAME] [--encoding-errors strict|replace] [--limit N]
       loom eval CHECKPOINT --tasks T1,T2 [--include-path DIR] [--limit N] [--num-fewshot K]
                 [--gen-kwargs K=V,...] [--log-samples]
       common: [--device auto|cpu|cuda] [--dtype auto|float32|bfloat16|float16] [--batch-size N]
               [--max-length N] [--prefix-token-id ID] [--out FILE.json]

CHECKPOINT is a loom checkpoint (a run's step_N, or a run dir: its newest complete checkpoint; an import of
`loom convert --from-hf`) or a Hugging Face Llama-family folder with its tokenizer. Both --source and --tasks may be
given.

--source            perplexity and bits per byte of each document of SPEC (the data.source grammar: text, jsonl,
                    parquet, a saved dataset, a token file, a mixture scored entry by entry; '' = the embedded
                    default). Bits per byte = NLL in bits / UTF-8 bytes of the documents' text; a token file has
                    no text, so no bits per byte (docs/eval.md)
--tasks             lm-evaluation-harness tasks (needs lm-eval: pip install 'loom-train[eval]'), run through the
                    harness backend `loom`; every option of lm-eval's own command line:
                    python -m loom.eval.harness --model loom --model_args checkpoint=PATH ...
--include-path      a folder of task YAML files (your own tasks)
--limit             --source: the first N documents of each entry; --tasks: N examples per task (below 1: that
                    fraction)
--num-fewshot       examples in each prompt (default: the task's own)
--gen-kwargs        generation settings for generate_until tasks, lm-eval's K=V,... (temperature=0.7,top_p=0.9)
--log-samples       keep every example's prompt and answer in --out
--device            auto (a GPU where there is one) | cpu | cuda
--dtype             auto (bfloat16 on a GPU, float32 on the CPU) | float32 | bfloat16 | float16
--batch-size        windows (or requests) per forward, longest first (default 8)
--max-length        longest input in tokens; 0 = a run's training.seq_len, else the folder's
                    max_position_embeddings
--prefix-token-id   the token before a document / an empty context (default: EOS for a run's checkpoint, which
                    trained on EOS-separated documents; else BOS, or EOS where there is none)
--out               write the results as JSON"""

OPTIONS = {
    "--checkpoint": "checkpoint",
    "--source": "source",
    "--text-field": "text_field",
    "--encoding-errors": "encoding_errors",
    "--tasks": "tasks",
    "--include-path": "include_path",
    "--limit": "limit",
    "--num-fewshot": "num_fewshot",
    "--gen-kwargs": "gen_kwargs",
    "--device": "device",
    "--dtype": "dtype",
    "--batch-size": "batch_size",
    "--max-length": "max_length",
    "--prefix-token-id": "prefix_token_id",
    "--out": "out",
}
FLAGS = {"--log-samples": "log_samples"}
# the options that only one mode reads, by the option that turns it on
MODE_OPTIONS = {
    "source": ("--text-field", "--encoding-errors"),
    "tasks": ("--include-path", "--num-fewshot", "--gen-kwargs", "--log-samples"),
}


def parse_args(argv: list[str]) -> dict:
    """``--name value`` / ``--name=value``, flags, and CHECKPOINT as the first bare argument."""
    args: dict = {
        "text_field": "text",
        "encoding_errors": "strict",
        "device": "auto",
        "dtype": "auto",
        "batch_size": "8",
        "max_length": "0",
    }
    given: set[str] = set()
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in FLAGS and not eq:
            args[FLAGS[name]] = True
            given.add(FLAGS[name])
        elif not name.startswith("-") and "checkpoint" not in args:
            args["checkpoint"] = argv[i]
        elif name not in OPTIONS:
            raise ConfigError(
                argv[i],
                None,
                f"unknown option; allowed: {', '.join(sorted({*OPTIONS, *FLAGS}))} (see `loom eval --help`)",
                show_value=False,
            )
        else:
            if not eq:
                if i + 1 >= len(argv) or (argv[i + 1].startswith("--") and name != "--source"):
                    raise ConfigError(name, None, "missing value after the option", show_value=False)
                value, i = argv[i + 1], i + 1
            args[OPTIONS[name]] = value
            given.add(OPTIONS[name])
        i += 1
    if "checkpoint" not in args:
        raise ConfigError(
            "CHECKPOINT",
            None,
            "required: a loom checkpoint or Hugging Face folder (see `loom eval --help`)",
            show_value=False,
        )
    if "source" not in args and "tasks" not in args:
        raise ConfigError(
            "loom eval",
            args["checkpoint"],
            "nothing to evaluate: give --source SPEC and/or --tasks T1,T2 (see `loom eval --help`)",
        )
    # an option of the other mode would do nothing: refused, not silently ignored
    for needs, names in MODE_OPTIONS.items():
        if needs not in args:
            for name in names:
                if OPTIONS.get(name, FLAGS.get(name)) in given:
                    raise ConfigError(
                        name,
                        None,
                        f"applies to --{needs} only, and there is no --{needs}: give --{needs} or leave {name} out",
                        show_value=False,
                    )
    for name in ("batch_size", "max_length"):
        args[name] = _count(f"--{name.replace('_', '-')}", args[name], 1 if name == "batch_size" else 0)
    if "num_fewshot" in args:
        args["num_fewshot"] = _count("--num-fewshot", args["num_fewshot"], 0)
    if "prefix_token_id" in args:
        args["prefix_token_id"] = _count("--prefix-token-id", args["prefix_token_id"], 0)
    if "limit" in args:
        args["limit"] = _limit(args["limit"], "tasks" in args and "source" not in args)
    if "gen_kwargs" in args:
        from loom.eval.generate import parse_gen_kwargs

        args["gen_kwargs"] = parse_gen_kwargs(args["gen_kwargs"])
    return args


def _count(name: str, value: str, lowest: int) -> int:
    try:
        out = int(value)
    except ValueError:
        raise ConfigError(name, value, "expected an integer") from None
    if out < lowest:
        raise ConfigError(name, value, f"allowed: {lowest} or more")
    return out


def _limit(value: str, fraction_allowed: bool) -> float:
    try:
        out = float(value)
    except ValueError:
        raise ConfigError("--limit", value, "expected a count") from None
    whole = out.is_integer() and out >= 1
    if not (whole or (fraction_allowed and 0 < out < 1)):
        allowed = "a count of 1 or more, or with --tasks alone a fraction in (0, 1)" if not whole else ""
        raise ConfigError("--limit", value, f"allowed: {allowed}")
    return int(out) if whole else out


def run_perplexity(em, args: dict) -> list[dict]:
    from loom.eval.perplexity import perplexity, total

    shown = sys.stderr.isatty()

    def progress(p):
        if shown:
            sys.stderr.write(f"\r{p.label}: {p.documents:,} documents, {p.tokens:,} tokens ")
            sys.stderr.flush()

    results = perplexity(
        em,
        args.get("source", ""),
        text_field=args["text_field"],
        encoding_errors=args["encoding_errors"],
        limit=int(args.get("limit", 0)),
        batch_size=args["batch_size"],
        progress=progress,
    )
    if shown:
        sys.stderr.write("\r\033[K")
    if not sum(r.tokens for r in results):
        raise ConfigError(
            "--source",
            args.get("source", ""),
            "no document with a token to score (an empty source, or "
            "only empty documents): a perplexity needs at least one",
        )
    rows = results + ([total(results)] if len(results) > 1 else [])
    for r in rows:
        print(f"loom eval: {r.line()}", flush=True)
    return [r.as_dict() for r in rows]


def run_harness(em, args: dict, manager) -> dict:
    """``--tasks`` on ``em``; ``manager``: lm-eval's TaskManager, built (and the names checked) before the model
    loads."""
    from loom.eval.harness import LoomLM, flat_metrics, run_tasks

    lm = LoomLM(model=em, batch_size=args["batch_size"], prefix_token_id=args.get("prefix_token_id"))
    results = run_tasks(
        lm,
        task_list(args),
        manager=manager,
        limit=args.get("limit"),
        num_fewshot=args.get("num_fewshot"),
        gen_kwargs=args.get("gen_kwargs"),
        log_samples=bool(args.get("log_samples")),
    )
    from lm_eval.utils import make_table

    print(make_table(results), flush=True)
    return {"metrics": flat_metrics(results), "lm_eval": _jsonable(results, bool(args.get("log_samples")))}


def task_list(args: dict) -> list[str]:
    return [t.strip() for t in args["tasks"].split(",") if t.strip()]


def _jsonable(results: dict, samples: bool) -> dict:
    keep = (
        "results",
        "groups",
        "versions",
        "n-shot",
        "higher_is_better",
        "n-samples",
        "config",
        *(("samples",) if samples else ()),
    )
    return json.loads(json.dumps({k: results[k] for k in keep if k in results}, default=str))


def _finite(obj):
    """NaN / infinity as null: standard JSON has neither."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    args = parse_args(argv)
    if "out" in args:
        from loom.config.paths import check_file_writable

        check_file_writable("--out", args["out"], "eval.json")
    if "tasks" in args:
        from loom.config.errors import require

        require("lm_eval", "eval", package="lm-eval", purpose="loom eval --tasks")
        from loom.eval.harness import task_manager

        # unknown names and task files that do not load are one line before the model loads
        manager = task_manager(task_list(args), args.get("include_path"))
    from loom.eval.model import load

    em = load(args["checkpoint"], device=args["device"], dtype=args["dtype"], max_length=args["max_length"])
    if "prefix_token_id" in args:
        vocab = em.model.args.vocab_size
        if args["prefix_token_id"] >= vocab:
            raise ConfigError(
                "--prefix-token-id",
                args["prefix_token_id"],
                f"allowed: 0 .. {vocab - 1} (the model's vocabulary)",
            )
        em.prefix_id = args["prefix_token_id"]
    print(
        f"loom eval: {em.name} on {em.device.type}, {next(em.model.parameters()).dtype}, max length "
        f"{em.max_length}, prefix token {em.prefix_id}",
        flush=True,
    )
    record: dict = {"checkpoint": em.name, "max_length": em.max_length, "prefix_token_id": em.prefix_id}
    if "source" in args:
        record["perplexity"] = run_perplexity(em, args)
    if "tasks" in args:
        record["tasks"] = run_harness(em, args, manager)
    if "out" in args:
        from loom.cli.generate import write_whole

        # its folder may not exist yet (check_file_writable allows one that can be made); written whole, so a
        # full disk leaves no partial file
        os.makedirs(os.path.dirname(os.path.abspath(args["out"])), exist_ok=True)
        write_whole("--out", args["out"], json.dumps(_finite(record), indent=1) + "\n")
        print(f"loom eval: results in {os.path.abspath(args['out'])}", flush=True)
    return 0

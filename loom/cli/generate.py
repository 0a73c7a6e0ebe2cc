"""``loom generate``: completions of prompts from a loom checkpoint, a run dir or a Hugging Face folder, streamed on a
terminal, optionally written as JSON lines; several GPUs through ``torchrun`` (tensor parallel)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from loom.config.errors import ConfigError, UserError

USAGE = """usage: loom generate --model PATH [PROMPT ...] [options]
       torchrun --nproc-per-node N -m loom generate --model PATH ...   (the model split over N GPUs)

PATH: a loom checkpoint (step_N), a run dir (its newest complete checkpoint), an import of `loom convert
--from-hf`, or a Hugging Face Llama-family folder (its tokenizer and chat template come with it).

prompts: the PROMPT arguments, else --file, else standard input; a file or stdin holds one prompt per line, or
JSON lines ({"prompt": "..."} or {"messages": [{"role": ..., "content": ...}, ...]}, rendered with the model's
chat template).
  --file FILE              prompts from FILE (.jsonl / .json lines: JSON objects; anything else: text lines)
  --chat                   each plain prompt as one user message, through the chat template
  --system TEXT            with --chat: a system message before it
  --chat-template FILE     a .jinja chat template instead of the model's own

sampling (defaults: greedy, 256 new tokens):
  --max-new-tokens N       --temperature T (0 = greedy)   --top-k K   --top-p P   --min-p P
  --repetition-penalty R   --seed N (0 .. 2**32 - 1, default 0; the same seed gives the same tokens)
  --stop TEXT              end a completion at TEXT (repeatable; the text ends before it)
  --stop-token-id ID       end a completion at this token id (repeatable)   --ignore-eos

speculative decoding:
  --prompt-lookup          guesses from n-grams of the prompt and the text so far
  --draft PATH             guesses from a smaller model with the same tokenizer
  --speculate-k K          tokens guessed per target forward (4)

output:
  --output FILE.jsonl      one JSON line per prompt (prompt, completion, token counts, finish reason)
  --stream / --no-stream   print each completion as it is generated (default: when stdout is a terminal; one
                           prompt at a time)
  --quiet                  no summary line on stderr

engine:
  --batch-size N           prompts decoded together (64)
  --device D               auto | cpu | cuda | cuda:N     --dtype auto | float32 | bfloat16 | float16
  --no-compile             no torch.compile of the blocks   --no-cuda-graphs   decode steps without CUDA graphs
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, as every loom command
        raise ConfigError("loom generate", None, f"{message} (see `loom generate --help`)", show_value=False)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="loom generate", add_help=False, allow_abbrev=False)
    p.add_argument("prompts", nargs="*")
    p.add_argument("--model", "-m")
    p.add_argument("--file")
    p.add_argument("--chat", action="store_true")
    p.add_argument("--system")
    p.add_argument("--chat-template")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--stop-token-id", type=int, action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--prompt-lookup", action="store_true")
    p.add_argument("--draft")
    p.add_argument("--speculate-k", type=int, default=4)
    p.add_argument("--output")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-cuda-graphs", action="store_true")
    return p


def parse_prompt_line(line: str, where: str):
    """One line of a prompt file: a JSON object ({"prompt"} or {"messages"}) or plain text."""
    if not line.lstrip().startswith("{"):
        return line
    try:
        obj = json.loads(line)
    except ValueError as err:
        raise ConfigError("--file", where, f"not a JSON object ({err.msg})") from None
    except RecursionError:
        raise ConfigError("--file", where, "nests JSON too deeply to read") from None
    if not isinstance(obj, dict):
        raise ConfigError("--file", where, "not a JSON object")
    if isinstance(obj.get("messages"), list):
        if not obj["messages"]:
            raise ConfigError(
                "--file", where, '"messages" is empty: a conversation needs at least one message'
            )
        return checked_conversation(obj["messages"], where)
    if isinstance(obj.get("prompt"), str):
        return obj["prompt"]
    raise ConfigError("--file", where, 'a JSON line needs "prompt" (a string) or "messages" (a list)')


def checked_conversation(messages: list, where: str) -> list[dict]:
    """``messages`` checked as training checks them (a role and a string content each; OpenAI text parts joined
    into one string, as transformers' templates render them), or one line naming ``--file`` and the line."""
    from loom.data.sft import checked_messages

    try:
        return checked_messages(messages, where, "messages", "strict")
    except ConfigError as err:  # the option's name, not the training field's
        raise ConfigError("--file", where, err.allowed) from None


def read_prompts(opts) -> list:
    """The prompts, from the arguments, --file or stdin, in order."""
    if opts.prompts and opts.file:
        raise ConfigError("--file", opts.file, "give prompts as arguments or in a file, not both")
    if opts.prompts:
        return list(opts.prompts)
    if opts.file:
        if os.path.isdir(opts.file):
            raise ConfigError("--file", opts.file, "is a folder: give a file of prompts")
        if not os.path.exists(opts.file):  # a pipe (--file <(cmd)) or /dev/stdin is read as a file is
            raise ConfigError("--file", opts.file, "file not found")
        try:
            with open(opts.file, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except UnicodeDecodeError as err:
            raise ConfigError("--file", opts.file, f"not UTF-8 text (byte {err.start})") from None
        except OSError as err:  # no permission, say: one line, not a traceback
            raise ConfigError("--file", opts.file, f"not readable ({err.strerror or err})") from None
        name = opts.file
        as_json = opts.file.endswith((".jsonl", ".json", ".ndjson"))
    else:
        if sys.stdin.isatty():
            raise ConfigError(
                "loom generate",
                None,
                "no prompts: give them as arguments, with --file, or on stdin",
                show_value=False,
            )
        lines, name, as_json = sys.stdin.read().splitlines(), "stdin", False
    prompts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if as_json and not line.lstrip().startswith("{"):
            raise ConfigError("--file", f"{name}:{i}", "not a JSON object")
        prompts.append(parse_prompt_line(line, f"{name}:{i}"))
    if not prompts:
        raise ConfigError("--file" if opts.file else "stdin", name, "holds no prompts")
    return prompts


def as_chat(prompts: list, opts) -> list:
    if opts.system and not opts.chat:
        raise ConfigError("--system", opts.system, "needs --chat")
    if not opts.chat:
        return prompts
    head = [{"role": "system", "content": opts.system}] if opts.system else []
    return [head + [{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]


def sampling_params(opts):
    from loom.config.sections import SEED_MAX
    from loom.infer import SamplingParams

    if not 0 <= opts.seed <= SEED_MAX:  # -1 is no "random seed" here: torch would take it as 2**64 - 1
        raise ConfigError(
            "--seed", opts.seed, f"allowed: 0 .. {SEED_MAX} (the same seed gives the same tokens)"
        )
    try:
        return SamplingParams(
            max_new_tokens=opts.max_new_tokens,
            temperature=opts.temperature,
            top_k=opts.top_k,
            top_p=opts.top_p,
            min_p=opts.min_p,
            repetition_penalty=opts.repetition_penalty,
            stop=tuple(opts.stop),
            stop_token_ids=tuple(opts.stop_token_id),
            ignore_eos=opts.ignore_eos,
            seed=opts.seed,
        )
    except ConfigError as err:  # the option's name, not the parameter's
        raise ConfigError("--" + err.field.replace("_", "-"), err.value, err.allowed) from None


def speculation(opts):
    from loom.infer import DraftModel, PromptLookup

    if opts.prompt_lookup and opts.draft:
        raise ConfigError("--draft", opts.draft, "choose --prompt-lookup or --draft, not both")
    if opts.prompt_lookup:
        return PromptLookup(k=opts.speculate_k)
    if opts.draft:
        return DraftModel(
            opts.draft,
            k=opts.speculate_k,
            compile=not opts.no_compile,
            cuda_graphs=False if opts.no_cuda_graphs else None,
        )
    return None


def _distributed() -> tuple[int, int]:
    """Under torchrun: the process group (NCCL on GPUs, gloo on CPUs), (rank, world); else (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), world


def _share(obj, rank: int, world: int):
    """Rank 0's ``obj`` on every rank (the prompts: only rank 0 reads stdin)."""
    if world == 1:
        return obj
    import torch.distributed as dist

    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], ConfigError):
        raise box[0]
    return box[0]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    opts = parser().parse_args(argv)
    if not opts.model:
        raise ConfigError(
            "--model", None, "missing: a loom checkpoint, run dir or Hugging Face folder", show_value=False
        )
    if opts.batch_size < 1:
        raise ConfigError("--batch-size", opts.batch_size, "an integer >= 1")
    params = sampling_params(opts)
    rank, world = _distributed()
    try:
        prompts = as_chat(read_prompts(opts), opts) if rank == 0 else None
    except ConfigError as err:
        _share(err, rank, world)
        raise
    prompts = _share(prompts, rank, world)
    if opts.output and rank == 0:
        from loom.config.paths import check_folder_writable

        if os.path.isdir(opts.output):  # before generating: the completions would be lost at the end
            raise ConfigError("--output", opts.output, "is a folder: give a file path (FILE.jsonl)")
        check_folder_writable("--output", os.path.dirname(os.path.abspath(opts.output)))
    if params.greedy and opts.top_p < 1.0 and rank == 0:
        print(
            f"loom generate: --top-p {opts.top_p:g} is ignored: --temperature 0 decodes greedily",
            file=sys.stderr,
            flush=True,
        )
    stream = sys.stdout.isatty() and not opts.output if opts.stream is None else opts.stream
    stream = _share(stream, rank, world)  # every rank makes the same calls
    from loom.infer import Generator

    gen = Generator(
        opts.model,
        device=opts.device,
        dtype=opts.dtype,
        compile=False if opts.no_compile else None,
        cuda_graphs=False if opts.no_cuda_graphs else None,
        chat_template=opts.chat_template,
        max_batch=1 if stream else opts.batch_size,
        speculative=speculation(opts),
    )
    check_against_model(gen, params)
    t0 = time.perf_counter()
    completions, stats = _run(gen, prompts, params, stream, rank == 0)
    seconds = time.perf_counter() - t0
    if rank != 0:
        return 0
    if not stream and not opts.output:
        print("\n\n".join(c.text for c in completions), flush=True)
    if opts.output:
        text = "".join(
            json.dumps(
                {
                    "prompt": prompt if isinstance(prompt, str) else None,
                    "messages": None if isinstance(prompt, str) else prompt,
                    "completion": c.text,
                    "prompt_tokens": c.prompt_tokens,
                    "completion_tokens": len(c.token_ids),
                    "finish_reason": c.finish_reason,
                },
                ensure_ascii=False,
            )
            + "\n"
            for prompt, c in zip(prompts, completions)
        )
        write_whole("--output", opts.output, text)
    if not opts.quiet:
        print(summary(stats, gen.speculative, len(prompts), seconds), file=sys.stderr, flush=True)
    return 0


def check_against_model(gen, params) -> None:
    """Options the model bounds, before anything is generated: stop ids in its vocabulary, and no more new tokens
    than its context holds (a cache for a billion tokens would be allocated first)."""
    vocab = gen.engine.vocab_size
    bad = [i for i in params.stop_token_ids if not 0 <= i < vocab]
    if bad:
        raise ConfigError("--stop-token-id", bad[0], f"allowed: 0 .. {vocab - 1} (the model's vocabulary)")
    context = getattr(getattr(gen.model, "args", None), "max_seq_len", None)
    if context and params.max_new_tokens > context:
        raise ConfigError(
            "--max-new-tokens",
            params.max_new_tokens,
            f"at most {context:,}: the model's context "
            "(max_position_embeddings or training.seq_len) holds the prompt and the new tokens",
        )


def write_whole(option: str, path: str, text: str) -> None:
    """``text`` into ``path`` whole (loom.data.token_file.write_whole: a full disk leaves no partial file), its
    folder made if it is not there yet (checked as creatable before generating: the completions are not lost); an
    error is one line that names ``option``."""
    from loom.data.token_file import write_whole as write_bytes

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_bytes(path, text.encode("utf-8"))
    except OSError as err:
        raise UserError(f"{option} {path}: its folder could not be made ({err.strerror or err})") from None
    except UserError as err:
        raise UserError(f"{option} {err}") from None


def _run(gen, prompts, params, stream: bool, show: bool):
    """(completions, their summed Stats); streaming: one prompt at a time, its text printed (``show``) as it comes."""
    if not stream:
        return gen.generate(prompts, params), gen.stats
    from loom.infer.engine import Stats

    done, stats = [], Stats()
    for i, prompt in enumerate(prompts):
        if i and show:
            print("\n", flush=True)
        on_text = (lambda _, delta: print(delta, end="", flush=True)) if show else None
        done += gen.generate([prompt], params, on_text=on_text)
        stats.add(gen.stats)
    if show:
        print(flush=True)
    return done, stats


def summary(stats, speculative, n: int, seconds: float) -> str:
    """One line: prompts, tokens, speed; with speculation the share of guesses kept and tokens per target forward."""
    line = (
        f"loom generate: {n} prompt{'s' if n != 1 else ''}, {stats.new_tokens} new tokens in {seconds:.1f} s "
        f"({stats.new_tokens / max(seconds, 1e-9):.1f} tokens/s, first tokens after {stats.prefill_seconds:.2f} s"
    )
    if speculative is not None and stats.proposed:
        line += (
            f"; speculative k {speculative.k}: {100 * stats.acceptance:.0f}% of guesses kept, "
            f"{stats.new_tokens / max(stats.target_steps + stats.prompts, 1):.2f} tokens per target forward"
        )
    return line + ")"

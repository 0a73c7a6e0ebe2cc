"""lm-eval's ``generate_until`` requests through loom's generation engine (``loom.infer.Generator``), as lm-eval's
Hugging Face backend serves them: requests grouped by their generation settings, each group's contexts sorted
longest first and batched, a context cut from the left to ``max_length - max_gen_toks`` tokens, EOS among the stop
strings, and the text cut at the first stop string."""

from __future__ import annotations

import json

from loom.config.errors import ConfigError

# lm-eval generation settings that SamplingParams has under the same name
_SAMPLING = ("top_k", "top_p", "min_p", "repetition_penalty", "seed")


# lm-eval's generation settings loom serves, and the kind of value each takes (``--gen-kwargs``)
GEN_KWARGS = {
    "until": str,
    "max_gen_toks": int,
    "do_sample": bool,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repetition_penalty": float,
    "seed": int,
}


def parse_gen_kwargs(text: str, field: str = "--gen-kwargs") -> dict:
    """``K=V,...`` (lm-eval's form) as a dict of typed values, checked before anything is loaded: each item a known
    setting with a value of its kind and range (``until`` one stop string)."""
    out: dict = {}
    for item in (i for i in text.split(",") if i.strip()):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value:
            raise ConfigError(
                field, text, f"{item.strip()!r} is not K=V: expected K=V,... (temperature=0.7,top_p=0.9)"
            )
        kind = GEN_KWARGS.get(key)
        if kind is None:
            raise ConfigError(
                field,
                text,
                f"{key!r} is not a generation setting loom knows: allowed {', '.join(GEN_KWARGS)}",
            )
        try:
            if kind is bool:
                if value.lower() not in ("true", "false"):
                    raise ValueError
                out[key] = value.lower() == "true"
            else:
                out[key] = kind(value)
        except ValueError:
            allowed = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
            raise ConfigError(field, text, f"{key} = {value!r}: allowed {allowed}") from None
    sampling = {k: v for k, v in out.items() if k not in ("until", "do_sample")}
    if "max_gen_toks" in sampling:
        sampling["max_new_tokens"] = sampling.pop("max_gen_toks")
    from loom.infer import SamplingParams

    try:
        SamplingParams(**sampling)
    except ConfigError as err:
        name = "max_gen_toks" if err.field == "max_new_tokens" else err.field
        raise ConfigError(field, text, f"{name} = {err.value!r}: allowed {err.allowed}") from None
    return out


def sampling_params(kwargs: dict, max_gen_toks: int, stop: list[str]):
    """loom's SamplingParams of one lm-eval request's normalized generation settings: greedy unless ``do_sample``
    (lm-eval's own rule: temperature 0 or no sampling is greedy); an unknown setting is one line."""
    from loom.infer import SamplingParams

    kwargs = dict(kwargs)
    do_sample = bool(kwargs.pop("do_sample", False))
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
    extra = {k: kwargs.pop(k) for k in _SAMPLING if k in kwargs}
    if kwargs:
        raise ConfigError(
            "gen_kwargs",
            ",".join(sorted(kwargs)),
            "not a generation setting loom knows: allowed "
            f"until, max_gen_toks, do_sample, temperature, {', '.join(_SAMPLING)}",
        )
    return SamplingParams(
        max_new_tokens=max_gen_toks,
        temperature=temperature if do_sample else 0.0,
        stop=tuple(s for s in stop if s),
        **extra,
    )


def generate_until(lm, requests: list[tuple[str, dict]]) -> list[str]:
    """The text each (context, gen_kwargs) request generates, in the order given. ``lm``: a ``LoomLM``."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

    if not requests:
        return []
    generator = lm.generator()
    eos_text = lm.tokenizer.token(lm.eot_token_id) if hasattr(lm.tokenizer, "token") else None
    groups: dict[str, list[int]] = {}
    for i, (_, gen_kwargs) in enumerate(requests):
        groups.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(i)
    out: list[str | None] = [None] * len(requests)
    for members in groups.values():
        kwargs = normalize_gen_kwargs(requests[members[0]][1], lm.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
        max_gen = int(kwargs.pop("max_gen_toks"))
        room = lm.max_length - max_gen
        if room < 1:
            raise ConfigError(
                "max_gen_toks",
                max_gen,
                f"leaves no room for a context in the model's max length ({lm.max_length})",
            )
        params = sampling_params(kwargs, max_gen, until)
        contexts = {
            i: lm.tok_encode(requests[i][0], left_truncate_len=room) or [lm.prefix_token_id] for i in members
        }
        ordered = sorted(members, key=lambda i: -len(contexts[i]))
        for start in range(0, len(ordered), lm.batch_size):
            batch = ordered[start : start + lm.batch_size]
            completions = generator.generate_ids([contexts[i] for i in batch], params)
            for i, completion in zip(batch, completions):
                out[i] = postprocess_generated_text(completion.text, until, None)
    return out  # type: ignore[return-value]

"""lm-eval's ``generate_until`` requests through loom's generation engine (``loom.infer.Generator``), as lm-eval's
Hugging Face backend serves them: requests grouped by their generation settings, each group's contexts sorted
longest first and batched, a context cut from the left to ``max_length - max_gen_toks`` tokens, EOS among the stop
strings, and the text cut at the first stop string."""

from __future__ import annotations

import json

from loom.config.errors import ConfigError

# lm-eval generation settings that SamplingParams has under the same name
_SAMPLING = ("top_k", "top_p", "min_p", "repetition_penalty", "seed")


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

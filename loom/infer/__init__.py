"""Inference on the plain model code: a static KV cache installed per attention layer, prefill and single-token
decode steps (CUDA graphs on CUDA), sampling, speculative decoding, tensor parallelism with the training TP plan's
weight sharding. docs/inference.md.

The Python API (what ``loom generate`` and ``loom eval``'s ``generate_until`` call)::

    from loom.infer import Generator, SamplingParams

    gen = Generator("runs/x/checkpoints/step_1000")   # a run's checkpoint or run dir, an import, an HF folder
    outs = gen.generate(["Once upon a time", [{"role": "user", "content": "Hi"}]],   # plain text or chat messages
                        SamplingParams(max_new_tokens=64, temperature=0.7, top_p=0.9, stop=("\\n\\n",), seed=0))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason     # "eos" | "stop" | "length"
    gen.generate_ids([[1, 2, 3]], SamplingParams(max_new_tokens=8))   # token ids in, same Completions out
    gen.stats                                                  # the last call's tokens, seconds, acceptance

- ``Generator(path, device="auto", dtype="auto", compile=None, cuda_graphs=None, max_batch=64, speculative=None)``:
  prompts are generated in batches of at most ``max_batch``; ``compile`` / ``cuda_graphs`` None: on for CUDA, off
  on the CPU. Under ``torch.distributed`` with several ranks the model is split over all of them (tensor parallel).
- ``Generator.from_model(model, tokenizer, ...)``: a model already built (a loom ``Llama``, plain).
- ``SamplingParams``: greedy (temperature 0, the default), temperature, top-k, top-p, min-p, repetition penalty,
  stop strings, stop token ids, EOS, max new tokens, seed (the same seed gives the same tokens).
- ``speculative=PromptLookup(k=4)`` or ``DraftModel("small/model", k=4)`` (``loom.infer.speculative``).
- ``on_text(index, delta)`` in ``generate``: streaming, called with each prompt's new text as it is decided.

Modules: ``cache`` (the per-layer cache and its interface), ``sampling``, ``engine`` (prefill, steps, graphs, the
decode loop), ``text`` (prompts, detokenizing, stop strings), ``load`` (checkpoints and folders), ``tp``,
``speculative``, ``generator``.
"""

from __future__ import annotations

__all__ = ["Completion", "DraftModel", "Generator", "PromptLookup", "SamplingParams"]


def __getattr__(name: str):
    """The API's names, imported when first used (``import loom.infer.cache`` stays light)."""
    if name in ("Generator", "Completion"):
        from loom.infer import generator

        return getattr(generator, name)
    if name == "SamplingParams":
        from loom.infer.sampling import SamplingParams

        return SamplingParams
    if name in ("PromptLookup", "DraftModel"):
        from loom.infer import speculative

        return getattr(speculative, name)
    raise AttributeError(f"module 'loom.infer' has no attribute {name!r}")

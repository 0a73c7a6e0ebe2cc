"""``Generator``: text (or token ids) in, completions out, over a loom checkpoint, a run dir, an import or a Hugging
Face folder (``loom.infer.load``), or a model already built (``Generator.from_model``). The API's summary is in
``loom.infer``'s docstring; docs/inference.md has the rest."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loom.config.errors import ConfigError
from loom.infer.engine import Engine, Stats
from loom.infer.sampling import SamplingParams
from loom.infer.text import Codec, Sequence


@dataclass
class Completion:
    """One prompt's generation. ``text``: the decoded new tokens (special tokens skipped; cut before a stop string);
    ``token_ids``: the new ids (an EOS or stop id that ended it included); ``finish_reason``: "eos" | "stop" |
    "length"; ``prompt_tokens``: the prompt's length in tokens."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int


def _tp_mesh(device: torch.device, tp: bool | None):
    """All ranks of the running process group as one tensor-parallel mesh (None: a single process)."""
    import torch.distributed as dist

    if tp is False or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    if device.type == "cuda":
        torch.cuda.set_device(device)
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))


class Generator:
    """Generation from ``path`` (a run's checkpoint or run dir, an import, a Hugging Face folder).

    ``device`` "auto": this rank's GPU, else the CPU; ``dtype`` "auto": bfloat16 on a GPU, float32 on the CPU.
    ``compile`` / ``cuda_graphs`` None: on for CUDA. ``max_batch``: prompts decoded together. ``chat_template``:
    a .jinja file in place of the model's own. ``speculative``: a ``PromptLookup`` or ``DraftModel`` used by every
    call (a call can override it). ``tp`` None: under ``torch.distributed`` with several ranks, split the model over
    all of them (every rank calls every method with the same arguments); False: never."""

    def __init__(
        self,
        path: str,
        *,
        device: str = "auto",
        dtype="auto",
        compile: bool | None = None,
        cuda_graphs: bool | None = None,
        max_batch: int = 64,
        chat_template: str | None = None,
        speculative=None,
        tp: bool | None = None,
    ):
        from loom.infer.load import load, pick_device

        mesh = _tp_mesh(pick_device(device), tp)
        loaded = load(
            path, device=device, dtype=dtype, compile=compile, tp_mesh=mesh, chat_template=chat_template
        )
        self.name, self.kind = loaded.name, loaded.kind
        self._setup(
            loaded.model,
            loaded.codec,
            loaded.eos_ids,
            compile,
            cuda_graphs,
            max_batch,
            speculative,
            mesh.get_group() if mesh is not None else None,
            pack=True,
        )  # the model is the generator's own

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        chat_template=None,
        eos_ids=None,
        prefix: tuple[int, ...] = (),
        compile: bool | None = None,
        cuda_graphs: bool | None = None,
        max_batch: int = 64,
        speculative=None,
        pack: bool = False,
        group=None,
    ) -> Generator:
        """A plain loom ``Llama`` already built and loaded (on its device, in its dtype). ``tokenizer``: a loom
        tokenizer (``loom.data.build_tokenizer``) for text prompts; ``chat_template``: a ``ChatTemplate``;
        ``eos_ids``: default the tokenizer's EOS; ``prefix``: ids before every plain prompt. ``pack``: pack the
        model's projections (``loom.infer.pack``): only for a model nothing else trains or converts meanwhile.
        ``group``: the tensor-parallel group of a model split by ``loom.infer.tp``."""
        self = cls.__new__(cls)
        self.name, self.kind = type(model).__name__, "model"
        codec = Codec(tokenizer, chat_template, prefix) if tokenizer is not None else None
        eos = (
            tuple(eos_ids) if eos_ids is not None else ((tokenizer.eos_id,) if tokenizer is not None else ())
        )
        self._setup(model, codec, eos, compile, cuda_graphs, max_batch, speculative, group, pack=pack)
        return self

    def _setup(self, model, codec, eos_ids, compile, cuda_graphs, max_batch, speculative, group, pack=False):
        if max_batch < 1:
            raise ConfigError("max_batch", max_batch, "an integer >= 1")
        self.model, self.codec, self.eos_ids = model, codec, tuple(eos_ids)
        self.engine = Engine(model, compile=compile, cuda_graphs=cuda_graphs, group=group, pack=pack)
        self.max_batch = max_batch
        self.speculative = speculative
        self.stats = Stats()

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def encode(self, prompt) -> list[int]:
        """A plain prompt or a conversation as the ids generation starts from."""
        if self.codec is None:
            raise ConfigError(
                "prompt",
                repr(prompt)[:60],
                f"{self.name} has no tokenizer.json: give token ids (generate_ids)",
            )
        return self.codec.encode(prompt)

    def generate(
        self,
        prompts,
        params: SamplingParams | None = None,
        *,
        on_text: Callable[[int, str], None] | None = None,
        speculative=None,
        **sampling,
    ) -> list[Completion]:
        """Completions of ``prompts``: one prompt (a string, or a conversation: a list of {"role", "content"}
        messages) or a list of them. ``params`` or keyword arguments of ``SamplingParams``; ``on_text(i, delta)``:
        prompt i's new text as it is decided (streaming)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)
        ):
            prompts = [prompts]
        return self.generate_ids(
            [self.encode(p) for p in prompts], params, on_text=on_text, speculative=speculative, **sampling
        )

    def generate_ids(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams | None = None,
        *,
        on_text: Callable[[int, str], None] | None = None,
        speculative=None,
        **sampling,
    ) -> list[Completion]:
        """Completions of prompts given as token ids (the text decoded where there is a tokenizer)."""
        params = params.with_(**sampling) if params is not None else SamplingParams(**sampling)
        spec = self.speculative if speculative is None else (speculative or None)
        vocab = self.engine.vocab_size
        for ids in prompt_ids:
            bad = [i for i in ids if not 0 <= int(i) < vocab]
            if bad:
                raise ConfigError("prompt", bad[0], f"token ids must be in [0, {vocab})")
        self.stats = Stats()
        out: list[Completion] = []
        for start in range(0, len(prompt_ids), self.max_batch):
            chunk = [list(map(int, p)) for p in prompt_ids[start : start + self.max_batch]]
            seqs = [
                Sequence(
                    params,
                    self.eos_ids,
                    self.codec,
                    None if on_text is None else (lambda d, i=start + j: on_text(i, d)),
                )
                for j in range(len(chunk))
            ]
            chunk_params = (
                params if params.seed is None or start == 0 else params.with_(seed=params.seed + start)
            )
            if spec is not None:
                stats = spec.run(self.engine, chunk, chunk_params, seqs)
            else:
                stats = self.engine.generate(chunk, chunk_params, seqs)
            self.stats.add(stats)
            out += [Completion(s.text, s.token_ids, s.finish_reason, len(p)) for s, p in zip(seqs, chunk)]
        return out

    def close(self) -> None:
        """Free the caches and graphs (the model stays loaded)."""
        self.engine.release()

    def __repr__(self) -> str:
        return f"Generator({os.path.basename(self.name) or self.name}, device={self.device})"

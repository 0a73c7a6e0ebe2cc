"""The embedded GRPO task (nothing downloaded): arithmetic problems generated on the fly from a seed, e.g. "12+7="
with answer "19", and their exact-answer rewards. The same generator gives the worked examples of the supervised
warm-up ("12+7=19" and the EOS), so a model that has never seen the format learns it before GRPO starts."""

from __future__ import annotations

import random

OPS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}


class ArithmeticTask:
    """Problems ``a<op>b=`` with operands of 1..``digits`` digits and ``ops`` drawn from "+*". ``problems(n, key)``
    is a pure function of (seed, key): a run's step k on data-parallel rank r always gets the same problems."""

    def __init__(self, seed: int = 0, digits: int = 1, ops: str = "+"):
        if digits < 1 or not ops or any(o not in OPS for o in ops):
            raise ValueError(f"ArithmeticTask: digits {digits} (>= 1), ops {ops!r} (a subset of '+*')")
        self.seed, self.digits, self.ops = seed, digits, ops

    def problems(self, n: int, key: tuple = ()) -> list[dict]:
        """``n`` rows {"prompt": "a+b=", "answer": "c"}."""
        rng = random.Random(repr((self.seed, self.digits, self.ops, key)))
        top = 10**self.digits - 1
        rows = []
        for _ in range(n):
            a, b, op = rng.randint(0, top), rng.randint(0, top), rng.choice(self.ops)
            rows.append({"prompt": f"{a}{op}{b}=", "answer": str(OPS[op](a, b))})
        return rows

    def describe(self) -> str:
        return f"arithmetic ({'/'.join(self.ops)} on 1-{self.digits} digit operands, generated from seed {self.seed})"


def _answer_of(completion: str) -> str:
    """The completion up to its first line break, stripped (what the model answered)."""
    return completion.split("\n", 1)[0].strip()


def exact_answer(prompts: list[str], completions: list[str], answer: list[str], **fields) -> list[float]:
    """1.0 where the completion is exactly the answer (up to a line break and surrounding spaces), else 0.0."""
    return [float(_answer_of(c) == a) for c, a in zip(completions, answer)]


def digit_match(prompts: list[str], completions: list[str], answer: list[str], **fields) -> list[float]:
    """Partial credit in [0, 1]: the share of the answer's digits right in place, counted from the last digit
    (units first, as a sum is carried), less the share of extra characters; a shaped signal for small models."""
    out = []
    for c, a in zip(completions, answer):
        got = _answer_of(c)
        right = sum(x == y for x, y in zip(reversed(got), reversed(a)))
        out.append(max(0.0, (right - max(0, len(got) - len(a))) / len(a)))
    return out


def greedy_accuracy(ctx) -> dict[str, float]:
    """A ``training.eval_hook``: exact-match accuracy of greedy answers on a fixed set of 200 of the run's task's
    problems (grpo.digits / grpo.ops from the run's config.toml; drawn from a seed of their own: single-digit sums
    are only 100 problems, which training sees too), on the live model through loom's engine: eval/accuracy."""
    import os
    import tomllib

    from loom.infer.generator import Generator
    from loom.infer.sampling import SamplingParams

    with open(os.path.join(ctx.run_dir, "config.toml"), "rb") as fh:
        cfg = tomllib.load(fh)
    grpo = cfg.get("grpo", {})
    task = ArithmeticTask(seed=-1, digits=int(grpo.get("digits", 1)), ops=grpo.get("ops", "+"))
    rows = task.problems(200, ("held-out",))
    from loom.rl.sync import whole_model

    model = whole_model(ctx.model)  # under FSDP2 a gathered copy: the engine needs whole weights
    training = model.training  # the engine sets eval mode: in one process on the live policy, which trains on
    gen = Generator.from_model(model, ctx.tokenizer, compile=False, max_batch=200)
    try:
        outs = gen.generate_ids(
            [ctx.tokenizer.encode(r["prompt"]) for r in rows],
            SamplingParams(max_new_tokens=2 * task.digits + 2),
        )
    finally:
        gen.engine.close()  # the caches and the engine's hook off the live model
        model.train(training)
    return {
        "accuracy": sum(exact_answer([], [o.text for o in outs], [r["answer"] for r in rows])) / len(rows)
    }

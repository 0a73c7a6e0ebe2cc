"""Judge rewards (loom.rl.judge) on a tiny random Hugging Face judge saved to a tmp folder: the number scoring equals
a direct generation + regex + clip, the yes/no scoring equals transformers' own next-token probabilities of the pair,
templates (str.format and Jinja2, dataset fields) render as written and a bad one is a one-line ConfigError, an
unparsable output falls back to the range's low end and is counted, and a GRPO run logs the judge beside the other
rewards (mean and std per source)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loom.config.errors import ConfigError  # noqa: E402
from loom.config.sections import GrpoConfig  # noqa: E402
from loom.rl.judge import Judge, Template  # noqa: E402

TEMPLATE = "Question: {prompt}\nAnswer: {completion}\nExpected: {answer}\nScore:"
ROWS = (
    ["2+2=", "Paris is", "def add("],
    ["4", "the capital", "return a + b"],
    {"answer": ["4", "Paris", "a+b"]},
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.unit.test_chat import build_folder
    from tests.unit.test_generate import EOS, random_hf_llama

    path = tmp_path_factory.mktemp("judge") / "hf"
    build_folder(path, "llama3")
    model = random_hf_llama(seed=1)
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory):
    """A judge that writes only the digits 7 and 3 (its head: +v for '7', -v for '3', 0 for every other token), which
    of them at each position decided by its random weights."""
    from tokenizers import Tokenizer

    from tests.unit.test_chat import build_folder
    from tests.unit.test_generate import random_hf_llama

    path = tmp_path_factory.mktemp("judge") / "digits"
    build_folder(path, "llama3")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    model = random_hf_llama(seed=6)  # its first digits differ between the test's prompts
    with torch.no_grad():
        v = model.lm_head.weight[1].clone()
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.token_to_id("7")] = 10 * v
        model.lm_head.weight[tok.token_to_id("3")] = -10 * v
    model.save_pretrained(path)
    return str(path)


def section(folder: str, **kw) -> SimpleNamespace:
    return SimpleNamespace(**{**vars(GrpoConfig()), "judge": folder, "judge_template": TEMPLATE, **kw})


def test_number_scores_equal_a_direct_generation(folder, digits_folder):
    from loom.infer.generator import Generator

    path = digits_folder
    pattern = r"(\d+)|([a-z])"  # two groups: refused for the number scoring
    with pytest.raises(ConfigError, match="grpo.judge_pattern"):
        Judge(section(path, judge_pattern=pattern))
    judge = Judge(section(path, judge_pattern=r"(\d)", judge_range="0,5", judge_max_new_tokens=4))
    scores = judge(*ROWS[:2], completion_ids=None, **ROWS[2])
    texts = [
        TEMPLATE.format(prompt=p, completion=c, answer=a) for p, c, a in zip(*ROWS[:2], ROWS[2]["answer"])
    ]
    outs = Generator(path, compile=False, tp=False).generate(texts, max_new_tokens=4, temperature=0.0)
    assert all(re.fullmatch("[73]{4}", o.text) for o in outs), [o.text for o in outs]
    assert scores == [min(float(o.text[0]), 5.0) for o in outs] and set(scores) == {
        3.0,
        5.0,
    }  # 7 clipped to 5
    assert judge.unparsed == 0.0
    mute = Judge(section(path, judge_pattern=r"Score: (\d)"))  # never in its output: the fallback, counted
    assert mute(*ROWS[:2], **ROWS[2]) == [0.0, 0.0, 0.0] and mute.unparsed == 1.0
    # the parse rule itself, on outputs a trained judge would write
    assert [judge.parse(t) for t in ("7/10", "score 2", "x", "3.5")] == [5.0, 2.0, None, 3.0]
    wide = Judge(section(path, judge_range="-1,10"))  # the default pattern: signed decimals
    assert [wide.parse(t) for t in ("Score: 7.5.", "-3", "15 of 10", "none")] == [7.5, -1.0, 10.0, None]


def test_yes_no_equals_the_pair_probability(folder):
    path, hf = folder
    judge = Judge(section(path, judge_score="yes_no", judge_tokens="Y,N", judge_range="-1,1"))
    scores = judge(*ROWS[:2], **ROWS[2])
    tok = judge.generator.codec
    yes, no = judge.token_ids
    assert tok.tokenizer.token(yes) == "Y" and tok.tokenizer.token(no) == "N"
    expected = []
    for p, c, a in zip(*ROWS[:2], ROWS[2]["answer"]):
        ids = torch.tensor([tok.encode(TEMPLATE.format(prompt=p, completion=c, answer=a))])
        with torch.no_grad():
            last = hf(ids).logits[0, -1].float()  # transformers' own forward of the judge folder
        expected.append(-1 + 2 * torch.softmax(last[[yes, no]], dim=0)[0].item())
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="grpo.judge_tokens"):
        Judge(section(path, judge_score="yes_no", judge_tokens="Paris and more,No")).load()


def test_templates(tmp_path, folder):
    path, _ = folder
    assert Template("{prompt} -> {completion}").render(prompt="a", completion="b") == "a -> b"
    jinja = tmp_path / "judge.jinja"
    jinja.write_text("{{ prompt }}|{{ completion | upper }}|{{ answer }}")
    assert Template(str(jinja)).render(prompt="a", completion="b", answer="c") == "a|B|c"
    for bad, match in (
        ("{prompt} {unknown}", "no 'unknown'"),
        ("{{ prompt }} {{ unknown }}", "unknown"),
        ("{{ prompt ", "parses"),
        ("{0}", "named fields"),
        ("{prompt", "str.format"),
        ("", "template"),
    ):
        with pytest.raises(ConfigError, match="grpo.judge_template") as err:
            Judge(section(path, judge_template=bad))(["p"], ["c"])
        assert match in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="grpo.judge_range"):
        Judge(section(path, judge_range="10,0"))


def test_config_rules(tmp_path):
    from loom.methods import check_config
    from tests.unit.test_grpo_train import grpo_config

    with pytest.raises(ConfigError, match="grpo.judge_template"):
        check_config(grpo_config(tmp_path, **{"grpo.judge": "some/judge"}))
    with pytest.raises(ConfigError, match="grpo.judge_weight"):
        check_config(grpo_config(tmp_path, **{"grpo.judge_weight": 2.0}))  # no judge
    with pytest.raises(ConfigError, match="grpo.judge_score"):
        check_config(
            grpo_config(
                tmp_path,
                **{"grpo.judge": "j", "grpo.judge_template": "{prompt}", "grpo.judge_score": "stars"},
            )
        )


@pytest.mark.parametrize("objective", ["grpo", "ppo"])
def test_rollouts_log_the_judge_beside_the_rewards(tmp_path, folder, objective):
    """GRPO and PPO (the same [grpo] reward fields): the judge is a weighted source; each source's mean and std."""
    from loom.methods.grpo import GroupRelative
    from loom.methods.ppo import ProximalPolicy
    from loom.train.trainer import Trainer
    from tests.unit.test_grpo_train import grpo_config

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(5))
    )
    cfg = grpo_config(
        tmp_path,
        **{
            "training.objective": objective,
            "grpo.prompts": str(prompts),
            "grpo.warmup_steps": 0,
            "training.steps": 1,
            "grpo.rewards": "loom.rl.arithmetic:exact_answer",
            "grpo.judge": folder[0],
            "grpo.judge_template": TEMPLATE,
            "grpo.judge_score": "yes_no",
            "grpo.judge_tokens": "Y,N",
            "grpo.judge_weight": 0.5,
        },
    )
    trainer = Trainer(cfg, objective=(GroupRelative if objective == "grpo" else ProximalPolicy)(cfg))
    (record,) = trainer.fit()
    names = ("exact_answer", "judge")
    assert {f"rewards/{n}{s}" for n in names for s in ("", "_std")} <= record.keys()
    assert 0 < record["rewards/judge"] < 10 and record["rewards/judge_std"] > 0  # P(Y) on [0, 10], varying
    assert abs(record["reward"] - record["rewards/exact_answer"] - 0.5 * record["rewards/judge"]) < 1e-5

"""Issue 49, in one process: what a resume, a cache or a template could lose or get wrong. The KL reference of PPO
and GRPO comes back from the checkpoint lineage (the resumed steps are bitwise the uninterrupted run's); DPO's
cached reference is keyed by the initial weights' content; a chat template that drops a message's content, or
whose assistant mask misses the reply, is refused; message contents are strings or OpenAI text parts."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from loom.config.errors import ConfigError
from tests.tiny import tiny_overrides

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---- the KL reference of PPO and GRPO on a resume ---------------------------------------------------------------


def rl_run(run_dir, objective: str, steps: int, **extra) -> list[dict]:
    from loom.config import build_config
    from loom.train.trainer import Trainer

    over = tiny_overrides(
        str(run_dir),
        None,
        **{
            "training.objective": objective,
            "training.steps": steps,
            "training.global_batch_size": 8,
            "training.micro_batch_size": 4,
            "grpo.group_size": 4,
            "grpo.max_new_tokens": 4,
            "grpo.warmup_steps": 1,
            "metrics.progress": "false",
            "run.deterministic": "true",
            "checkpoint.every": 3,
            "checkpoint.keep": 0,
            **extra,
        },
    )
    cfg = build_config(None, {k: str(v) for k, v in over.items()})
    from loom.methods.grpo import GroupRelative
    from loom.methods.ppo import ProximalPolicy

    return Trainer(cfg, objective=(ProximalPolicy if objective == "ppo" else GroupRelative)(cfg)).fit()


@pytest.mark.parametrize(
    "objective,kl", [("ppo", {"ppo.kl_coef": 0.05, "ppo.epochs": 2}), ("grpo", {"grpo.beta": 0.5})]
)
def test_a_resume_with_the_kl_term_on_is_bitwise(tmp_path, objective, kl):
    """Saved at step 3 (after the reference was taken at step 2), resumed: steps 4-5 equal the uninterrupted run's
    bitwise; the reference is read back from the lineage, not taken from the resumed policy."""
    whole = rl_run(tmp_path / "whole", objective, 5, **kl)
    shutil.copytree(tmp_path / "whole", tmp_path / "part", ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(tmp_path / "part" / "checkpoints" / "step_00000005", ignore_errors=True)
    resumed = rl_run(tmp_path / "part", objective, 5, **kl)
    assert [r["step"] for r in resumed] == [4, 5]
    keys = ("loss", "grad_norm", "reward")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole[3:]]


# ---- DPO's cached reference ---------------------------------------------------------------------------------------


def export_tiny(folder, seed: int) -> str:
    from loom.checkpoint.hf.export import export_hf
    from loom.models.llama import FLAVORS, Llama

    args = FLAVORS["debug"].with_(vocab_size=384, n_layers=1)
    torch.manual_seed(seed)
    shutil.rmtree(folder, ignore_errors=True)
    export_hf(Llama(args).state_dict(), args, str(folder))
    return str(folder)


def test_dpo_cached_reference_is_keyed_by_the_weights_content(tmp_path, capsys):
    """Another model exported to the same init_from folder is another reference: step 1's loss is ln 2 (the policy
    is its own reference), not the old reference's; the same weights again reuse the cache with one printed line."""
    from loom.config import build_config
    from loom.train.trainer import Trainer

    words = "the cat sat on a warm mat while two dogs ran past".split()
    source = tmp_path / "pairs.jsonl"
    source.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": " ".join(words[i % 5 : i % 5 + 3]),
                    "chosen": words[i % 12],
                    "rejected": words[(i + 5) % 12] + " no",
                }
            )
            + "\n"
            for i in range(16)
        )
    )
    hf = tmp_path / "sft_export"

    def dpo(seed: int) -> float:
        export_tiny(hf, seed)
        over = tiny_overrides(
            tmp_path / "run",
            tmp_path / "cache",
            **{
                "training.objective": "dpo",
                "training.steps": 1,
                "training.seq_len": 64,
                "data.source": str(source),
                "model.init_from": str(hf),
                "data.val_fraction": 0.0,
                "metrics.progress": "false",
                "optimizer.warmup_steps": 0,
            },
        )
        return Trainer(build_config(None, {k: str(v) for k, v in over.items()})).fit()[0]["loss"]

    assert dpo(0) == pytest.approx(0.693147, abs=1e-5)
    assert "dpo.reference cached: reusing" not in capsys.readouterr().out
    assert dpo(1) == pytest.approx(0.693147, abs=1e-5)  # a stale reference gives another loss
    assert "dpo.reference cached: reusing" not in capsys.readouterr().out
    assert dpo(1) == pytest.approx(0.693147, abs=1e-5)
    out = capsys.readouterr().out
    assert sum("dpo.reference cached: reusing" in line for line in out.splitlines()) == 1
    # a damaged cache file (a crash on a filesystem that lost its tail) is computed again, said in one line
    cached = max((tmp_path / "run" / "dpo_reference").glob("reference-*.pt"), key=os.path.getmtime)
    cached.write_bytes(cached.read_bytes()[:40])
    assert dpo(1) == pytest.approx(0.693147, abs=1e-5)
    out = capsys.readouterr().out
    assert "cannot be read" in out and "computing it again" in out and "reusing" not in out, out


def test_a_full_disk_under_the_dpo_reference_names_the_path_and_bytes_and_leaves_nothing(
    tmp_path, monkeypatch, capsys
):
    """The cached reference's write fails part-way with ENOSPC at its real write (torch.save into the file): one
    line naming the file and the bytes it needs, exit 2, and neither the file nor its temporary is left."""
    import errno

    from loom.cli.main import main as loom_main
    from tests.tiny import tiny_args

    source = tmp_path / "pairs.jsonl"
    source.write_text(
        "".join(
            json.dumps({"prompt": f"q{i}", "chosen": "yes", "rejected": f"no {i}"}) + "\n" for i in range(8)
        )
    )
    opened = []

    class FullDisk:
        """The real file: the first write keeps half its bytes, then the disk is full."""

        def __init__(self, path, mode="r", *args, **kwargs):
            self.fh = open(path, mode, *args, **kwargs)
            opened.append(path)

        def write(self, data):
            self.fh.write(bytes(data)[: len(data) // 2])
            self.fh.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    monkeypatch.setattr("loom.methods.dpo.open", FullDisk, raising=False)
    argv = tiny_args(
        tmp_path / "run",
        tmp_path / "cache",
        **{
            "training.objective": "dpo",
            "training.steps": 1,
            "training.seq_len": 32,
            "data.source": str(source),
            "data.val_fraction": 0.0,
            "metrics.progress": "false",
        },
    )
    with pytest.raises(SystemExit) as exit_:
        loom_main(["train", *argv])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    folder = tmp_path / "run" / "dpo_reference"
    (tmp,) = opened
    assert tmp.startswith(str(folder / "reference-")) and tmp.endswith(".pt.tmp"), opened
    assert exit_.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(
        f"loom: error: dpo.reference cached: writing {tmp.removesuffix('.tmp')} failed ("
    )
    assert (
        "No space left on device" in err[0] and "it needs about 64 bytes; nothing partial was kept" in err[0]
    )
    assert os.listdir(folder) == []


# ---- the chat-template probe and message contents -------------------------------------------------------------------

TEMPLATES = {
    "m.text typo": (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.text }}{% if m.role == 'assistant' %}{{ eos_token }}"
        "{% endif %}\n{% endfor %}",
        "message 1's content (role user)",
    ),
    "roles only": ("{% for m in messages %}<|{{ m['role'] }}|>\n{% endfor %}", "message 1's content"),
    "no assistant": (
        "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}{% endfor %}",
        "message 2's content (role assistant)",
    ),
    "mask misses the reply": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ eos_token }}"
        "{% endgeneration %}{{ m.content }}{% else %}{{ m.content }}{% endif %}{% endfor %}",
        "the assistant mask does not cover",
    ),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_template_that_drops_content_is_refused_naming_it(tmp_path, name):
    from loom.data.chat import load_template
    from loom.data.tokenizers import ByteTokenizer

    source, expected = TEMPLATES[name]
    path = tmp_path / "t.jinja"
    path.write_text(source)
    with pytest.raises(ConfigError) as caught:
        load_template(str(path), ByteTokenizer())
    message = str(caught.value)
    assert message.startswith(f"data.chat_template = {str(path)!r}") and expected in message, message


def test_good_templates_pass_the_probe(tmp_path):
    """The built-in template, one that refuses a system message, and one with generation blocks; one that leaves
    system messages out is a warning."""
    from loom.data.chat import load_template
    from loom.data.tokenizers import ByteTokenizer

    load_template("", ByteTokenizer())
    path = tmp_path / "t.jinja"
    path.write_text(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}"
        "{% endgeneration %}{% else %}[{{ m.content }}]{% endif %}{% endfor %}"
    )
    load_template(str(path), ByteTokenizer())
    path.write_text(
        "{% for m in messages %}{% if m.role != 'system' %}{{ m.content }}{% endif %}{% endfor %}"
    )
    with pytest.warns(UserWarning, match="leaves a system message's content out"):
        load_template(str(path), ByteTokenizer())


def test_a_non_utf8_template_is_one_line(tmp_path):
    from loom.data.chat import load_template
    from loom.data.tokenizers import ByteTokenizer

    path = tmp_path / "t.jinja"
    path.write_bytes(b"{{ messages }}\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_template(str(path), ByteTokenizer())


def test_message_content_is_a_string_or_text_parts():
    """OpenAI content parts are accepted (as one string, as templates that read parts render them); an int is one
    line naming the message."""
    from loom.data.sft import from_row

    parts = from_row(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
                },
                {"role": "assistant", "content": "Hello"},
            ]
        },
        "f.jsonl:1",
    )
    assert parts.messages[0]["content"] == "Hi there"
    with pytest.raises(
        ConfigError, match="message 1: 'content' must be a string or a list of text parts; got a int"
    ):
        from_row(
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 5}]}, "f.jsonl:1"
        )
    with pytest.raises(ConfigError, match="message 0: 'role' must be a string .*got a int"):
        from_row({"messages": [{"role": 5, "content": "x"}]}, "f.jsonl:1")  # it said the role was missing
    with pytest.raises(ConfigError, match="content parts must each be"):
        from_row(
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
            "f.jsonl:1",
        )


def test_grpo_with_exploded_weights_stops_in_one_line_before_sampling(tmp_path):
    """A huge learning rate blows the weights up in the warm-up step; the rollout of the next step would fail in the
    sampler (NaN probabilities) while the logged loss stayed 0: the run stops with one line instead."""
    from loom.config.errors import TrainingStopped

    with pytest.raises(
        TrainingStopped, match="step 2: the policy's (weights|sampling logits) are not finite"
    ):
        rl_run(
            tmp_path / "run",
            "grpo",
            3,
            **{
                "optimizer.lr": 1e20,
                "optimizer.warmup_steps": 0,
                "checkpoint.every": 0,
                "grpo.lr_ratio": 1.0,
            },
        )


# ---- a branch from an older checkpoint, through `loom train` -------------------------------------------------------


@pytest.mark.slow  # the manager-level cases (test_checkpoint_manager.py) run by default
def test_loom_train_from_an_older_checkpoint_refuses_then_branches_keeping_the_newer_ones(tmp_path, capsys):
    """The issue's case: steps 2, 4, 6 saved; the same command resumed from step 2 exits 2 naming 4 and 6; with
    --checkpoint.overwrite true it trains the branch, and the original 4 and 6 are in superseded/, byte for byte."""
    from loom.checkpoint.manager import verify
    from loom.cli.main import main as loom_main
    from tests.tiny import tiny_args

    run = tmp_path / "run"
    args = tiny_args(
        run,
        tmp_path / "cache",
        **{"training.steps": 6, "checkpoint.every": 2, "checkpoint.keep": 0, "run.seed": 3},
    )
    assert loom_main(["train", *args]) == 0
    ckpts = run / "checkpoints"
    before = {s: verify(str(ckpts / f"step_0000000{s}"))["files"] for s in (4, 6)}
    capsys.readouterr()
    step2 = str(ckpts / "step_00000002")
    with pytest.raises(SystemExit) as stop:
        loom_main(["train", *args, "--checkpoint.resume", step2])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert (
        stop.value.code == 2
        and len(err) == 1
        and "step 4, 6" in err[0]
        and "--checkpoint.overwrite" in err[0]
    )
    assert {s: verify(str(ckpts / f"step_0000000{s}"))["files"] for s in (4, 6)} == before
    assert loom_main(["train", *args, "--checkpoint.resume", step2, "--checkpoint.overwrite", "true"]) == 0
    (aside,) = os.listdir(ckpts / "superseded")
    assert {
        s: verify(str(ckpts / "superseded" / aside / f"step_0000000{s}"))["files"] for s in (4, 6)
    } == before
    assert sorted(os.listdir(ckpts / "superseded" / aside)) == ["step_00000004", "step_00000006"]

"""The documented chains of stages run as docs/finetuning.md writes them ("Chaining stages"): pretrain -> SFT ->
DPO -> GRPO / PPO, and SFT -> LoRA -> merged -> DPO, each stage started from the previous one's `loom convert
--to-hf` export, at a few steps each (the only change to the documented lines: the step count and the tiny run's
sizes appended to every `loom train`, the checkpoint names following the step count)."""

from __future__ import annotations

import os
import re
import shlex

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from loom.cli.main import main as loom_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 2
SMALL = [
    "--training.steps",
    str(STEPS),
    "--training.global_batch_size",
    "8",
    "--training.micro_batch_size",
    "8",
    "--optimizer.warmup_steps",
    "1",
    "--metrics.tensorboard",
    "false",
]


def documented_chains() -> list[list[str]]:
    """The command lines of the bash blocks under "### Chaining stages" in docs/finetuning.md, as argv lists."""
    with open(os.path.join(ROOT, "docs", "finetuning.md")) as fh:
        section = fh.read().split("### Chaining stages", 1)[1].split("\n#", 1)[0]
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                lines.append(argv)
    return lines


def test_the_docs_name_both_chains():
    cmds = [" ".join(c) for c in documented_chains()]
    objectives = [c.split("--training.objective ")[1].split()[0] for c in cmds if "--training.objective" in c]
    assert objectives == ["sft", "dpo", "grpo", "ppo", "sft", "dpo"]
    assert sum(c.startswith("loom convert") for c in cmds) == 4 and any("--lora.rank" in c for c in cmds)


@pytest.mark.slow
def test_the_documented_chains_run_as_written(tmp_path, monkeypatch):
    import transformers

    monkeypatch.chdir(tmp_path)
    for argv in documented_chains():
        assert argv[0] == "loom"
        args = [a.replace("step_00000200", f"step_{STEPS:08d}") for a in argv[1:]]
        if args[0] == "train":
            args += SMALL + ["--data.cache_dir", str(tmp_path / "cache")]
            if " ".join(args).count("objective grpo") or " ".join(args).count("objective ppo"):
                args += ["--grpo.warmup_steps", "1"]  # one supervised warm-up step, then RL
            if " ".join(args).count(
                "objective dpo"
            ):  # the reference per step, not cached over every pair first
                args += ["--dpo.reference", "copy"]
        assert loom_main(args) == 0, " ".join(argv)
        if args[0] == "convert":  # every export carries the chat template its run trained with
            out = args[args.index("--to-hf") + 1]
            tok = transformers.AutoTokenizer.from_pretrained(out)
            chat = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
            assert tok.apply_chat_template(chat, tokenize=False).endswith("2" + tok.eos_token + "\n")
    for run in ("lm", "sft", "dpo", "grpo", "ppo", "sft_lora", "dpo_merged"):
        assert os.path.isdir(tmp_path / "runs" / run / "checkpoints" / f"step_{STEPS:08d}"), run


@pytest.mark.slow
def test_the_readme_train_commands_run_in_order_in_one_folder(tmp_path, monkeypatch):
    """The README's `loom train` (its first command's last step), then its `loom train --training.objective sft`
    and `--training.objective dpo` lines, in one folder: each objective has its own default run dir."""
    with open(os.path.join(ROOT, "README.md")) as fh:
        readme = fh.read()
    first = re.findall(r"```bash\n(.*?)```", readme, re.S)[0].strip().split(" && ")[-1]
    lines = [first] + [
        ln.split("#")[0].strip()
        for ln in readme.splitlines()
        if re.match(r"loom train --training\.objective (sft|dpo) +#", ln)
    ]
    assert lines == [
        "loom train",
        "loom train --training.objective sft",
        "loom train --training.objective dpo",
    ]
    monkeypatch.chdir(tmp_path)
    for line in lines:
        extra = ["--dpo.reference", "copy"] if "dpo" in line else []
        assert loom_main(shlex.split(line)[1:] + SMALL + extra) == 0, line
    assert sorted(os.listdir(tmp_path / "runs")) == ["dpo", "lm", "sft"]

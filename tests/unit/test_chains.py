"""The documented chains of stages run as docs/finetuning.md writes them ("Chaining stages"): pretrain -> SFT ->
DPO -> GRPO / PPO, and SFT -> LoRA -> merged -> DPO, each stage started from the previous one's `loom convert
--to-hf` export, at a few steps each (the only change to the documented lines: the step count and the tiny run's
sizes appended to every `loom train`, the checkpoint names following the step count)."""

from __future__ import annotations

import json
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


# What makes a README command not runnable as written on a CPU in a fresh clone: a placeholder (`...`, an upper-case
# name such as CKPT or PATH, path/to, runs/x), an input the clone does not have, or several processes or a GPU (the
# README's GPU commands name the large recipes or CUDA graphs). An optional `[...]` group is left out.
PLACEHOLDER = re.compile(r"\.\.\.|\b[A-Z][A-Z_]+\b|path/to|runs/x")
NEEDS_GPU_OR_PROCESSES = ("--nproc-per-node", "--nnodes", "recipes/llama3_", "--training.cuda_graphs")
INPUTS = ("--config", "--source", "--tokenizer", "--from", "--from-hf", "--model.init_from", "--data.source")
INPUTS += ("--data.tokenizer", "--file", "--hostfile", "--model")


def readme_cpu_commands() -> list[str]:
    """The README's `loom` commands in the order they appear (each bash block's lines, and inline `loom train ...`
    and `loom plan ...` spans of the prose, not of its tables), once each, that run as written on a CPU in a fresh
    clone."""
    with open(os.path.join(ROOT, "README.md")) as fh:
        readme = re.sub(r"(?m)^\|.*$", "", fh.read())
    found = []
    for m in re.finditer(r"```bash\n(.*?)```|`(loom (?:train|plan|--)[^`\n]*)`", readme, re.S):
        lines = m.group(1).replace("\\\n", " ").splitlines() if m.group(1) is not None else [m.group(2)]
        for line in lines:
            for cmd in line.split(" && "):
                cmd = " ".join(re.sub(r"\[[^\]]*\]", "", cmd.split(" #")[0]).split())
                if cmd.startswith("loom ") and cmd not in found:
                    found.append(cmd)

    def runnable(cmd: str) -> bool:
        argv = shlex.split(cmd)
        missing = any(
            a in INPUTS and i + 1 < len(argv) and not os.path.exists(os.path.join(ROOT, argv[i + 1]))
            for i, a in enumerate(argv)
        )
        return not (PLACEHOLDER.search(cmd) or missing or any(m in cmd for m in NEEDS_GPU_OR_PROCESSES))

    return [c for c in found if runnable(c)]


def test_the_readme_cpu_commands_are_found():
    """The parse behind the slow test below finds the README's CPU-sized commands (and not its GPU ones)."""
    cmds = readme_cpu_commands()
    assert cmds[0] == "loom train", cmds
    trains = [c for c in cmds if c.startswith("loom train --training.objective ")]
    objectives = ("sft", "dpo", "reward", "kto", "orpo", "simpo", "grpo")
    assert trains == [f"loom train --training.objective {o}" for o in objectives], cmds
    assert any(c.startswith("loom train --model.flavor debug_moe") for c in cmds), cmds
    assert any(c.startswith("loom plan ") for c in cmds) and "loom --version" in cmds, cmds
    assert not any("--nproc-per-node" in c or "llama3_" in c or "path/to" in c for c in cmds), cmds


@pytest.mark.slow
# 3 CPU-minutes (11.7 min wall on a loaded 2-core box): the plan search, a short run of each objective
@pytest.mark.timeout(1800)
def test_the_readme_cpu_commands_run_in_order_in_one_folder(tmp_path, monkeypatch):
    """The README's CPU-sized commands (readme_cpu_commands), in the README's order, in one folder, all exit 0:
    each objective has its own default run dir, and a run of an objective already used names its own. Every
    `loom train` gets the tiny sizes appended (SMALL, one shared tokenizer cache), the plan search a smaller global
    batch; the default run ends with a validation loss."""
    monkeypatch.chdir(tmp_path)
    os.symlink(os.path.join(ROOT, "recipes"), tmp_path / "recipes")  # the clone's files, as in its root
    for cmd in readme_cpu_commands():
        args = shlex.split(cmd)[1:]
        if args[0] == "train" and "--help" not in args:
            args += SMALL + ["--data.cache_dir", str(tmp_path / "cache")]
            if "dpo" in args:  # the reference per step, not cached over every pair first
                args += ["--dpo.reference", "copy"]
            if "grpo" in args or "ppo" in args:  # one supervised warm-up step, then RL
                args += ["--grpo.warmup_steps", "1"]
        if (
            args[0] == "plan" and "--search" in args
        ):  # 171 layouts of 8 GPUs instead of 432 (2 CPU-min, not 4)
            args += ["--training.global_batch_size", "8"]
        assert loom_main(args) == 0, cmd
    runs = ["dpo", "grpo", "kto", "lm", "moe", "orpo", "reward", "sft", "simpo"]
    assert sorted(os.listdir(tmp_path / "runs")) == runs
    with open(tmp_path / "runs" / "lm" / "metrics.jsonl") as fh:
        last = [json.loads(ln) for ln in fh if ln.strip()][-1]
    assert last["step"] == STEPS and last["val_loss"] is not None

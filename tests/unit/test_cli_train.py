"""``loom train`` through the real console script: every user error is exit code 2 and exactly one line
on stderr naming the field, the value and what is allowed, found before anything is written or started.
Also: TOML < command line precedence, and the resolved config written to <run.dir>/config.toml."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from loom.cli.main import main as loom_main
from loom.config import build_config, to_toml

LOOM = os.path.join(os.path.dirname(sys.executable), "loom")
# Make Python show every warning, including the EncodingWarnings that importing torch raises: a user error
# must still be one line (the CLI holds warnings back until the config is known to be good).
NOISY = {"PYTHONWARNINGS": "always", "PYTHONWARNDEFAULTENCODING": "1"}


def loom_train(cwd, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **NOISY}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        env.pop(var, None)
    return subprocess.run(
        [LOOM, "train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


BAD_TOML = "[training\nsteps = 5\n"

# (id, arguments, substrings the one error line must contain). {tmp} is the test's folder.
CASES = [
    (
        "unknown-key",
        ["--training.stpes", "5"],
        ["training.stpes", "unknown key", "did you mean 'training.steps'?"],
    ),
    (
        "unknown-key-other-section",
        ["--training.lr", "0.1"],
        ["training.lr", "unknown key", "did you mean 'optimizer.lr'?"],
    ),
    (
        "unknown-section",
        ["--foo.bar", "1"],
        [
            "foo.bar",
            "unknown key",
            "sections are run, model, data, training, optimizer, lora, dpo, grpo, ppo, reward, parallel, checkpoint, metrics",
        ],
    ),
    (
        "unknown-section-in-toml",
        ["--config", "{tmp}/typo.toml"],
        ["optimiser.lr", "unknown key", "did you mean 'optimizer.lr'?"],
    ),
    ("wrong-type-int", ["--training.steps", "five"], ["training.steps = 'five'", "expected an integer"]),
    ("wrong-type-float", ["--optimizer.lr", "fast"], ["optimizer.lr = 'fast'", "expected a finite number"]),
    (
        "wrong-type-bool",
        ["--training.compile", "maybe"],
        ["training.compile = 'maybe'", "expected true or false"],
    ),
    ("negative-lr", ["--optimizer.lr", "-0.1"], ["optimizer.lr = -0.1", "must be >= 0.0"]),
    ("seq-len-too-small", ["--training.seq_len", "4"], ["training.seq_len = 4", "must be >= 8"]),
    ("eps-zero", ["--optimizer.eps=0"], ["optimizer.eps = 0.0", "must be > 0.0"]),
    (
        "dtype-choice",
        ["--training.dtype", "fp8"],
        ["training.dtype = 'fp8'", "allowed: float32 | bfloat16 | float16"],
    ),
    (
        "ac-choice",
        ["--training.activation_checkpointing", "half"],
        ["training.activation_checkpointing = 'half'", "allowed: none | full | every_k | op"],
    ),
    (
        "schedule-choice",
        ["--optimizer.schedule", "step"],
        ["optimizer.schedule = 'step'", "allowed: cosine | linear | wsd | constant"],
    ),
    (
        "unknown-flavor",
        ["--model.flavor", "7B"],
        [
            "model.flavor = '7B'",
            "allowed: debug | debug_moe | debug_mla | 125M | 1B | 3B | 8B | 70B | 405B | deepseek_v2_lite",
        ],
    ),
    (
        "batch-not-multiple-of-micro",
        ["--training.global_batch_size", "10", "--training.micro_batch_size", "4"],
        ["training.global_batch_size = 10", "must be a multiple of training.micro_batch_size (4)"],
    ),
    (
        "batch-not-multiple-of-micro-x-dp",
        ["--nproc-per-node", "2", "--training.global_batch_size", "12", "--training.micro_batch_size", "4"],
        ["training.global_batch_size = 12", "micro_batch_size x data-parallel size = 4 x 2 = 8"],
    ),
    (
        "degrees-vs-world-size",
        ["--nproc-per-node", "2", "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"],
        ["parallel.dp_shard = 2", "dp_replicate x dp_shard x tp x pp x cp = 4 must equal the world size 2"],
    ),
    ("etp-without-tp", ["--parallel.etp", "2"], ["parallel.etp = 2", "allowed 1", "parallel.tp = 1"]),
    (
        "ep-dense-model",
        ["--nproc-per-node", "2", "--parallel.ep", "2"],
        ["parallel.ep = 2", "needs a mixture-of-experts model"],
    ),
    ("cp-larger-than-world", ["--parallel.cp", "2"], ["parallel.cp = 2", "= 2 must divide the world size 1"]),
    (
        "cp-uneven-sequence",
        ["--nproc-per-node", "2", "--parallel.cp", "2", "--training.seq_len", "30"],
        ["parallel.cp = 2", "training.seq_len 30 must split into 2 x cp = 4 equal chunks"],
    ),
    ("tp-larger-than-world", ["--parallel.tp", "2"], ["parallel.tp = 2", "= 2 must divide the world size 1"]),
    (
        "tp-vs-kv-heads",
        ["--nproc-per-node", "4", "--parallel.tp", "4"],
        ["parallel.tp = 4", "must divide the model's KV heads (2)"],
    ),
    (
        "pp-too-few-microbatches",
        [
            "--nproc-per-node",
            "2",
            "--parallel.pp",
            "2",
            "--training.global_batch_size",
            "8",
            "--training.micro_batch_size",
            "8",
        ],
        ["training.global_batch_size = 8", "pp_schedule 1f1b needs at least pp = 2 micro-batches per step"],
    ),
    (
        "v-schedule-microbatches",
        [
            "--nproc-per-node",
            "2",
            "--parallel.pp",
            "2",
            "--parallel.pp_schedule",
            "zbv",
            "--training.global_batch_size",
            "8",
            "--training.micro_batch_size",
            "4",
            "--model.n_layers",
            "4",
        ],
        ["training.global_batch_size = 8", "needs at least 2 x pp = 4 micro-batches"],
    ),
    (
        "pp-split-sum",
        ["--nproc-per-node", "2", "--parallel.pp", "2", "--parallel.pp_layers_per_stage", "[1,2]"],
        ["parallel.pp_layers_per_stage = [1, 2]", "must add up to the model's 2 layers"],
    ),
    (
        "pp-split-length",
        ["--parallel.pp", "2", "--parallel.pp_layers_per_stage", "1,1,1"],
        [
            "parallel.pp_layers_per_stage = [1, 1, 1]",
            "one entry per pipeline stage: pp x stages per rank = 2 x 1",
        ],
    ),
    (
        "pp-too-many-stages",
        ["--nproc-per-node", "2", "--parallel.pp", "2", "--parallel.pp_schedule", "interleaved_1f1b"],
        ["parallel.pp = 2", "4 pipeline stages (2 ranks x 2) for 2 layers"],
    ),
    (
        "v-schedule-stages",
        ["--parallel.pp_schedule", "zbv", "--parallel.pp_virtual_stages", "3"],
        ["parallel.pp_virtual_stages = 3", "V-shaped: exactly 2 stages per rank"],
    ),
    (
        "zb-with-compile",
        ["--parallel.pp", "2", "--parallel.pp_schedule", "zbv", "--training.compile", "true"],
        ["parallel.pp_schedule = 'zbv'", "torch.compile does not support"],
    ),
    (
        "async-tp-without-compile",
        ["--parallel.tp", "2", "--parallel.async_tp", "true"],
        ["parallel.async_tp = True", "needs training.compile true"],
    ),
    (
        "etp-not-tp",
        ["--nproc-per-node", "2", "--parallel.tp", "2", "--parallel.etp", "4"],
        ["parallel.etp = 4", "allowed 1", "parallel.tp = 2"],
    ),
    (
        "etp-narrow-experts",
        [
            "--nproc-per-node",
            "2",
            "--model.flavor",
            "debug_moe",
            "--model.moe_ffn_dim",
            "24",
            "--parallel.tp",
            "2",
            "--parallel.etp",
            "2",
        ],
        ["parallel.etp = 2", "hidden width (24)", "multiple of 8"],
    ),
    (
        "etp-dense",
        ["--nproc-per-node", "2", "--parallel.tp", "2", "--parallel.etp", "2"],
        ["parallel.etp = 2", "needs a mixture-of-experts model"],
    ),
    ("bad-attention", ["--model.attention", "flex"], ["model.attention = 'flex'", "auto", "sdpa", "flash"]),
    (
        "pinned-sdpa-off-cuda",
        ["--model.attention", "sdpa_cudnn"],
        ["model.attention = 'sdpa_cudnn'", "needs CUDA", "allowed auto | sdpa | flash | flex"],
    ),
    (
        "fa4-off-cuda",
        ["--model.attention", "fa4"],
        ["model.attention = 'fa4'", "FlashAttention-4 needs CUDA", "allowed auto | sdpa | flash | flex"],
    ),
    (
        "fused-loss-with-tp",
        ["--parallel.tp", "2", "--model.fused_loss", "true"],
        ["model.fused_loss = True", "not supported with parallel.tp > 1"],
    ),
    (
        "fused-norm-with-tp",
        ["--parallel.tp", "2", "--model.fused_norm", "true"],
        ["model.fused_norm = True", "sequence-parallel norms"],
    ),
    (
        "float8-in-fp32",
        ["--training.float8", "tensorwise"],
        ["training.float8 = 'tensorwise'", "needs training.dtype bfloat16"],
    ),
    (
        "missing-data",
        ["--data.source", "{tmp}/corpus.jsonl"],
        ["data.source = '{tmp}/corpus.jsonl'", "no such file or folder"],
    ),
    (
        "vocab-smaller-than-tokenizer",
        ["--model.vocab_size", "100"],
        ["model.vocab_size = 100", "must be >= the tokenizer's vocabulary (259)"],
    ),
    (
        "missing-tokenizer",
        ["--data.tokenizer", "{tmp}/tok.json"],
        ["data.tokenizer = '{tmp}/tok.json'", "allowed: byte | path to a tokenizer.json"],
    ),
    ("bad-toml", ["--config", "{tmp}/bad.toml"], ["--config = '{tmp}/bad.toml'", "not valid TOML", "line 1"]),
    (
        "missing-config-file",
        ["--config", "{tmp}/nope.toml"],
        ["--config = '{tmp}/nope.toml'", "file not found"],
    ),
    (
        "missing-resume",
        ["--checkpoint.resume", "{tmp}/ckpt/step_00000005"],
        [
            "checkpoint.resume = '{tmp}/ckpt/step_00000005'",
            "allowed: none | auto | an existing checkpoint path",
        ],
    ),
    (
        "missing-value-at-end",
        ["--training.steps", "5", "--optimizer.lr"],
        ["optimizer.lr", "missing value after the option"],
    ),
    (
        "missing-value-before-option",
        ["--optimizer.lr", "--training.steps", "5"],
        ["optimizer.lr", "missing value after the option"],
    ),
    ("missing-config-value", ["--config"], ["--config", "missing value after the option"]),
    ("bad-nproc", ["--nproc-per-node", "two"], ["--nproc-per-node = 'two'", "expected a positive integer"]),
    (
        "warmup-longer-than-training",
        ["--training.steps", "5", "--optimizer.warmup_steps", "10"],
        ["optimizer.warmup_steps = 10", "must be <= training.steps (5)"],
    ),
    (
        "profile-steps-format",
        ["--metrics.profile_steps", "3"],
        ["metrics.profile_steps = '3'", "allowed: '' (off) or 'A:B', whole numbers with 1 <= A <= B"],
    ),
    (
        "profile-steps-order",
        ["--metrics.profile_steps", "3:2"],
        ["metrics.profile_steps = '3:2'", "1 <= A <= B"],
    ),
    (
        "profile-steps-past-training",
        ["--training.steps", "5", "--metrics.profile_steps", "4:6"],
        ["metrics.profile_steps = '4:6'", "the last profiled step must be <= training.steps (5)"],
    ),
    ("positional-argument", ["train.toml"], ["'train.toml'", "expected --section.field value"]),
]


# the quick loop (-m "not slow") runs one case of each kind; the default run (CI) runs them all
QUICK = {
    "unknown-key",
    "unknown-section-in-toml",
    "wrong-type-int",
    "dtype-choice",
    "batch-not-multiple-of-micro-x-dp",
    "pp-too-few-microbatches",
    "missing-data",
    "bad-toml",
    "missing-value-at-end",
    "positional-argument",
}
assert QUICK <= {c[0] for c in CASES}


@pytest.mark.parametrize(
    "args,needles",
    [pytest.param(*c[1:], id=c[0], marks=() if c[0] in QUICK else pytest.mark.slow) for c in CASES],
)
def test_user_error_is_one_line_exit_2(tmp_path, args, needles):
    (tmp_path / "bad.toml").write_text(BAD_TOML)
    (tmp_path / "typo.toml").write_text("[optimiser]\nlr = 0.1\n")
    before = set(os.listdir(tmp_path))
    tmp = str(tmp_path)
    proc = loom_train(tmp_path, *[a.replace("{tmp}", tmp) for a in args])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("loom: error: ")
    for needle in needles:
        assert needle.replace("{tmp}", tmp) in lines[0]
    assert proc.stdout == ""
    assert set(os.listdir(tmp_path)) == before  # nothing written, no run dir, no worker started


def test_help(tmp_path):
    proc = loom_train(tmp_path, "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: loom train")
    assert "config sections" in proc.stdout and proc.stderr == ""


def test_toml_then_command_line_and_resolved_config_round_trip(tmp_path, capsys):
    run_dir = tmp_path / "run"
    toml = tmp_path / "train.toml"
    toml.write_text(
        f'[run]\ndir = "{run_dir}"\nseed = 4\n'
        "[training]\nsteps = 50\nseq_len = 16\nglobal_batch_size = 4\nmicro_batch_size = 2\n"
        "[optimizer]\nlr = 0.01\nwarmup_steps = 1\n"
        f'[data]\ncache_dir = "{tmp_path / "cache"}"\n'
        "[metrics]\nevery = 1\ntensorboard = false\n[checkpoint]\nat_end = false\n"
    )
    assert loom_main(["train", "--config", str(toml), "--training.steps", "2", "--optimizer.lr=0.002"]) == 0
    written = str(run_dir / "config.toml")
    cfg = build_config(written)
    assert cfg.training.steps == 2 and cfg.optimizer.lr == 0.002  # the command line won
    assert cfg.training.seq_len == 16 and cfg.optimizer.warmup_steps == 1 and cfg.run.seed == 4  # the file
    assert cfg.optimizer.weight_decay == 0.1  # a default
    assert cfg == build_config(str(toml), {"training.steps": "2", "optimizer.lr": "0.002"})
    with open(written) as fh:
        assert fh.read() == to_toml(cfg)
    with open(run_dir / "metrics.jsonl") as fh:
        assert [json.loads(line)["step"] for line in fh] == [1, 2]
    assert "step 2/2" in capsys.readouterr().out

"""Issue 49, through the command line: a field of a feature that is off is an error (one generic rule), launch and
rendezvous options checked up front (no hang), the tools' argument checks and one-line refusals, and a launcher's
workers keeping the run dir locked until the last one exits."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from loom.cli.main import main as loom_main
from loom.config.errors import ConfigError, UserError
from tests.tiny import tiny_args, tiny_config


def cli_error(capsys, *argv: str) -> str:
    """``loom argv`` in this process, expecting a user error: its one stderr line."""
    with pytest.raises(SystemExit) as exc:
        loom_main(list(argv))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("loom: error: "), (exc.value.code, err)
    return err[0]


# ---- a set field of a feature that is off -------------------------------------------------------------------------

INACTIVE = [
    ({"lora.alpha": 32}, "lora.alpha", "lora.rank > 0"),
    ({"lora.targets": "q,v"}, "lora.targets", "lora.rank > 0"),
    ({"lora.dropout": 0.1}, "lora.dropout", "lora.rank > 0"),
    ({"lora.rslora": "true"}, "lora.rslora", "lora.rank > 0"),
    ({"parallel.diloco_outer_lr": 0.5}, "parallel.diloco_outer_lr", "parallel.diloco_inner_steps > 0"),
    ({"parallel.diloco_fragments": 2}, "parallel.diloco_fragments", "parallel.diloco_inner_steps > 0"),
    ({"training.eval_tasks_limit": 5}, "training.eval_tasks_limit", "training.eval_tasks"),
    (
        {"training.objective": "grpo", "grpo.reward_model_weight": 2.0},
        "grpo.reward_model_weight",
        "grpo.reward_model",
    ),
    (
        {"training.objective": "grpo", "grpo.prompts": "p.jsonl", "grpo.warmup_steps": 0, "grpo.digits": 3},
        "grpo.digits",
        "the embedded arithmetic task",
    ),
    ({"training.objective": "grpo", "grpo.judge_weight": 2.0}, "grpo.judge_weight", "grpo.judge"),
    ({"training.loss_scale_init": 1024}, "training.loss_scale_init", "training.dtype float16"),
    (
        {"training.nonfinite": "stop", "training.nonfinite_limit": 3},
        "training.nonfinite_limit",
        "training.nonfinite skip or rollback",
    ),
    ({"checkpoint.overwrite": "true"}, "checkpoint.overwrite", "checkpoint.resume none"),
]


@pytest.mark.parametrize("fields,name,activator", INACTIVE, ids=[c[1] for c in INACTIVE])
def test_a_field_of_a_feature_that_is_off_is_an_error_naming_what_turns_it_on(
    tmp_path, fields, name, activator
):
    from loom.methods import check_config

    with pytest.raises(ConfigError) as caught:
        check_config(tiny_config(tmp_path, **fields))
    message = str(caught.value)
    assert message.startswith(name + " = ") and f"does nothing without {activator}" in message, message


def test_the_same_fields_with_their_feature_on_are_accepted(tmp_path):
    from loom.methods import check_config

    check_config(tiny_config(tmp_path, **{"lora.rank": 4, "lora.alpha": 32, "lora.targets": "q,v"}))
    check_config(tiny_config(tmp_path, **{"training.objective": "grpo", "grpo.digits": 3}))
    check_config(tiny_config(tmp_path, **{"training.dtype": "float16", "training.loss_scale_init": 1024}))
    check_config(tiny_config(tmp_path, **{"checkpoint.resume": "none", "checkpoint.overwrite": "true"}))


def test_every_needs_names_a_known_activation():
    """The rule is generic: every field naming what activates it is covered, and the names exist."""
    from dataclasses import fields

    from loom.config.sections import ACTIVATIONS, all_sections

    needs = {
        f.metadata["needs"] for cls in all_sections().values() for f in fields(cls) if "needs" in f.metadata
    }
    assert needs == set(ACTIVATIONS)


# ---- launch and rendezvous options --------------------------------------------------------------------------------


def test_node_rank_and_ports_are_checked_before_any_rendezvous(tmp_path, capsys):
    line = cli_error(
        capsys, "train", "--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "localhost:29555"
    )
    assert "--node-rank = 5: must be below --nnodes 2" in line
    line = cli_error(
        capsys, "train", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "localhost:99999"
    )
    assert "--rdzv-endpoint = 'localhost:99999'" in line and "1..65535" in line
    missing = tmp_path / "nowhere" / "rdzv"
    line = cli_error(capsys, "train", "--rdzv-backend", "file", "--rdzv-endpoint", str(missing))
    assert "does not exist on this node" in line


def test_launch_options_are_checked_up_front(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hosts = tmp_path / "hosts"
    hosts.write_text("a slots=2\nb slots=2\n")
    base = ["launch", "--hostfile", str(hosts), "--dry-run"]
    assert "--master-port = 99999" in cli_error(capsys, *base, "--master-port", "99999")
    assert "--grace-s = -1.0" in cli_error(capsys, *base, "--grace-s", "-1")
    assert "training.stepz" in cli_error(capsys, *base, "--training.stepz", "3")
    assert "parallel.tp" in cli_error(capsys, *base, "--parallel.tp", "3")
    binary = tmp_path / "binary"
    binary.write_bytes(b"\x00\xff\xfe\x80 slots=1")
    assert "not UTF-8" in cli_error(capsys, "launch", "--hostfile", str(binary), "--dry-run")
    k8s = ["launch", "--kubernetes", "--image", "img", "--nodes", "1", "--gpus-per-node", "1"]
    assert "DNS-1123" in cli_error(capsys, *k8s, "--name", "My_Job")
    assert "--out" in cli_error(
        capsys, *k8s, "--out", str(hosts / "sub")
    )  # a file: no folder can be made there
    slurm = ["launch", "--slurm", "--nodes", "1", "--gpus-per-node", "1"]
    assert "--time = 'forever'" in cli_error(capsys, *slurm, "--time", "forever")
    assert "--script" in cli_error(capsys, *slurm, "--script", str(hosts / "job.sbatch"))
    assert not os.path.exists(hosts / "job.sbatch")


def test_a_launcher_template_with_host_gets_only_the_command_appended():
    from loom.cluster.launch import launcher_argv

    assert launcher_argv("ssh {host}", "a", "echo hi") == ["ssh", "a", "echo hi"]
    assert launcher_argv("ssh -p 2222", "a", "echo hi") == ["ssh", "-p", "2222", "a", "echo hi"]
    # {cmd} inside a word (a remote shell's script) is filled in, not passed on as the text "{cmd}"
    assert launcher_argv("srun -w {host} bash -lc 'cd /x && {cmd}'", "a", "echo hi") == [
        "srun",
        "-w",
        "a",
        "bash",
        "-lc",
        "cd /x && echo hi",
    ]


def test_more_launch_options_are_checked_up_front(tmp_path, capsys, monkeypatch):
    """A launcher template that does not parse or names an unknown placeholder, a negative --max-restarts, a SLURM
    job name with a space or --cpus-per-node 0, a namespace that is not DNS-1123; and the layout against the
    nodes x GPUs a SLURM script or Kubernetes manifest asks for (it was checked for hostfile workers only)."""
    monkeypatch.chdir(tmp_path)
    hosts = tmp_path / "hosts"
    hosts.write_text("a slots=2\nb slots=2\n")
    base = ["launch", "--hostfile", str(hosts), "--dry-run", "--training.global_batch_size", "32"]
    assert "No closing quotation" in cli_error(capsys, *base, "--launcher-cmd", "ssh '{host}")
    assert "{hots}" in cli_error(capsys, *base, "--launcher-cmd", "ssh {hots} {cmd}")
    assert "--max-restarts = -1" in cli_error(capsys, *base, "--max-restarts", "-1")
    slurm = ["launch", "--slurm", "--nodes", "1", "--gpus-per-node", "4", "--dry-run"]
    assert "--job-name = 'a b'" in cli_error(capsys, *slurm, "--job-name", "a b")
    assert "--cpus-per-node = 0" in cli_error(capsys, *slurm, "--cpus-per-node", "0")
    assert "parallel.tp" in cli_error(capsys, *slurm, "--parallel.tp", "3")
    k8s = ["launch", "--kubernetes", "--image", "img", "--nodes", "1", "--gpus-per-node", "4", "--dry-run"]
    assert "--namespace = 'Bad_NS'" in cli_error(capsys, *k8s, "--namespace", "Bad_NS")
    assert "parallel.tp" in cli_error(capsys, *k8s, "--parallel.tp", "3")
    assert loom_main([*k8s, "--parallel.tp", "2"]) == 0


# ---- the run dir stays locked while a launched worker lives ---------------------------------------------------------


def test_workers_of_a_killed_launcher_keep_the_run_dir_locked(tmp_path):
    from loom.runtime.run_lock import LOCKED_ENV, acquire

    run = tmp_path / "run"
    run.mkdir()
    code = (
        "import sys, time; from loom.runtime.run_lock import hold_as_worker; hold_as_worker(sys.argv[1]); "
        "print('held', flush=True); time.sleep(60)"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", code, str(run)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, LOCKED_ENV: os.path.realpath(run)},
    )
    try:
        # its launcher (none here: as if SIGKILLed) holds nothing
        assert worker.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match="workers of an earlier run are still running"):
            acquire(str(run))
    finally:
        worker.kill()
        worker.wait()
    acquire(str(run))  # the last worker gone: the run dir is free


# ---- tracebacks that are one line now -------------------------------------------------------------------------------


def bad_count(prompts, completions, **kw):
    return [1.0]


def returns_none(prompts, completions, **kw):
    return None


def returns_nan(prompts, completions, **kw):
    return [1.0, float("nan")]


def raises(prompts, completions, **kw):
    return [1.0 / 0 for _ in completions]


def raises_type_error(prompts, completions, **kw):
    return [len(c) + "x" for c in completions]  # the function's own TypeError, not a signature misfit


def raises_on_rank_1(prompts, completions, **kw):
    if os.environ.get("RANK", "0") == "1":
        raise TimeoutError("the grader timed out")  # a user error, not a hang, whatever its text
    return [0.0 for _ in completions]


def test_a_reward_function_that_raises_stops_the_run_in_one_line(tmp_path, capsys):
    """Issue 49: the user's exception (any type) is one line naming the function, where it is defined, the
    exception and where it was raised; no traceback of theirs in the log (it was a traceback per rank)."""
    from loom.rl.rewards import Rewards

    here = os.path.abspath(__file__).removesuffix("c")
    for name, needle in (
        ("raises", "raised ZeroDivisionError: float division by zero at "),
        ("raises_type_error", "raised TypeError: unsupported operand type(s) for +: 'int' and 'str' at "),
    ):
        with pytest.raises(UserError) as err:
            Rewards([f"tests.unit.test_nothing_silent:{name}"]).score(["p", "p"], ["a", "b"], [[1], [2]], {})
        assert f"grpo.rewards: tests.unit.test_nothing_silent:{name} (defined at {here}:" in str(err.value)
        assert needle + here in str(err.value), str(err.value)
    argv = tiny_args(
        tmp_path / "run",
        tmp_path / "cache",
        **{
            "training.objective": "grpo",
            "grpo.rewards": "tests.unit.test_nothing_silent:raises",
            "grpo.warmup_steps": 0,
            "grpo.group_size": 2,
            "grpo.max_new_tokens": 2,
            "training.steps": 2,
        },
    )
    line = cli_error(capsys, "train", *argv)
    assert "grpo.rewards: tests.unit.test_nothing_silent:raises (defined at " in line
    assert "raised ZeroDivisionError: float division by zero at " in line, line
    assert not os.path.exists(tmp_path / "run" / "checkpoints" / "step_00000001")


def test_a_seed_out_of_range_is_one_line(capsys):
    """Issue 49: run.seed past 32 bits was a torch overflow traceback at the start (or at GRPO's first sampling
    seed, run.seed x 1,000,003 x 1009); a negative one is refused, since torch would take -1 as 2**64 - 1."""
    from loom.infer import SamplingParams

    line = cli_error(capsys, "train", "--run.seed", "18446744073709551616")
    assert line == "loom: error: run.seed = 18446744073709551616: must be <= 4294967295"
    assert cli_error(capsys, "train", "--run.seed=-1") == "loom: error: run.seed = -1: must be >= 0"
    assert tiny_config(None, **{"run.seed": 2**32 - 1}).run.seed == 2**32 - 1
    with pytest.raises(ConfigError, match=r"^seed = -1: None \(a fresh seed\) or 0 .. 2\*\*63 - 1$"):
        SamplingParams(seed=-1)


def test_reward_functions_that_do_not_fit_are_one_line():
    from loom.rl.rewards import Rewards

    with pytest.raises(
        ConfigError, match="grpo.rewards = 'math:sqrt': a reward function takes keyword arguments"
    ):
        Rewards(["math:sqrt"])
    for name, needle in (
        ("bad_count", "returned 1 rewards for 2 completions"),
        ("returns_none", "returned None"),
        ("returns_nan", "returned nan for completion 1 \\(1 of 2 not finite\\)"),
    ):
        rewards = Rewards([f"tests.unit.test_nothing_silent:{name}"])
        with pytest.raises(UserError, match=needle):
            rewards.score(["p", "p"], ["a", "b"], [[1], [2]], {})


def test_grpo_reward_weights_that_are_not_numbers_are_one_line(tmp_path):
    from loom.data.tokenizers import ByteTokenizer
    from loom.rl.rollout import Rollouts

    cfg = tiny_config(
        tmp_path, **{"training.objective": "grpo", "grpo.reward_weights": "abc", "training.steps": 4}
    )
    with pytest.raises(ConfigError, match="grpo.reward_weights = 'abc': a comma list of numbers"):
        Rollouts(cfg, ByteTokenizer(), 0, 1)
    from loom.rl.rewards import Rewards

    with pytest.raises(ConfigError, match=r"grpo.reward_weights = \[1.0, nan\]: finite numbers"):
        Rewards(["math:sqrt", "math:sqrt"], [1.0, float("nan")])  # refused before the functions load


def test_a_string_where_config_json_has_a_number_is_one_line():
    from loom.checkpoint.hf.config import hf_config_from_args, llama_args_from_hf_config
    from loom.models.llama import FLAVORS

    cfg = hf_config_from_args(FLAVORS["debug"].with_(vocab_size=384), torch_dtype())
    llama_args_from_hf_config(cfg, where="f")  # as exported: fine
    for key, value in (("hidden_size", "64"), ("num_hidden_layers", "two"), ("rms_norm_eps", [1])):
        with pytest.raises(ConfigError, match=f"config.json: {key} = .* is not a number"):
            llama_args_from_hf_config({**cfg, key: value}, where="f")
    # read silently as something else (0 kv heads as "as many as the heads", "no" as true) or a traceback
    for key, value, needle in (
        ("num_key_value_heads", 0, "num_key_value_heads = 0 must be positive"),
        ("num_key_value_heads", 3, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
        ("max_position_embeddings", 0, "max_position_embeddings = 0 must be positive"),
        ("rms_norm_eps", -1e-5, "rms_norm_eps = -1e-05 must be positive"),
        ("tie_word_embeddings", "no", "tie_word_embeddings = 'no' is not true or false"),
        ("rope_scaling", "yes", "rope_scaling = 'yes' is not an object or null"),
        ("architectures", [5], "architectures = [5] is not a list of class names"),
        ("architectures", "LlamaForCausalLM", "architectures = 'LlamaForCausalLM' is not a list"),
    ):
        with pytest.raises(ConfigError, match=re.escape(f"config.json: {needle}")):
            llama_args_from_hf_config({**cfg, key: value}, where="f")


def torch_dtype():
    import torch

    return torch.float32


@pytest.mark.parametrize(
    "content,needle",
    [
        ("[1, 2]", "is a JSON list, not an object"),
        ('{"r": 4, "lora_alpha": null, "target_modules": ["q_proj"]}', "lora_alpha = None is not a number"),
        ('{"r": 4, "lora_alpha": "16", "target_modules": ["q_proj"]}', "lora_alpha = '16' is not a number"),
        ('{"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", 3]}', "target_modules = ['q_proj', 3]"),
    ],
)
def test_malformed_adapter_config_is_one_line(tmp_path, content, needle):
    from loom.checkpoint.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter_config

    (tmp_path / ADAPTER_CONFIG).write_text(content)
    (tmp_path / ADAPTER_WEIGHTS).write_bytes(b"")
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        read_adapter_config(str(tmp_path))


def test_damaged_data_files_are_one_line(tmp_path):
    """A corrupt parquet (data.source and grpo.prompts) and JSON nested 100,000 deep."""
    from loom.data.sources import parse_source, rows
    from loom.rl.prompts import PromptRows

    parquet = tmp_path / "cut.parquet"
    parquet.write_bytes(b"PAR1" + b"\x00" * 64)
    (spec,) = parse_source(str(parquet))
    with pytest.raises(ConfigError, match="data.source = .*not a readable parquet file"):
        list(rows(spec, None))
    with pytest.raises(ConfigError, match="grpo.prompts = .*not a readable parquet file"):
        PromptRows(str(parquet), 0)
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    (spec,) = parse_source(str(deep))
    with pytest.raises(ConfigError, match="line 1 nests JSON too deeply"):
        list(rows(spec, None))


def test_a_judge_template_that_looks_like_a_missing_path_is_an_error(tmp_path):
    from loom.rl.judge import Template

    with pytest.raises(ConfigError, match="grpo.judge_template = .*no such file"):
        Template(str(tmp_path / "judge.jinja"))
    Template("Rate {completion} for {prompt}")  # text stays text


def no_arguments():
    return {}


def test_an_eval_hook_with_the_wrong_signature_is_refused_at_start(tmp_path):
    from loom.eval.hook import training_evals

    cfg = tiny_config(
        tmp_path,
        **{
            "training.eval_hook": "tests.unit.test_nothing_silent:no_arguments",
            "training.eval_every": 2,
            "data.val_fraction": 0.1,
        },
    )
    with pytest.raises(ConfigError, match="training.eval_hook = .*takes one argument"):
        training_evals(cfg, str(tmp_path), True)


def test_convert_into_the_checkpoint_it_reads_is_refused(tmp_path, capsys):
    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    (ckpt / "COMPLETE.json").write_text("{}")
    line = cli_error(capsys, "convert", "--from", str(ckpt), "--to-hf", str(ckpt / "hf"))
    assert "--to-hf" in line and "inside the checkpoint it reads" in line
    # a loom checkpoint given as the Hugging Face folder to import (was a FileNotFoundError traceback)
    line = cli_error(capsys, "convert", "--from-hf", str(ckpt), "--to", str(tmp_path / "again"))
    assert f"--from-hf = '{ckpt}': is a loom checkpoint already" in line


def test_dpo_pairs_without_signal_are_refused_or_counted(tmp_path):
    import json

    from loom.config.sections import DataConfig
    from loom.data import prepare_data
    from loom.data.dpo import PairFile
    from loom.data.token_file import TokenFile
    from loom.data.tokenizers import ByteTokenizer

    def pair_file(rows, name):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        ((tokens, _, _),) = prepare_data(
            DataConfig(source=str(path)), ByteTokenizer(), str(tmp_path / "c"), "dpo"
        )
        return PairFile(TokenFile(tokens), 64, 0.0, name)

    same = [{"prompt": f"p{i}", "chosen": "same", "rejected": "same"} for i in range(4)]
    with pytest.raises(UserError, match="in every one of the 4 preference pairs chosen equals rejected"):
        pair_file(same, "same")
    mixed = pair_file(same[:3] + [{"prompt": "p", "chosen": "yes", "rejected": "no"}], "mixed")
    assert mixed.no_signal == 3


# ---- a full disk names the path and the bytes, and leaves nothing partial ------------------------------------------


def enospc(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_under_generate_output_leaves_no_file(tmp_path, monkeypatch):
    import builtins

    from loom.cli.generate import write_whole

    real_open = builtins.open

    class HalfWritten:
        def __init__(self, path, mode):
            self.fh = real_open(path, mode)

        def write(self, data):
            self.fh.write(data[: len(data) // 2])
            enospc()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    monkeypatch.setattr("loom.data.token_file.open", HalfWritten, raising=False)
    target = tmp_path / "out.jsonl"
    with pytest.raises(UserError) as caught:
        write_whole("--output", str(target), "x" * 1000)
    assert f"--output {target}: writing 1,000 bytes failed" in str(caught.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("export", ["hf", "peft"])
def test_a_full_disk_under_an_hf_export_leaves_the_target_as_it_was(tmp_path, monkeypatch, export):
    """convert --to-hf and --to-peft: safetensors reports a full disk as a SafetensorError (it was a traceback)."""
    import safetensors.torch
    import torch
    from safetensors import SafetensorError

    from loom.checkpoint.hf.export import export_hf
    from loom.checkpoint.peft import export_peft
    from loom.config.sections import LoraConfig
    from loom.models.llama import FLAVORS, Llama

    def half_then_full(tensors, path, metadata=None):
        with open(path, "wb") as fh:
            fh.write(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_full)
    out = str(tmp_path / export)
    with pytest.raises(UserError) as caught:
        if export == "hf":
            args = FLAVORS["debug"].with_(vocab_size=384, n_layers=1)
            export_hf(Llama(args).state_dict(), args, out)
        else:
            adapters = {"layers.0.attention.wq.lora_A.weight": torch.zeros(4, 64)}
            export_peft(adapters, LoraConfig(rank=4), out)
    message = str(caught.value)
    assert (
        message.startswith(f"{out}: writing the ") and "(No space left on device); it needs about" in message
    ), message
    assert not os.path.exists(out)


def test_plan_says_where_lora_is_not_modelled(tmp_path):
    """The estimate models LoRA; --roofline and a compute budget do not, and say so."""
    from loom.cli.plan import lora_note

    lora = tiny_config(tmp_path, **{"lora.rank": 16})
    assert lora_note(tiny_config(tmp_path), ["--roofline"]) is None and lora_note(lora, []) is None
    assert "lora.rank 16 is not modelled by --roofline" in lora_note(lora, ["--roofline"])


@pytest.mark.slow  # lm-eval indexes its thousands of task files first (~15 s of CPU)
def test_a_named_lm_eval_task_that_cannot_be_fetched_is_one_line_before_training(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from loom.eval.hook import training_evals

    for var, value in (
        ("HF_DATASETS_OFFLINE", "1"),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_HOME", str(tmp_path / "hf")),
    ):
        monkeypatch.setenv(var, value)
    cfg = tiny_config(
        tmp_path, **{"training.eval_tasks": "arc_easy", "training.eval_every": 2, "data.val_fraction": 0.1}
    )
    with pytest.raises(
        ConfigError,
        match="training.eval_tasks = 'arc_easy': cannot be loaded before training: its "
        "dataset is not cached and cannot be fetched",
    ):
        training_evals(cfg, str(tmp_path), True)


def test_a_full_disk_under_an_hf_import_leaves_nothing(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from loom.checkpoint.hf.dcp_import import import_hf_to_dcp
    from tests.unit.test_nothing_lost import export_tiny

    hf = export_tiny(tmp_path / "hf", 0)

    def full(state, checkpoint_id, **kwargs):
        with open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb") as fh:
            fh.write(b"\0" * 100)
        enospc()

    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(UserError) as caught:
        import_hf_to_dcp(hf, str(tmp_path / "ckpt"))
    message = str(caught.value)
    assert str(tmp_path / "ckpt") in message and "no space" in message and "needs about" in message, message
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # neither the target nor its temporary folder


def test_a_quota_or_file_size_limit_is_no_room_as_a_full_disk_is(capsys):
    """EDQUOT (a full quota) and EFBIG (a file size limit, ``ulimit -f``) fail a write as ENOSPC does: one line, not a
    traceback (found by the hostile-input sweep, which fills the disk with RLIMIT_FSIZE)."""
    import errno

    from loom.checkpoint.manager import _disk_full
    from loom.cli.errors import user_errors_exit

    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        err = OSError(code, os.strerror(code), "/x/step_1/__0_0.distcp")
        wrapped = RuntimeError("dcp")
        wrapped.__cause__ = err
        assert _disk_full(wrapped)

        @user_errors_exit
        def write():
            raise err

        with pytest.raises(SystemExit) as exc:
            write()
        lines = capsys.readouterr().err.splitlines()
        assert exc.value.code == 2 and len(lines) == 1, lines
        assert lines[0].startswith(
            "loom: error: no space left on the device writing /x/step_1/__0_0.distcp ("
        )
    assert not _disk_full(OSError(errno.EACCES, "Permission denied")) and not _disk_full(
        RuntimeError("other")
    )

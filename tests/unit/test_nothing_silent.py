"""Issue 49, through the command line: a field of a feature that is off is an error (one generic rule), launch and
rendezvous options checked up front (no hang), the tools' argument checks and one-line refusals, and a launcher's
workers keeping the run dir locked until the last one exits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loom.cli.main import main as loom_main
from loom.config.errors import ConfigError, UserError
from tests.tiny import tiny_config


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
    ({"training.objective": "grpo", "grpo.reward_model_weight": 2.0}, "grpo.reward_model_weight",
     "grpo.reward_model"),
    ({"training.objective": "grpo", "grpo.prompts": "p.jsonl", "grpo.warmup_steps": 0, "grpo.digits": 3},
     "grpo.digits", "the embedded arithmetic task"),
    ({"training.objective": "grpo", "grpo.judge_weight": 2.0}, "grpo.judge_weight", "grpo.judge"),
]


@pytest.mark.parametrize("fields,name,activator", INACTIVE, ids=[c[1] for c in INACTIVE])
def test_a_field_of_a_feature_that_is_off_is_an_error_naming_what_turns_it_on(tmp_path, fields, name, activator):
    from loom.resolve import check_config

    with pytest.raises(ConfigError) as caught:
        check_config(tiny_config(tmp_path, **fields))
    message = str(caught.value)
    assert message.startswith(name + " = ") and f"does nothing without {activator}" in message, message


def test_the_same_fields_with_their_feature_on_are_accepted(tmp_path):
    from loom.resolve import check_config

    check_config(tiny_config(tmp_path, **{"lora.rank": 4, "lora.alpha": 32, "lora.targets": "q,v"}))
    check_config(tiny_config(tmp_path, **{"training.objective": "grpo", "grpo.digits": 3}))


def test_every_needs_names_a_known_activation():
    """The rule is generic: every field naming what activates it is covered, and the names exist."""
    from dataclasses import fields

    from loom.config.sections import ACTIVATIONS, SECTIONS

    needs = {f.metadata["needs"] for cls in SECTIONS.values() for f in fields(cls) if "needs" in f.metadata}
    assert needs == set(ACTIVATIONS)


# ---- launch and rendezvous options --------------------------------------------------------------------------------

def test_node_rank_and_ports_are_checked_before_any_rendezvous(tmp_path, capsys):
    line = cli_error(capsys, "train", "--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "localhost:29555")
    assert "--node-rank = 5: must be below --nnodes 2" in line
    line = cli_error(capsys, "train", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "localhost:99999")
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
    assert "--out" in cli_error(capsys, *k8s, "--out", str(hosts / "sub"))  # a file: no folder can be made there
    slurm = ["launch", "--slurm", "--nodes", "1", "--gpus-per-node", "1"]
    assert "--time = 'forever'" in cli_error(capsys, *slurm, "--time", "forever")
    assert "--script" in cli_error(capsys, *slurm, "--script", str(hosts / "job.sbatch"))
    assert not os.path.exists(hosts / "job.sbatch")


def test_a_launcher_template_with_host_gets_only_the_command_appended():
    from loom.ops.launch import launcher_argv

    assert launcher_argv("ssh {host}", "a", "echo hi") == ["ssh", "a", "echo hi"]
    assert launcher_argv("ssh -p 2222", "a", "echo hi") == ["ssh", "-p", "2222", "a", "echo hi"]


# ---- the run dir stays locked while a launched worker lives ---------------------------------------------------------

def test_workers_of_a_killed_launcher_keep_the_run_dir_locked(tmp_path):
    from loom.train.run_dir import LOCKED_ENV, acquire

    run = tmp_path / "run"
    run.mkdir()
    code = ("import sys, time; from loom.train.run_dir import hold_as_worker; hold_as_worker(sys.argv[1]); "
            "print('held', flush=True); time.sleep(60)")
    worker = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, LOCKED_ENV: os.path.realpath(run)})
    try:
        assert worker.stdout.readline().strip() == "held"  # its launcher (none here: as if SIGKILLed) holds nothing
        with pytest.raises(UserError, match="workers of an earlier run are still running"):
            acquire(str(run))
    finally:
        worker.kill()
        worker.wait()
    acquire(str(run))  # the last worker gone: the run dir is free

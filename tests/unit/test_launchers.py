"""``loom launch``: hostfiles (DeepSpeed's format, --include / --exclude), each host's agent command (dry run),
the sbatch script (valid bash; run with stand-in scontrol / srun, it starts the agents with SLURM's values)
and the Kubernetes manifests (valid against the PyTorchJob and JobSet CRD schemas in tests/data/k8s)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess

import pytest

from loom.cli.launch import main as launch_main
from loom.cluster.launch import (
    KubeJob,
    Rendezvous,
    jobset,
    launcher_argv,
    parse_hostfile,
    pytorchjob,
    remote_command,
    select_hosts,
)
from loom.config.errors import ConfigError, UserError

SCHEMAS = pathlib.Path(__file__).resolve().parents[1] / "data" / "k8s"
HOSTFILE = """# two nodes
node-a slots=8   # the head

node-b slots=4
"""


def test_hostfile_parsing_and_selection():
    hosts = parse_hostfile(HOSTFILE)
    assert [(h.name, h.nproc) for h in hosts] == [("node-a", 8), ("node-b", 4)]
    picked = select_hosts(hosts, include="node-b:0,2")
    assert [(h.name, h.devices, h.nproc) for h in picked] == [("node-b", [0, 2], 2)]
    left = select_hosts(hosts, exclude="node-a@node-b:3")
    assert [(h.name, h.devices) for h in left] == [("node-b", [0, 1, 2])]
    for text, words in (
        ("node-a\n", "expected 'HOST slots=N'"),
        ("a slots=1\na slots=2\n", "listed twice"),
        ("# nothing\n", "names no host"),
    ):
        with pytest.raises(ConfigError, match=words):
            parse_hostfile(text)
    with pytest.raises(ConfigError, match="not in the hostfile"):
        select_hosts(hosts, include="node-c")
    with pytest.raises(ConfigError, match="slots 0-3"):
        select_hosts(hosts, include="node-b:4")


def test_hostfile_dry_run(tmp_path, capsys, monkeypatch):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(HOSTFILE)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.setenv("LOOM_RUN_DIR_LOCKED", "/x")  # a launcher's own lock marker is not forwarded
    monkeypatch.delenv("LOOM_SSH", raising=False)
    assert (
        launch_main(
            [
                "--hostfile",
                str(hostfile),
                "--dry-run",
                "--master-port",
                "29511",
                "--env",
                "A_B=1 2",
                "--config",
                "run.toml",
                "--training.steps",
                "10",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for rank, (line, host, nproc) in enumerate(zip(lines, ("node-a", "node-b"), (8, 4))):
        argv = shlex.split(line)
        assert argv[:4] == ["ssh", "-o", "BatchMode=yes", host]
        cmd = argv[4]
        subprocess.run(["bash", "-n", "-c", cmd], check=True)  # the remote line is valid shell
        agent = shlex.split(re.search(r"\{ (env .*?) </dev/null", cmd).group(1))
        assert "NCCL_SOCKET_IFNAME=ib0" in agent and "A_B=1 2" in agent
        assert not any(a.startswith("LOOM_RUN_DIR_LOCKED") for a in agent)
        i = agent.index("train")
        assert agent[i - 2 : i] == ["-m", "loom"]
        assert agent[i + 1 : i + 11] == [
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "node-a:29511",
        ]
        assert agent[-4:] == ["--config", "run.toml", "--training.steps", "10"]


def test_launcher_command_template():
    assert launcher_argv("pdsh -w {host} {cmd}", "n1", "echo hi") == ["pdsh", "-w", "n1", "echo hi"]
    assert launcher_argv("ssh -p 2222", "n1", "echo hi") == ["ssh", "-p", "2222", "n1", "echo hi"]
    assert launcher_argv("bash -c {cmd}", "n1", "echo hi") == ["bash", "-c", "echo hi"]


def test_remote_line_stops_the_agent_when_the_launcher_goes(tmp_path):
    """The agent (here ``sleep``'s stand-in Python) gets SIGTERM when the line's stdin closes, and its code is the
    line's code; a line whose stdin stays open runs the agent to its end."""
    mark = tmp_path / "term"
    prog = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(mark)!r}, 'w').close(), sys.exit(7)))\n"
        "time.sleep(60)\n"
    )
    fake_python = tmp_path / "py"
    fake_python.write_text(f"#!/bin/sh\nexec python3 -c {shlex.quote(prog)}\n")
    fake_python.chmod(0o755)
    line = remote_command(str(tmp_path), {}, str(fake_python), [])
    proc = subprocess.Popen(["bash", "-c", line], stdin=subprocess.PIPE)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=1)  # running while the launcher holds the connection
    proc.stdin.close()
    assert proc.wait(timeout=30) == 7 and mark.exists()


def test_sbatch_script(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0")
    script = tmp_path / "job.sbatch"
    assert (
        launch_main(
            [
                "--slurm",
                "--nodes",
                "2",
                "--gpus-per-node",
                "8",
                "--partition",
                "gpu",
                "--time",
                "02:00:00",
                "--account",
                "proj",
                "--cpus-per-node",
                "64",
                "--sbatch=--qos=high",
                "--script",
                str(script),
                "--max-restarts",
                "3",
                "--training.steps",
                "10",
                "--training.micro_batch_size",  # the layout is checked against the 16 workers
                "1",
            ]
        )
        == 0
    )
    text = script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=02:00:00",
        "#SBATCH --account=proj",
        "#SBATCH --cpus-per-task=64",
        "#SBATCH --qos=high",
        "export NCCL_IB_HCA=mlx5_0",
    ):
        assert line in text.splitlines(), line
    # run it with stand-ins: scontrol names the nodes, srun prints what each node would run
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-07\\ngpu-08\\n'\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu-[07-08]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
    }
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True)
    words = run.stdout.split("\n")
    assert words[:2] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    i = words.index("train")
    assert words[i + 1 : i + 13] == [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "gpu-07:29500",
        "--rdzv-id",
        "4242",
        "--max-restarts",
        "3",
    ]
    assert words[i + 13 : i + 15] == ["--training.steps", "10"]


def test_sbatch_checks_the_config_and_warns_without_cpus_per_node(tmp_path, monkeypatch, capsys):
    """--slurm writes a script that runs later: a --config that is not there (from --workdir) or a bad field is one
    line and exit 2 now, and no --cpus-per-node is a one-line warning (SLURM's default is often 1 CPU)."""
    from loom.cli.errors import user_errors_exit

    monkeypatch.chdir(tmp_path)
    base = ["--slurm", "--nodes", "1", "--gpus-per-node", "8", "--script", str(tmp_path / "job.sbatch")]
    base += ["--training.micro_batch_size", "2"]  # 2 x 8 workers divide the global batch of 16
    for extra, words in (
        (
            ["--config", "missing.toml"],
            f"--config = 'missing.toml': no such file (the job's loom "
            f"train reads it from {tmp_path}/missing.toml",
        ),
        (["--training.stepz", "10"], "did you mean"),
    ):
        with pytest.raises(SystemExit) as exit_:
            user_errors_exit(launch_main)(base + extra)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and words in err[0], err
    assert not (tmp_path / "job.sbatch").exists()
    (tmp_path / "run.toml").write_text("[training]\nsteps = 10\n")
    assert launch_main(base + ["--config", "run.toml"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning: no --cpus-per-node" in err[0] and "--cpus-per-node C" in err[0]
    assert launch_main(base + ["--config", "run.toml", "--cpus-per-node", "32"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_submit_without_sbatch(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    with pytest.raises(UserError, match="sbatch is not on PATH"):
        launch_main(
            ["--slurm", "--nodes", "1", "--gpus-per-node", "1", "--script", str(tmp_path / "s"), "--submit"]
        )


# ---- Kubernetes: the manifests against the CRDs' schemas --------------------------------------------------------


def validate(value, schema: dict, path: str = "$") -> list[str]:
    """Errors of ``value`` against the subset of OpenAPI v3 the CRD schemas use: type (with int32 / int64
    formats), required, properties (a property not listed is an error: the API server would prune it),
    additionalProperties, items, enum, anyOf, pattern, minimum."""
    errors = []
    if "anyOf" in schema:
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        if all(validate(value, {**rest, **alt}, path) for alt in schema["anyOf"]):
            errors.append(f"{path}: {value!r} matches none of {schema['anyOf']}")
        return errors
    kind = schema.get("type")
    checks = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return [f"{path}: {value!r} is not an integer"]
        bound = {"int32": 2**31, "int64": 2**63}.get(schema.get("format"))
        if bound and not -bound <= value < bound:
            errors.append(f"{path}: {value} is out of {schema['format']}")
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < {schema['minimum']}")
    elif kind in checks and not isinstance(value, checks[kind]):
        return [f"{path}: {value!r} is not of type {kind}"]
    if kind == "string" and "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if kind == "object":
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: missing required {key!r}")
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, item in value.items():
            if props and key in props:
                errors += validate(item, props[key], f"{path}.{key}")
            elif extra is not None:
                errors += validate(item, extra, f"{path}.{key}")
            elif props is not None:
                errors.append(f"{path}: unknown field {key!r} (the API server would prune it)")
    if kind == "array" and "items" in schema:
        for i, item in enumerate(value):
            errors += validate(item, schema["items"], f"{path}[{i}]")
    return errors


def _schema(name: str) -> dict:
    return json.loads((SCHEMAS / f"{name}.schema.json").read_text())


def test_manifests_are_valid_for_their_crds(tmp_path, capsys):
    assert (
        launch_main(
            [
                "--kubernetes",
                "--image",
                "registry.example/loom:1",
                "--nodes",
                "4",
                "--gpus-per-node",
                "8",
                "--name",
                "demo",
                "--max-restarts",
                "2",
                "--env",
                "NCCL_DEBUG=WARN",
                "--out",
                str(tmp_path),
                "--training.global_batch_size",  # the layout is checked against the 32 workers
                "32",
                "--training.micro_batch_size",
                "1",
                "--training.steps",
                "100",
            ]
        )
        == 0
    )
    written = sorted(p.name for p in tmp_path.iterdir())
    ext = written[0].rsplit(".", 1)[1]
    assert written == [f"demo.jobset.{ext}", f"demo.pytorchjob.{ext}"]
    load = json.loads if ext == "json" else pytest.importorskip("yaml").safe_load
    ptj = load((tmp_path / f"demo.pytorchjob.{ext}").read_text())
    js = load((tmp_path / f"demo.jobset.{ext}").read_text())
    assert validate(ptj, _schema("pytorchjob")) == []
    assert validate(js, _schema("jobset")) == []
    assert (ptj["apiVersion"], ptj["kind"], js["apiVersion"], js["kind"]) == (
        "kubeflow.org/v1",
        "PyTorchJob",
        "jobset.x-k8s.io/v1alpha2",
        "JobSet",
    )
    worker = ptj["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4 and ptj["spec"]["elasticPolicy"]["rdzvPort"] == 29500
    c = worker["template"]["spec"]["containers"][0]
    assert (
        c["command"] == ["python", "-m", "loom", "train"] and c["resources"]["limits"]["nvidia.com/gpu"] == 8
    )
    assert " ".join(c["args"]).startswith(
        "--nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "
        "demo-worker-0:29500 --rdzv-id demo --max-restarts 2"
    )
    assert c["args"][-2:] == ["--training.steps", "100"] and c["env"] == [
        {"name": "NCCL_DEBUG", "value": "WARN"}
    ]
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (4, 4, "Indexed")
    c = job["template"]["spec"]["containers"][0]
    assert "--node-rank $(JOB_COMPLETION_INDEX)" in " ".join(c["args"])
    assert "--rdzv-endpoint demo-node-0-0.demo:29500" in " ".join(c["args"])
    assert [e["name"] for e in c["env"]] == ["JOB_COMPLETION_INDEX", "NCCL_DEBUG"]  # declared: $(...) expands


def test_the_validator_finds_errors():
    """The check can fail: a string count, a missing container list and a misspelt field are each named."""
    job = KubeJob("demo", "img", 2, 8)
    bad = pytorchjob(job, [], {})
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "2"
    del bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    bad["spec"]["elasticPolicy"]["rdzvBackendd"] = "c10d"
    errors = validate(bad, _schema("pytorchjob"))
    assert len(errors) == 3, errors
    assert any("replicas: '2' is not of type" in e or "'2' is not an integer" in e for e in errors)
    assert any("missing required 'containers'" in e for e in errors)
    assert any("unknown field 'rdzvBackendd'" in e for e in errors)
    js = jobset(job, [], {})
    js["spec"]["successPolicy"] = {"operator": "Some"}
    assert validate(js, _schema("jobset")) == [
        "$.spec.successPolicy.operator: 'Some' is not one of ['All', 'Any']"
    ]


def test_rendezvous_ids_differ_per_launch():
    assert Rendezvous("h:1").run_id != Rendezvous("h:1").run_id


def test_cli_help_and_user_errors(capsys):
    from loom.cli.main import main as loom_main

    assert loom_main(["launch", "--help"]) == 0
    assert "--hostfile FILE" in capsys.readouterr().out
    for argv, words in (
        (["launch", "--slurm", "--gpus-per-node", "8"], "--nodes: --slurm needs it"),
        (["launch", "--kubernetes", "--nodes", "x"], "invalid int value"),
        (["launch", "--hostfile", "h", "--nproc-per-node", "8"], "loom launch sets it"),
    ):
        with pytest.raises(SystemExit) as exit_:
            loom_main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and words in err[0], err

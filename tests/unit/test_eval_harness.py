"""The lm-evaluation-harness backend ``loom`` gives what lm-eval's own Hugging Face backend (``hf``) gives on the
same weights: local custom tasks (YAML over a jsonl written here; nothing downloaded) of each request type, a
multiple-choice task (loglikelihood), a perplexity task (loglikelihood_rolling, texts longer than the model's
max length) and a generate_until task. The loom side reads a loom checkpoint (an import of `loom convert
--from-hf`), the hf side the folder `loom convert --to-hf` exports from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(name, "1")

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from lm_eval import simple_evaluate  # noqa: E402

from loom.cli.main import main as loom_main  # noqa: E402
from loom.eval.harness import LoomLM, flat_metrics, task_manager  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_LENGTH = 64
MC = [
    {
        "question": f"Question {i}: which letter follows {c}?",
        "choices": [" a", " b", " cc", " d"],
        "answer": i % 4,
    }
    for i, c in enumerate("wxyz")
]
GEN = [{"prompt": f"def f{i}(x):\n    return", "target": " x"} for i in range(3)] + [
    {"prompt": "# a long prompt\n" * 8 + "value =", "target": " 1"}
]  # cut from the left to 64 - 12 tokens
ROLL = [{"text": "The quick brown fox jumps over the lazy dog. " * k} for k in (1, 3)]  # 45 and 135 tokens
TASKS = {
    "loomtest_mc": (
        "mc",
        MC,
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    ),
    "loomtest_roll": (
        "roll",
        ROLL,
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n",
    ),
    "loomtest_gen": (
        "gen",
        GEN,
        'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n",
    ),
}


def write_tasks(folder) -> str:
    """One YAML task per request type over a local jsonl (datasets' json builder, its cache in ``folder``)."""
    os.makedirs(folder, exist_ok=True)
    for task, (name, rows, body) in TASKS.items():
        data = os.path.join(folder, f"{name}.jsonl")
        with open(data, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
        with open(os.path.join(folder, f"{name}.yaml"), "w") as fh:
            fh.write(
                f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                f"  cache_dir: {os.path.join(folder, 'cache')}\ntest_split: test\n{body}"
            )
    return str(folder)


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    """(loom checkpoint, the Hugging Face folder exported from it, the task folder). The weights are wider than
    an initialization's, so that the models' choices are far from ties."""
    from loom.checkpoint.hf.export import export_hf
    from loom.checkpoint.hf.tokenizer import tokenizer_export
    from loom.models.llama import Llama
    from loom.models.llama.flavors import FLAVORS

    root = tmp_path_factory.mktemp("harness")
    torch.manual_seed(0)
    args = FLAVORS["debug"].with_(vocab_size=259, max_seq_len=MAX_LENGTH)
    model = Llama(args)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5) if p.ndim == 1 else p.normal_(0.0, 0.1)
    export_hf(model.state_dict(), args, str(root / "src"), tokenizer=tokenizer_export("byte", MAX_LENGTH))
    assert loom_main(["convert", "--from-hf", str(root / "src"), "--to", str(root / "ckpt")]) == 0
    assert loom_main(["convert", "--from", str(root / "ckpt"), "--to-hf", str(root / "hf")]) == 0
    return str(root / "ckpt"), str(root / "hf"), write_tasks(root / "tasks")


def evaluate(lm, tasks: list[str], folder: str) -> dict:
    return simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager(tasks, folder), log_samples=True)


def hf_backend(folder: str):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=folder, device="cpu", dtype="float32", batch_size=3, max_length=MAX_LENGTH)


def responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_loglikelihood_and_rolling_equal_lm_evals_hugging_face_backend(model_folders):
    ckpt, hf, tasks = model_folders
    names = ["loomtest_mc", "loomtest_roll"]
    theirs = evaluate(hf_backend(hf), names, tasks)
    lm = LoomLM(ckpt, device="cpu", batch_size=2)
    assert lm.max_length == MAX_LENGTH and lm.prefix_token_id == 256  # the folder's BOS, as the hf backend's
    ours = evaluate(lm, names, tasks)
    a, b = flat_metrics(ours), flat_metrics(theirs)
    assert a.keys() == b.keys() and len(a) >= 5
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    for task in names:
        for mine, hers in zip(responses(ours, task), responses(theirs, task), strict=True):
            for (x,), (y,) in zip(mine, hers, strict=True):  # one response per request
                if task == "loomtest_mc":  # (log-probability, greedy)
                    assert x[0] == pytest.approx(y[0], abs=1e-4) and x[1] == y[1]
                else:
                    assert x == pytest.approx(y, rel=1e-5)


def test_generate_until_equals_lm_evals_hugging_face_backend(model_folders):
    pytest.importorskip("loom.infer.generator")
    ckpt, hf, tasks = model_folders
    theirs = evaluate(hf_backend(hf), ["loomtest_gen"], tasks)
    ours = evaluate(LoomLM(ckpt, device="cpu", batch_size=3), ["loomtest_gen"], tasks)
    texts = responses(ours, "loomtest_gen")
    assert texts == responses(theirs, "loomtest_gen")
    assert any(t[0] for t in texts)  # something was generated


def test_loom_eval_tasks_and_lm_evals_command_line(model_folders, tmp_path, capsys):
    """``loom eval --tasks`` writes the metrics lm-eval computes; ``python -m loom.eval.harness`` is lm-eval's own
    command line with ``--model loom``."""
    ckpt, _, tasks = model_folders
    out = tmp_path / "eval.json"
    assert (
        loom_main(
            [
                "eval",
                ckpt,
                "--tasks",
                "loomtest_mc,loomtest_roll,loomtest_gen",
                "--include-path",
                tasks,
                "--limit",
                "2",
                "--gen-kwargs",
                "max_gen_toks=4,until=x",
                "--device",
                "cpu",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    record = json.loads(out.read_text())
    direct = simple_evaluate(
        model=LoomLM(ckpt, device="cpu"),
        tasks=["loomtest_mc", "loomtest_roll", "loomtest_gen"],
        limit=2,
        task_manager=task_manager(["loomtest_mc"], tasks),
        gen_kwargs="max_gen_toks=4,until=x",  # lm-eval's own reading of what --gen-kwargs checked and parsed
    )
    assert record["tasks"]["metrics"] == pytest.approx(flat_metrics(direct))
    assert (
        record["tasks"]["lm_eval"]["config"]["gen_kwargs"]
        == direct["config"]["gen_kwargs"]
        == {
            "max_gen_toks": 4,
            "until": "x",
        }
    )
    assert "loomtest_roll" in capsys.readouterr().out  # lm-eval's table

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loom.eval.harness",
            "--model",
            "loom",
            "--model_args",
            f"checkpoint={ckpt}",
            "--device",
            "cpu",
            "--tasks",
            "loomtest_mc",
            "--include_path",
            tasks,
            "--limit",
            "2",
            "--output_path",
            str(tmp_path / "lm_eval"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (found,) = [
        os.path.join(d, f)
        for d, _, fs in os.walk(tmp_path / "lm_eval")
        for f in fs
        if f.startswith("results")
    ]
    with open(found) as fh:
        results = json.load(fh)["results"]["loomtest_mc"]
    assert results["acc,none"] == pytest.approx(flat_metrics(direct)["loomtest_mc/acc"])


def test_errors_are_one_line(model_folders, tmp_path, monkeypatch, capsys):
    ckpt, _, tasks = model_folders
    import lm_eval.tasks

    built = []  # (include_defaults) of every TaskManager built: lm-eval's own index takes ~10 s to build

    class Spy(lm_eval.tasks.TaskManager):
        def __init__(self, *args, include_defaults=True, **kwargs):
            built.append(include_defaults)
            super().__init__(*args, include_defaults=include_defaults, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Spy)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "inc.yaml").write_text("include: nowhere.yaml\ntask: loomtest_inc\n")
    (bad / "other.yaml").write_text("include: gone.yaml\ntask: loomtest_other\n")  # not asked for: no matter
    cases = [
        # issue 49: a name in no task file is refused without indexing lm-eval's thousands of tasks
        (
            ["--tasks", "no_such_task_here", "--include-path", tasks],
            "--tasks = 'no_such_task_here': no such task",
        ),
        (
            ["--tasks", "loomtest_mc,no_such_task_here", "--include-path", tasks],
            f"--tasks = 'no_such_task_here': no such task in lm-eval's tasks or --include-path {tasks}",
        ),
        (
            ["--tasks", "no_such_task_here"],
            "--tasks = 'no_such_task_here': no such task in lm-eval's tasks\n",
        ),
        # a task file whose include is missing: named, not "no such task" (lm-eval's index skips it silently)
        (
            ["--tasks", "loomtest_inc", "--include-path", str(bad)],
            f"--include-path = '{bad / 'inc.yaml'}': task 'loomtest_inc' cannot be loaded: its include "
            f"{bad / 'nowhere.yaml'} does not exist",
        ),
        (["--tasks", "loomtest_mc", "--include-path", str(tmp_path / "none")], "--include-path = "),
        # malformed generation settings: one line before anything loads (a traceback from lm-eval, or ignored)
        (["--tasks", "loomtest_gen", "--gen-kwargs", "temperature"], "'temperature' is not K=V"),
        (["--tasks", "loomtest_gen", "--gen-kwargs", "temperature="], "'temperature=' is not K=V"),
        (
            ["--tasks", "loomtest_gen", "--gen-kwargs", "temperature=hot"],
            "temperature = 'hot': allowed a number",
        ),
        (["--tasks", "loomtest_gen", "--gen-kwargs", "top_p=2"], "top_p = 2.0: allowed in (0, 1]"),
        (
            ["--tasks", "loomtest_gen", "--gen-kwargs", "do_sample=yes"],
            "do_sample = 'yes': allowed true or false",
        ),
        (
            ["--tasks", "loomtest_gen", "--gen-kwargs", "temprature=1"],
            "'temprature' is not a generation setting",
        ),
    ]
    for argv, expected in cases:
        with pytest.raises(SystemExit) as exit_:
            loom_main(["eval", ckpt, *argv, "--device", "cpu"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and expected in err and err.count("\n") == 1, (argv, err)
    assert True not in built, built
    monkeypatch.undo()
    # a task whose dataset is on the Hub, offline and not cached: one line, not datasets' traceback
    offline = tmp_path / "offline"
    offline.mkdir()
    (offline / "hub.yaml").write_text(
        "task: loomtest_hub\ndataset_path: loom-tests/not-cached\ntest_split: test\n"
        'output_type: loglikelihood\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    for var, value in (
        ("HF_DATASETS_OFFLINE", "1"),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_HOME", str(tmp_path / "hf")),
    ):
        monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as exit_:
        loom_main(
            ["eval", ckpt, "--tasks", "loomtest_hub", "--include-path", str(offline), "--device", "cpu"]
        )
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert "--tasks = 'loomtest_hub': a task's dataset is not cached and cannot be fetched" in err, err
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # lm-eval not installed
    with pytest.raises(SystemExit):
        loom_main(["eval", ckpt, "--tasks", "loomtest_mc"])
    assert capsys.readouterr().err == (
        "loom: error: loom eval --tasks needs the 'lm-eval' package (pip install 'loom-train[eval]')\n"
    )

"""Environment errors (issue 30): bad files, unwritable paths, impossible sizes and typos end in exit code 2 and
one ``loom: error:`` line naming the path or field, what is wrong and what would work, before anything is
built, and leave no partial files behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from loom.checkpoint.hf.export import export_hf
from loom.cli.main import COMMANDS
from loom.cli.main import main as loom_main
from loom.cli.preflight import checked_config
from loom.config import build_config
from loom.config.errors import ConfigError, UserError
from loom.config.sections import DataConfig
from loom.data import prepare_data
from loom.data.token_file import TokenFile, TokenFileWriter, read_meta
from loom.data.tokenizers import ByteTokenizer
from loom.models.llama import FLAVORS, Llama
from tests.tiny import tiny_args

# U+FFFD as UTF-8 bytes: what ``encoding_errors = replace`` decodes bad bytes to
REPLACEMENT = "\ufffd".encode()


# ---- helpers -----------------------------------------------------------------------------------


def cli_error(capsys, *argv: str) -> str:
    """Run ``loom argv`` in this process expecting a user error; returns its one stderr line."""
    with pytest.raises(SystemExit) as exc:
        loom_main(list(argv))
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("loom: error: "), err
    return err[0]


def loom_process(cwd, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "always"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "loom", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("loom: error: "), proc.stderr
    return lines[0]


def train_args(tmp_path, *extra: str) -> list[str]:
    """A one-step debug run that writes only under ``tmp_path``."""
    return [
        *tiny_args(
            tmp_path / "run",
            tmp_path / "cache",
            **{
                "training.steps": 1,
                "training.seq_len": 16,
                "training.global_batch_size": 2,
                "optimizer.warmup_steps": None,
                "metrics.every": None,
            },
        ),
        *extra,
    ]


def can_write(folder: str) -> bool:
    try:
        fd, probe = tempfile.mkstemp(dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.remove(probe)
    return True


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder this process cannot write into: a mode-555 one, or where permission bits do not bind (root), /sys."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if not can_write(str(folder)):
            yield str(folder)
        elif os.path.isdir("/sys") and not can_write("/sys"):
            yield "/sys"
        else:
            pytest.skip("no folder is read-only for this user here")
    finally:
        folder.chmod(0o755)


def leftovers(folder) -> list[str]:
    """Temporary files a writer left behind (ours are named ``*.loom-tmp-*``; the old ones ``*.tmp<pid>``)."""
    return sorted(f for f in os.listdir(folder) if "tmp" in f)


def tiny_hf_folder(folder, max_shard_bytes: int | None = None) -> str:
    """A one-layer Hugging Face Llama folder (config.json + safetensors, sharded with an index when
    ``max_shard_bytes``) written by loom's exporter."""
    args = FLAVORS["debug"].with_(vocab_size=384, n_layers=1)
    torch.manual_seed(0)
    export_hf(Llama(args).state_dict(), args, str(folder), *([max_shard_bytes] if max_shard_bytes else []))
    return str(folder)


def truncate(path, keep: float = 0.5) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(int(os.path.getsize(path) * keep))


# ---- 1. a binary or non-UTF-8 TOML file --------------------------------------------------------


@pytest.mark.parametrize(
    "content", [b"\xff\xfe\x00\x01binary", b"[training]\nsteps = 5\n# caf\xe9\n"], ids=["binary", "latin-1"]
)
def test_non_utf8_toml_is_one_line(tmp_path, capsys, content):
    path = tmp_path / "bad.toml"
    path.write_bytes(content)
    line = cli_error(capsys, "train", "--config", str(path))
    offset = content.index(b"\xff" if b"\xff" in content else b"\xe9")
    assert f"--config = '{path}'" in line and "not UTF-8" in line and f"byte offset {offset}" in line
    assert "TOML" in line  # what would work: a UTF-8 TOML file
    cli_error(capsys, "plan", "--config", str(path))  # every command that reads a config


# ---- 2. non-UTF-8 bytes in a data source --------------------------------------------------------


def bad_text(tmp_path) -> str:
    path = tmp_path / "bad.txt"
    path.write_bytes(b"hello \xff world\n" * 4)
    return str(path)


def bad_jsonl(tmp_path) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 au lait"}\n')
    return str(path)


def bad_jsonl_gz(tmp_path) -> str:
    import gzip

    path = tmp_path / "bad.jsonl.gz"
    with gzip.open(path, "wb") as fh:
        fh.write(b'{"text": "fine"}\n{"text": "caf\xe9 au lait"}\n')
    return str(path)


def bad_parquet(tmp_path) -> str:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    raw = pa.array([b"fine", b"caf\xe9 au lait"], type=pa.binary())
    path = tmp_path / "bad.parquet"
    pq.write_table(
        pa.table({"text": raw.view(pa.string())}), str(path)
    )  # a string column holding invalid UTF-8
    return str(path)


@pytest.mark.parametrize(
    "make,where",
    [
        (bad_text, "line 1, byte offset 6"),
        (bad_jsonl, "line 2, byte offset 30"),
        (bad_jsonl_gz, "line 2, byte offset 30 of the decompressed text"),
        (bad_parquet, "row 2, byte offset 3"),
    ],
    ids=["text", "jsonl", "jsonl.gz", "parquet"],
)
def test_non_utf8_source_names_file_and_offset_then_replace_works(tmp_path, capsys, make, where):
    source = make(tmp_path)
    out = str(tmp_path / "out.bin")
    line = cli_error(capsys, "data", "prepare", "--source", source, "--output", out)
    assert source in line and where in line and "--encoding-errors replace" in line and "U+FFFD" in line
    assert not os.path.exists(out) and leftovers(tmp_path) == []

    assert (
        loom_main(["data", "prepare", "--source", source, "--output", out, "--encoding-errors", "replace"])
        == 0
    )
    data = TokenFile(out).tokens.numpy().astype("uint8").tobytes()  # byte tokenizer: ids < 256 are the bytes
    assert REPLACEMENT in data


def test_training_names_the_field_and_replace_trains(tmp_path, capsys):
    source = bad_text(tmp_path)
    line = cli_error(capsys, "train", *train_args(tmp_path, "--data.source", source))
    assert source in line and "byte offset 6" in line and "--data.encoding_errors replace" in line
    replace = ["--data.encoding_errors", "replace", "--run.dir", str(tmp_path / "r2")]
    assert loom_main(["train", *train_args(tmp_path, "--data.source", source, *replace)]) == 0


def test_replace_has_its_own_cache_entry(tmp_path):
    """A cache built with ``replace`` never serves a ``strict`` run (which must still stop at the bad bytes), and a
    valid file keeps the cache path it always had."""
    source = bad_text(tmp_path)
    cache = str(tmp_path / "cache")
    tok = ByteTokenizer()
    ((replaced, _, _),) = prepare_data(DataConfig(source=source, encoding_errors="replace"), tok, cache)
    assert REPLACEMENT in TokenFile(replaced).tokens.numpy().astype("uint8").tobytes()
    with pytest.raises(ConfigError, match="byte offset 6"):
        prepare_data(DataConfig(source=source), tok, cache)
    good = tmp_path / "good.txt"
    good.write_text("valid text\n")
    ((strict_path, _, _),) = prepare_data(DataConfig(source=str(good)), tok, cache)
    ((replace_path, _, _),) = prepare_data(
        DataConfig(source=str(good), encoding_errors="replace"), tok, cache
    )
    assert strict_path != replace_path and strict_path != replaced
    assert torch.equal(TokenFile(strict_path).tokens, TokenFile(replace_path).tokens)


def test_lone_surrogate_escape_in_jsonl(tmp_path, capsys):
    """JSON can spell text that is not UTF-8 (a lone surrogate escape): the same rule as for bad bytes."""
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "half \\ud800 a pair"}\n')
    out = str(tmp_path / "out.bin")
    line = cli_error(capsys, "data", "prepare", "--source", str(path), "--output", out)
    assert str(path) in line and "line 2" in line and "--encoding-errors replace" in line
    assert (
        loom_main(["data", "prepare", "--source", str(path), "--output", out, "--encoding-errors", "replace"])
        == 0
    )
    assert REPLACEMENT in TokenFile(out).tokens.numpy().astype("uint8").tobytes()


@pytest.mark.parametrize("damage", ["cut", "not-gzip"])
def test_damaged_gzip_source(tmp_path, capsys, damage):
    import gzip

    path = tmp_path / "c.jsonl.gz"
    data = gzip.compress(
        "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(200)).encode()
    )
    path.write_bytes(data[: len(data) // 2] if damage == "cut" else b"plain text, not gzip\n")
    out = str(tmp_path / "out.bin")
    line = cli_error(capsys, "data", "prepare", "--source", str(path), "--output", out)
    assert str(path) in line and "not a complete gzip file" in line
    assert not os.path.exists(out) and leftovers(tmp_path) == []


def full_disk_after(monkeypatch, room: int) -> None:
    """Token files take ``room`` bytes, then fail as a full disk does: the write that does not fit writes what
    fits and raises, and so does the close that would flush it (a buffered file's close on a full disk)."""
    import loom.data.token_file as token_file

    real_init = token_file.TokenFileWriter.__init__

    class FullDisk:
        def __init__(self, fh):
            self.fh, self.left = fh, room

        def write(self, data):
            self.fh.write(data[: self.left])
            self.left -= min(self.left, len(data))
            if not self.left:
                raise OSError(28, "No space left on device")

        def close(self):
            self.fh.close()
            if not self.left:
                raise OSError(28, "No space left on device")

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self._fh = FullDisk(self._fh)

    monkeypatch.setattr(token_file.TokenFileWriter, "__init__", init)


def test_full_disk_while_tokenizing(tmp_path, capsys, monkeypatch):
    """A write that fails part-way is one line naming the output and the bytes, and the partial file is removed
    (the close that failed too left it, behind a traceback); the same under training's token cache."""
    from loom.data.prepare import ensure_token_file
    from loom.data.sources import parse_source
    from loom.data.tokenizers import ByteTokenizer

    full_disk_after(monkeypatch, 300)
    out = str(tmp_path / "out.bin")
    line = cli_error(capsys, "data", "prepare", "--source", small_jsonl(tmp_path), "--output", out)
    written = re.search(
        r"could not be written after ([\d,]+) bytes \(No space left on device; [\d,]+ bytes free", line
    )
    assert out in line and written and int(written[1].replace(",", "")) <= 300, line
    assert not os.path.exists(out) and leftovers(tmp_path) == []
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError) as caught:
        ensure_token_file(parse_source(small_jsonl(tmp_path))[0], ByteTokenizer(), str(cache))
    message = str(caught.value)
    assert message.startswith(f"data.cache_dir = '{cache}'") and "bytes free there" in message, message
    assert os.listdir(cache) == []


def test_full_disk_under_the_run_dirs_source_record(tmp_path, monkeypatch):
    """data_sources.json (the run dir's first large file) on a full disk: one line with the path and the bytes, no
    partial file (a truncated 40 KB file was left, behind the generic no-space line)."""
    import builtins

    from loom.data.token_file import write_whole

    real_open = builtins.open

    def half_then_full(path, mode="r", *args, **kwargs):
        fh = real_open(path, mode, *args, **kwargs)
        real_write = fh.write

        def write(data):
            real_write(data[: len(data) // 2])
            raise OSError(28, "No space left on device")

        fh.write = write
        return fh

    monkeypatch.setattr("loom.data.token_file.open", half_then_full, raising=False)
    target = tmp_path / "data_sources.json"
    with pytest.raises(UserError) as caught:
        write_whole(str(target), b"x" * 5000)
    assert str(caught.value).startswith(f"{target}: writing 5,000 bytes failed (No space left on device; ")
    assert os.listdir(tmp_path) == []


# ---- 3. data.cache_dir read-only or a file ------------------------------------------------------


def test_cache_dir_that_is_a_file(tmp_path, capsys):
    source = tmp_path / "a.txt"
    source.write_text("some text " * 50)
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="data.cache_dir"):
        checked_config(train_args(tmp_path, "--data.source", str(source)))
    line = cli_error(capsys, "train", *train_args(tmp_path, "--data.source", str(source)))
    assert f"data.cache_dir = '{blocker}'" in line and "is a file" in line
    assert not os.path.exists(tmp_path / "run")  # found before the run started


def test_read_only_cache_dir(tmp_path, capsys, read_only_dir):
    source = tmp_path / "a.txt"
    source.write_text("some text " * 50)
    cache = os.path.join(read_only_dir, "cache")
    with pytest.raises(ConfigError, match="data.cache_dir"):
        checked_config(train_args(tmp_path, "--data.source", str(source), "--data.cache_dir", cache))
    line = cli_error(
        capsys, "train", *train_args(tmp_path, "--data.source", str(source), "--data.cache_dir", cache)
    )
    assert cache in line and "not writable" in line
    assert not os.path.exists(tmp_path / "run")


def test_read_only_cache_dir_is_fine_for_token_files(tmp_path, read_only_dir):
    """A token file needs no cache: a read-only cache folder is then no error."""
    tok = ByteTokenizer()
    path = str(tmp_path / "t.bin")
    w = TokenFileWriter(path, eos_id=tok.eos_id, vocab_size=tok.vocab_size, tokenizer=tok.fingerprint())
    w.add(tok.encode("x" * 500))
    w.close()
    checked_config(
        train_args(tmp_path, "--data.source", path, "--data.cache_dir", os.path.join(read_only_dir, "c"))
    )


# ---- 4. a token file with ids beyond the tokenizer's vocabulary ---------------------------------


def out_of_vocab_token_file(tmp_path) -> str:
    tok = ByteTokenizer()
    path = str(tmp_path / "ids.bin")
    w = TokenFileWriter(path, eos_id=tok.eos_id, vocab_size=tok.vocab_size, tokenizer=tok.fingerprint())
    w.add([72, 105] * 100)
    w.add([72, 300, 1000, 7])  # the byte tokenizer has 259 ids: 300 and 1000 mean nothing
    w.close()
    return path


def test_token_ids_beyond_the_vocabulary(tmp_path, capsys):
    path = out_of_vocab_token_file(tmp_path)
    with pytest.raises(ConfigError, match="1000"):
        checked_config(train_args(tmp_path, "--data.source", path))
    line = cli_error(capsys, "train", *train_args(tmp_path, "--data.source", path))
    assert path in line and "token id 1000" in line and "259" in line
    line = cli_error(capsys, "data", "prepare", "--source", path, "--output", str(tmp_path / "copy.bin"))
    assert path in line and "token id 1000" in line
    assert not os.path.exists(tmp_path / "copy.bin") and leftovers(tmp_path) == []


# ---- 5. a truncated safetensors file ------------------------------------------------------------


@pytest.mark.parametrize(
    "keep,shards",
    [(0.5, False), (0.0002, False), (0.5, True)],
    ids=["data-cut", "header-cut", "one-shard-of-an-index"],
)
def test_truncated_safetensors_convert(tmp_path, capsys, keep, shards):
    folder = tiny_hf_folder(tmp_path / "hf", max_shard_bytes=100_000 if shards else None)
    name = "model-00002-of-00004.safetensors" if shards else "model.safetensors"
    truncate(os.path.join(folder, name), keep)
    ckpt = tmp_path / "ckpt"
    line = cli_error(capsys, "convert", "--from-hf", folder, "--to", str(ckpt))
    assert os.path.join(folder, name) in line and "truncated" in line
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no checkpoint, no temporary folder


def test_truncated_safetensors_init_from(tmp_path, capsys):
    folder = tiny_hf_folder(tmp_path / "hf")
    truncate(os.path.join(folder, "model.safetensors"))
    with pytest.raises(UserError, match="truncated"):
        checked_config(train_args(tmp_path, "--model.init_from", folder))
    line = cli_error(capsys, "train", *train_args(tmp_path, "--model.init_from", folder))
    assert os.path.join(folder, "model.safetensors") in line and "truncated" in line
    assert not os.path.exists(tmp_path / "run")


def test_intact_folder_still_converts(tmp_path):
    folder = tiny_hf_folder(tmp_path / "hf")
    assert loom_main(["convert", "--from-hf", folder, "--to", str(tmp_path / "ckpt")]) == 0


# ---- 6. data prepare --output: a folder, read-only, killed --------------------------------------


def small_jsonl(tmp_path) -> str:
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(50)))
    return str(path)


def test_prepare_output_is_a_folder(tmp_path, capsys):
    source = small_jsonl(tmp_path)
    out = tmp_path / "out.bin"
    out.mkdir()
    line = cli_error(capsys, "data", "prepare", "--source", source, "--output", str(out))
    assert f"--output = '{out}'" in line and "is a folder" in line
    assert os.listdir(out) == [] and leftovers(tmp_path) == []


def test_prepare_output_in_a_read_only_folder(tmp_path, capsys, read_only_dir):
    source = small_jsonl(tmp_path)
    out = os.path.join(read_only_dir, "out.bin")
    line = cli_error(capsys, "data", "prepare", "--source", source, "--output", out)
    assert out in line and "not writable" in line
    assert not os.path.exists(out)


def test_killed_prepare_leaves_a_recognisable_temp_file_that_the_next_run_removes(tmp_path):
    """SIGKILL while the token file is being written (the source is a FIFO nobody writes to, so the process waits
    there with its temporary file open); the next run of the same output cleans up after it."""
    fifo = tmp_path / "stuck.txt"
    os.mkfifo(fifo)
    out = tmp_path / "out.bin"
    env = {**os.environ}
    proc = subprocess.Popen(
        [sys.executable, "-m", "loom", "data", "prepare", "--source", str(fifo), "--output", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(1200):  # polls until the temporary file exists (the interpreter and torch start first)
            if leftovers(tmp_path) or proc.poll() is not None:
                break
            time.sleep(0.1)
        left = leftovers(tmp_path)
        assert left, proc.stderr.read().decode() if proc.poll() is not None else "no temporary file appeared"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert all(".loom-tmp-" in name and str(proc.pid) in name for name in left), left
    os.remove(fifo)
    source = small_jsonl(tmp_path)
    assert loom_main(["data", "prepare", "--source", source, "--output", str(out)]) == 0
    assert leftovers(tmp_path) == [] and read_meta(str(out)).documents == 50


def test_a_live_writers_temp_file_is_left_alone(tmp_path):
    """Only temporary files of processes that are gone (on this host) are removed: a concurrent writer's stays."""
    from loom.data.token_file import TEMP_TAG

    source = small_jsonl(tmp_path)
    out = str(tmp_path / "out.bin")
    writer = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"]
    )  # stands in for a live writer
    try:
        live = f"{out}{TEMP_TAG}{socket.gethostname()}-{writer.pid}"
        elsewhere = f"{out}{TEMP_TAG}another-host-1"  # a writer on another machine sharing the folder
        for path in (live, elsewhere):
            with open(path, "wb"):
                pass
        assert loom_main(["data", "prepare", "--source", source, "--output", out]) == 0
        assert os.path.exists(live) and os.path.exists(elsewhere)
    finally:
        writer.kill()
        writer.wait()


# ---- 7. convert --to-hf and plan --json onto bad targets ----------------------------------------


@pytest.fixture
def loom_ckpt(tmp_path) -> str:
    folder = tiny_hf_folder(tmp_path / "hf")
    ckpt = str(tmp_path / "ckpt")
    assert loom_main(["convert", "--from-hf", folder, "--to", ckpt]) == 0
    return ckpt


def test_export_onto_a_file(tmp_path, capsys, loom_ckpt):
    target = tmp_path / "model.txt"
    target.write_text("keep me")
    line = cli_error(capsys, "convert", "--from", loom_ckpt, "--to-hf", str(target))
    assert f"--to-hf = '{target}'" in line and "is a file" in line
    assert target.read_text() == "keep me"


def test_export_into_a_folder_holding_other_files_is_refused(tmp_path, capsys, loom_ckpt, monkeypatch):
    """Issue 49: `--to-hf .` wrote the model, config and tokenizer among the user's own files; refused as
    --to-peft is, before the model loads (a folder that holds a model was already refused, naming it)."""
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (mine / "src").mkdir()
    for target in (str(mine), "."):
        monkeypatch.chdir(mine)
        line = cli_error(capsys, "convert", "--from", loom_ckpt, "--to-hf", target)
        assert (
            f"--to-hf = '{target}': is not empty (2 entries, e.g. 'notes.txt'); choose a new or empty" in line
        )
        assert sorted(os.listdir(mine)) == ["notes.txt", "src"]


@pytest.mark.parametrize("inside", [False, True], ids=["the-folder", "a-new-folder-in-it"])
def test_export_into_a_read_only_folder(tmp_path, capsys, loom_ckpt, read_only_dir, inside):
    target = os.path.join(read_only_dir, "hf_out") if inside else read_only_dir
    line = cli_error(capsys, "convert", "--from", loom_ckpt, "--to-hf", target)
    assert target in line and "not writable" in line
    assert not os.path.exists(os.path.join(read_only_dir, "hf_out"))


def test_export_failure_leaves_no_partial_folder(tmp_path, capsys, loom_ckpt, monkeypatch):
    """A write that fails part-way (a full disk, say) is one line and removes what the export wrote."""
    import loom.checkpoint.hf.export as hf_export

    def full_disk(path, obj):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "write_json", full_disk)  # after the safetensors file was written
    out = tmp_path / "out"
    line = cli_error(capsys, "convert", "--from", loom_ckpt, "--to-hf", str(out))
    assert str(out) in line and "No space left on device" in line
    assert not os.path.exists(out)


def test_plan_json_onto_a_folder(tmp_path, capsys):
    target = tmp_path / "plan.json"
    target.mkdir()
    line = cli_error(capsys, "plan", "--json", str(target))
    assert f"--json = '{target}'" in line and "is a folder" in line
    assert capsys.readouterr().out == ""  # refused before the plan was computed


def test_plan_json_read_only(tmp_path, capsys, read_only_dir):
    target = os.path.join(read_only_dir, "plan.json")
    line = cli_error(capsys, "plan", "--json", target)
    assert target in line and "not writable" in line


def test_plan_json_written(tmp_path, capsys):
    target = tmp_path / "plan.json"
    assert loom_main(["plan", "--json", str(target)]) == 0
    assert "config" in json.loads(target.read_text()) and leftovers(tmp_path) == []


# ---- 8. convert writes files with normal permissions --------------------------------------------


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_convert_files_follow_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        folder = tiny_hf_folder(tmp_path / "hf")
        ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
        assert loom_main(["convert", "--from-hf", folder, "--to", ckpt]) == 0
        assert loom_main(["convert", "--from", ckpt, "--to-hf", out]) == 0
    finally:
        os.umask(old)
    for top in (ckpt, out):
        for root, dirs, files in os.walk(top):
            for name in files:
                mode = stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode)
                assert mode == 0o666 & ~mask, (os.path.join(root, name), oct(mode))
            for name in dirs + [""]:
                mode = stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode)
                assert mode == 0o777 & ~mask, (os.path.join(root, name), oct(mode))


# ---- 9. a mistyped command ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,hint",
    [
        (["trian"], "did you mean 'loom train'?"),
        (["data", "prep"], "did you mean 'loom data prepare'?"),
        (["covnert", "--from-hf", "x"], "did you mean 'loom convert'?"),
        (["data"], "did you mean 'loom data prepare'?"),
    ],
)
def test_mistyped_command_suggests_the_nearest(capsys, argv, hint):
    line = cli_error(capsys, *argv)
    assert "unknown command" in line and hint in line


def test_unknown_command_lists_the_commands(capsys):
    line = cli_error(capsys, "zzz")
    assert "'zzz'" in line and "commands are train, " in line and ", ".join(COMMANDS) in line
    assert {"plan", "convert", "generate", "eval", "report", "data prepare", "doctor"} <= set(COMMANDS)


# ---- 10. settings that cannot work here ---------------------------------------------------------


def test_nccl_without_cuda(tmp_path):
    with pytest.raises(ConfigError, match="parallel.backend = 'nccl'.*CUDA"):
        checked_config(train_args(tmp_path, "--parallel.backend", "nccl", "--run.device", "cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="parallel.backend = 'nccl'.*gloo"):
            checked_config(train_args(tmp_path, "--parallel.backend", "nccl"))


def test_mpi_without_mpi(tmp_path):
    """`loom train --parallel.backend mpi` on a PyTorch built without MPI (the PyPI wheels): one line, before any
    worker starts."""
    import torch.distributed as dist

    if dist.is_mpi_available():
        pytest.skip("this PyTorch has MPI")
    with pytest.raises(ConfigError, match=r"parallel.backend = 'mpi': this PyTorch build has no MPI"):
        checked_config(train_args(tmp_path, "--parallel.backend", "mpi"))


def test_float8_on_cpu(tmp_path, capsys):
    args = ["--training.float8", "tensorwise", "--training.dtype", "bfloat16", "--run.device", "cpu"]
    with pytest.raises(ConfigError, match="training.float8 = 'tensorwise'.*CUDA"):
        checked_config(train_args(tmp_path, *args))
    line = cli_error(capsys, "train", *train_args(tmp_path, *args))
    assert "allowed none" in line


def test_eval_without_validation_data():
    from loom.methods import check_config

    with pytest.raises(ConfigError, match=r"training.eval_every = 5.*data.val_fraction"):
        check_config(build_config(None, {"training.eval_every": "5", "data.val_fraction": "0"}))
    check_config(
        build_config(None, {"training.eval_every": "0", "data.val_fraction": "0"})
    )  # no evaluation: fine


# ---- 11/12. models and batches that cannot fit in memory ----------------------------------------


def test_model_too_large_for_memory_is_refused_up_front(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"model.n_layers = 1000000.*GiB for weights, gradients and optimizer "
        r"state per rank; this machine has .* GiB available",
    ):
        checked_config(train_args(tmp_path, "--model.n_layers", "1000000"))


def test_model_too_large_through_the_command(tmp_path):
    proc = loom_process(tmp_path, "train", *train_args(tmp_path, "--model.n_layers", "1000000"), timeout=120)
    line = one_line(proc)
    assert "model.n_layers = 1000000" in line and "GiB available" in line
    assert not os.path.exists(tmp_path / "run")


def test_absurd_batch_is_refused_from_the_memory_estimate(tmp_path):
    with pytest.raises(ConfigError, match=r"training.micro_batch_size = 100000.*GiB.*GiB available"):
        checked_config(
            train_args(
                tmp_path,
                "--training.micro_batch_size",
                "100000",
                "--training.global_batch_size",
                "100000",
                "--training.seq_len",
                "2048",
            )
        )


def test_default_run_passes_the_memory_check(tmp_path):
    run = ["--run.dir", str(tmp_path / "run")]
    checked_config(run)  # the defaults of `loom train`
    checked_config([*run, "--model.flavor", "debug_moe"])


def test_memory_estimate_counts_parameters_analytically():
    """The check never builds the model: a million layers are counted from the shape (exactly what a meta-device
    model of that shape holds), so they cost what two do."""
    from loom.plan.planner import memory_check_estimate

    est = memory_check_estimate(build_config(None, {"model.n_layers": "1000000"}), world_size=1, device="cpu")
    with torch.device("meta"):
        one, two = (Llama(FLAVORS["debug"].with_(vocab_size=384, n_layers=n)) for n in (1, 2))
    count = [sum(p.numel() for p in m.parameters()) for m in (one, two)]
    assert est.params == count[0] + (1_000_000 - 1) * (count[1] - count[0])
    assert est.state_bytes == 16 * est.params  # fp32 weights and gradients, two fp32 AdamW moments


def test_threshold_is_the_estimate_against_free_memory(tmp_path, monkeypatch):
    """Refused exactly when the planner's estimate, with the host margin (loom.plan.fit), exceeds what is free: 1%
    more memory than that passes, 1% less is one line with both figures and how many sequences would fit."""
    import loom.plan.fit as fit
    from loom.plan.planner import memory_check_estimate

    args = train_args(
        tmp_path,
        "--training.micro_batch_size",
        "64",
        "--training.global_batch_size",
        "64",
        "--training.seq_len",
        "256",
    )
    peak = memory_check_estimate(checked_config(args)[0], world_size=1, device="cpu").peak_bytes
    need = peak * (1 + fit.HOST_MARGIN) + fit.HOST_RESERVE_BYTES
    monkeypatch.setattr(fit, "host_room", lambda: (1.01 * need, "test memory"))
    checked_config(args)
    monkeypatch.setattr(fit, "host_room", lambda: (0.99 * need, "test memory"))
    with pytest.raises(
        ConfigError,
        match=r"training.micro_batch_size = 64: a training step needs ~.* GiB per rank "
        r"by the planner's estimate .*available \(test memory\), room for .* after "
        r"a margin .*: lower training.micro_batch_size \(about 6[0-3] fit",
    ):
        checked_config(args)

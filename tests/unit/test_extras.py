"""Optional dependencies missing at the point of use: one line naming the package and the extra."""

import sys

import pytest

from loom.config.errors import UserError, require


def test_require_imports_a_present_module():
    assert require("json", "dev").dumps([1]) == "[1]"


def test_require_names_package_and_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(UserError) as err:
        require("safetensors.torch", "hf", purpose="writing a Hugging Face folder")
    msg = str(err.value)
    assert (
        msg == "writing a Hugging Face folder needs the 'safetensors' package (pip install 'loom-train[hf]')"
    )
    assert "\n" not in msg


def test_export_without_safetensors_is_one_line(monkeypatch, tmp_path):
    from loom.checkpoint.hf.export import export_hf
    from loom.models.llama.flavors import FLAVORS

    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(
        UserError, match=r"needs the 'safetensors' package \(pip install 'loom-train\[hf\]'\)"
    ):
        export_hf({}, FLAVORS["debug"], str(tmp_path / "out"))


def test_a_failed_export_leaves_nothing(tmp_path):
    """A write that fails midway (a full disk) removes what it wrote and the folder it made: one line."""
    from loom.checkpoint.hf.export import whole_or_nothing

    out = tmp_path / "out"
    with pytest.raises(
        UserError,
        match=r"out: writing the test folder failed \(No space left on device\); "
        r"nothing partial was kept",
    ):
        with whole_or_nothing(str(out), "the test folder") as written:
            written.append(str(out / "a.bin"))
            (out / "a.bin").write_bytes(b"x")
            raise OSError(28, "No space left on device")
    assert not out.exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError):  # not an OSError: raised as it is, the folder that existed stays
        with whole_or_nothing(str(tmp_path / "kept"), "x") as written:
            raise RuntimeError("bug")
    assert (tmp_path / "kept").is_dir()

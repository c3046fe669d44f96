"""A GGUF file given as --model: converted once per file into the models folder (loading.py), and
the errors that come before its conversion. (test_gguf.py reads the file itself; these reach the
loader, and through it the model, so they run again wherever the model changes.)"""

import pytest

from common.tools.testing import require

require("gguf")  # before the imports that need it: without it, this module skips

from test_gguf import tiny_gguf  # noqa: E402


def test_a_gguf_is_converted_again_when_its_file_changes(tmp_path, monkeypatch):
    # The cache was keyed by the file's name and size: another GGUF of the same name and size (a
    # fine-tune, a download replaced after a corrupt one) was served the first one's weights.
    import os

    import loading

    monkeypatch.setattr(loading, "MODELS_DIR", tmp_path / "models")
    converted = []

    def convert(path, out):
        converted.append(path)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(loading, "convert_gguf", convert)
    path = tiny_gguf(tmp_path / "m.gguf")
    first = loading.resolve(str(path))
    assert loading.resolve(str(path)) == first and len(converted) == 1  # the same file: converted once
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # same name and size
    assert loading.resolve(str(path)) != first and len(converted) == 2
    upper = tiny_gguf(tmp_path / "M.GGUF")  # a suffix in capitals is a GGUF file too, not a missing folder
    assert loading.resolve(str(upper)).parent == first.parent and converted[-1] == upper


def test_a_models_dir_that_cannot_hold_the_conversion_is_a_clear_error(tmp_path, monkeypatch):
    # MODELS_DIR a file (or read-only, or /proc): NotADirectoryError's traceback before
    import loading
    from common.errors import UserError

    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setattr(loading, "MODELS_DIR", blocker)
    monkeypatch.setattr(loading, "convert_gguf", lambda path, out: out.mkdir(parents=True))  # as it writes
    path = tiny_gguf(tmp_path / "m.gguf")
    with pytest.raises(UserError, match="^cannot convert m.gguf into .*a file/gguf: Not a directory .*MODELS_DIR= sets"):
        loading.resolve(str(path))


def test_quant_on_a_gguf_is_refused_before_its_conversion(tmp_path, monkeypatch):
    # Refused only after the 10 s conversion before, and naming the converted folder, not the file.
    import loading
    from common.errors import UserError
    from quant import QuantSpec

    monkeypatch.setattr(loading, "convert_gguf", lambda path, out: pytest.fail("converted before the refusal"))
    path = tiny_gguf(tmp_path / "m.gguf")
    with pytest.raises(UserError, match=rf"^{path}: --quant applies to a plain checkpoint; a GGUF file runs as its own Q4_1 codes"):
        loading.load(str(path), "cpu", "float32", QuantSpec(bits=8, group_size=32, symmetric=False, head_bits=8))

"""Quantized checkpoint directories: written by quantize.py, loaded with identical logits, and any
mismatch between config.json and the stored tensors a clear error naming the tensor."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.checkpoint import CheckpointError
from common.models import resolve_model
from common.tools.warm_python import run_python
from model import forward_sequence, load_model
from quant import QuantSpec

# scripts run in a subprocess (common/tools/carried.py): quantize.py by nearly every test, generate.py by one
REACHES = ["quantize.py"]

CHAPTER = Path(__file__).resolve().parents[1]
TOKENS = [1, 17, 230, 5, 99, 411, 7]


def logits(model):
    with torch.inference_mode():
        return forward_sequence(model, TOKENS)


def quantize(tmp_path: Path, *args, model="tiny-llama3") -> Path:
    out = tmp_path / "q"
    r = run_python(["quantize.py", "--model", model, *args, "--out", str(out)], cwd=CHAPTER, timeout=300)
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize(
    "args, spec",
    [
        (["--bits", "8"], QuantSpec(8)),
        (["--bits", "4", "--group-size", "64"], QuantSpec(4, 64)),
        (["--bits", "4", "--group-size", "128", "--symmetric", "--lm-head", "int4"], QuantSpec(4, 128, True, 4)),
        (["--bits", "4", "--lm-head", "none"], QuantSpec(4, 32, head_bits=None)),
    ],
)
def test_saved_checkpoint_loads_with_identical_logits(tmp_path, args, spec):
    out = quantize(tmp_path, *args)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["bits"] == spec.bits
    assert (out / "tokenizer.json").is_file()
    for matmul in ("reference", "fast"):
        on_load = load_model(resolve_model("tiny-llama3"), "cpu", torch.float32, spec, matmul)
        saved = load_model(out, "cpu", torch.float32, matmul=matmul)
        assert saved.quant == spec
        assert torch.equal(logits(on_load), logits(saved))


def test_quantized_weights_are_smaller_on_disk(tmp_path):
    plain = (resolve_model("tiny-llama3") / "model.safetensors").stat().st_size  # fp32
    int4 = (quantize(tmp_path, "--bits", "4", "--lm-head", "int4") / "model.safetensors").stat().st_size
    assert int4 < plain / 5  # 5 bits a weight against 32


@pytest.fixture(scope="module")
def pristine_int4_dir(tmp_path_factory):
    return quantize(tmp_path_factory.mktemp("int4"), "--bits", "4", "--group-size", "32")


@pytest.fixture
def int4_dir(pristine_int4_dir, tmp_path):
    """A fresh copy to damage."""
    return Path(shutil.copytree(pristine_int4_dir, tmp_path / "int4"))


def edit_tensors(d: Path, change):
    tensors = load_file(d / "model.safetensors")
    change(tensors)
    save_file(tensors, d / "model.safetensors")


def edit_config(d: Path, change):
    config = json.loads((d / "config.json").read_text())
    change(config["quantization_config"])
    (d / "config.json").write_text(json.dumps(config))


def load(d):
    return load_model(d, "cpu", torch.float32)


def test_missing_scales_are_named(int4_dir):
    edit_tensors(int4_dir, lambda t: t.pop("model.layers.1.mlp.down_proj.scales"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.down_proj\.scales"):
        load(int4_dir)


def test_a_wrong_group_size_is_named(int4_dir):
    edit_config(int4_dir, lambda q: q.update(group_size=64))
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj\.scales: shape \(256, 8\).*group_size=64"
    ):
        load(int4_dir)


@pytest.mark.parametrize("bits", [3, 16, "4"])
def test_bits_other_than_4_or_8_are_an_error(int4_dir, bits):
    edit_config(int4_dir, lambda q: q.update(bits=bits))
    with pytest.raises(CheckpointError, match="quantization_config"):
        load(int4_dir)


def test_int8_checkpoint_declared_as_int4_is_named(tmp_path):
    d = quantize(tmp_path, "--bits", "8")
    edit_config(d, lambda q: q.update(bits=4))
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.mlp\.down_proj\.qweight: shape \(256, 768\).*imply \(256, 384\)"
    ):
        load(d)


def test_codes_of_the_wrong_dtype_are_named(int4_dir):
    edit_tensors(
        int4_dir,
        lambda t: t.update(
            {"model.layers.2.mlp.up_proj.qweight": t["model.layers.2.mlp.up_proj.qweight"].to(torch.int8)}
        ),
    )
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.2\.mlp\.up_proj\.qweight: dtype I8, this format stores U8"
    ):
        load(int4_dir)


def test_a_nan_scale_is_named(int4_dir):
    def poison(t):
        t["model.layers.0.mlp.gate_proj.scales"][3, 1] = float("nan")

    edit_tensors(int4_dir, poison)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.scales holds NaN"):
        load(int4_dir)


def test_a_truncated_file_is_an_error(int4_dir):
    f = int4_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load(int4_dir)


def test_another_quant_method_is_refused(int4_dir):
    edit_config(int4_dir, lambda q: q.update(quant_method="gptq"))
    with pytest.raises(CheckpointError, match="'gptq' is not this chapter's format"):
        load(int4_dir)


def test_quantizing_a_quantized_checkpoint_is_refused(int4_dir, tmp_path):
    r = run_python(
        ["quantize.py", "--model", str(int4_dir), "--bits", "8", "--out", str(tmp_path / "x")], cwd=CHAPTER, timeout=300
    )
    assert r.returncode == 2 and "already quantized" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(ValueError, match="already quantized"):
        load_model(int4_dir, "cpu", torch.float32, QuantSpec(8))


@pytest.mark.reaches("generate.py")
def test_generate_reports_a_corrupt_quantized_checkpoint_plainly(int4_dir):
    shutil.copy(int4_dir / "config.json", int4_dir / "config.bak")
    edit_tensors(int4_dir, lambda t: t.pop("model.layers.3.self_attn.o_proj.mins"))
    r = run_python(["generate.py", "--model", str(int4_dir), "--prompt", "hi"], cwd=CHAPTER, timeout=300)
    assert r.returncode == 2 and "missing tensor model.layers.3.self_attn.o_proj.mins" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_finite_scale_past_float32_once_multiplied_is_named(tmp_path):
    # An int8 scale (float32) of 1e38 is finite, but its codes multiply out to inf: every logit came
    # out NaN and generate.py printed an empty answer with exit status 0.
    int8_dir = quantize(tmp_path, "--bits", "8")

    def poison(t):
        t["model.layers.0.mlp.gate_proj.scales"][3] = 1e38

    edit_tensors(int8_dir, poison)
    with pytest.raises(CheckpointError, match=r"gate_proj\.scales holds a scale past float32's range"):
        load(int8_dir)


def test_a_symmetric_int4_scale_whose_minimum_passes_float16_is_named(tmp_path):
    # The loader rebuilds a symmetric checkpoint's float16 mins as -8 x scale: 9000 gave -inf.
    sym_dir = quantize(tmp_path, "--bits", "4", "--symmetric")

    def poison(t):
        t["model.layers.0.mlp.up_proj.scales"][0, 0] = 9000.0

    edit_tensors(sym_dir, poison)
    with pytest.raises(CheckpointError, match=r"up_proj\.scales: -8 x its largest scale passes float16's range"):
        load(sym_dir)

def test_a_tensor_stored_in_two_shards_is_named(int4_dir):
    # The second shard's copy was used silently (the plain checkpoint loader refused it already).
    tensors = load_file(int4_dir / "model.safetensors")
    dup = "model.layers.0.self_attn.q_proj.scales"
    save_file({dup: torch.zeros_like(tensors[dup])}, int4_dir / "zz.safetensors")
    weight_map = {name: "model.safetensors" for name in tensors} | {dup: "zz.safetensors"}
    (int4_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=rf"{dup}: stored twice \(model\.safetensors and zz\.safetensors\)"):
        load(int4_dir)


def test_quantize_never_overwrites_or_deletes_what_out_names(tmp_path):
    # --out over an existing model folder replaced its files; --from-gguf deleted the folder first,
    # the source GGUF included. A folder that does not exist yet, or an empty one, is written.
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "NOTES.txt").write_text("mine")
    for out, message in [
        (keep, "exists: give a new directory"),
        (tmp_path / "no" / "such" / "x", "does not exist"),
        (keep / "NOTES.txt", "exists: give a new directory"),
    ]:
        r = run_python(["quantize.py", "--model", "tiny-llama3", "--bits", "8", "--out", str(out)], cwd=CHAPTER, timeout=300)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert [p.name for p in keep.iterdir()] == ["NOTES.txt"] and (keep / "NOTES.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_python(["quantize.py", "--model", "tiny-llama3", "--bits", "8", "--out", str(empty)], cwd=CHAPTER, timeout=300)
    assert r.returncode == 0 and (empty / "config.json").is_file(), r.stderr


def test_from_gguf_refuses_the_flags_it_would_ignore(tmp_path):
    # --from-gguf copies the file's Q4_1 codes: --bits 8 --group-size 128 wrote int4 G=32 without a word.
    from common.prepare_models import find_gguf

    args = ["quantize.py", "--from-gguf", str(find_gguf()), "--bits", "8", "--group-size", "128", "--out", str(tmp_path / "x")]
    r = run_python(args, cwd=CHAPTER, timeout=300)
    assert r.returncode == 2 and "--bits, --group-size would not apply" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x").exists()

"""The bundled Q4_1 GGUF, read directly, is int4 G=32 asymmetric quantization of its own weights."""

from pathlib import Path

import numpy as np
import pytest

from common.tools.testing import require, shared

require("gguf")  # before the imports that need them: without them, this module skips

import torch

from common.checkpoint import CheckpointError, load_checkpoint_torch
from common.config import load_config
from common.models import resolve_model
from common.prepare_models import find_gguf
from common.tools.warm_python import run_python
from gguf_file import read_gguf, unpermute_rows
from quant import Int4Weight, Int8Weight, quantize_int4
from weights import read_weights

REACHES = ["generate.py", "quantize.py"]  # scripts run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reader():
    """The gguf package's own reading of the file (parsing its vocabulary takes seconds: once, shared
    with test_peers.py)."""
    import gguf

    return shared(gguf.GGUFReader, find_gguf())


@pytest.fixture(scope="module")
def gguf_model():
    return read_gguf(find_gguf())  # (config dict, {checkpoint name: weight})


def test_every_q4_1_tensor_equals_int4_g32_of_its_float_dequantization(gguf_model, reader):
    import gguf

    _, ours = gguf_model
    heads = {
        "q_proj": reader.fields["llama.attention.head_count"].contents(),
        "k_proj": reader.fields["llama.attention.head_count_kv"].contents(),
    }
    checked = 0
    for t in reader.tensors:
        if t.tensor_type.name != "Q4_1":
            continue
        # the gguf package's own dequantizer: an independent reading of the same bytes, in float32
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        name = next(
            n
            for n, x in ours.items()
            if isinstance(x, Int4Weight)
            and x.shape == tuple(w.shape)
            and n.startswith(f"model.layers.{t.name.split('.')[1]}.")
            and _same_kind(n, t.name)
        )
        kind = name.split(".")[-2]
        if kind in heads:
            w = unpermute_rows(w, heads[kind])
        requantized = quantize_int4(w, 32)
        g = ours[name]
        assert torch.equal(g.packed, requantized.packed), name
        assert torch.equal(g.scale, requantized.scale) and torch.equal(g.min, requantized.min), name
        checked += 1
    assert checked == 7 * 30


def _same_kind(hf: str, gguf_name: str) -> bool:
    pairs = {
        "attn_q": "q_proj",
        "attn_k": "k_proj",
        "attn_v": "v_proj",
        "attn_output": "o_proj",
        "ffn_gate": "gate_proj",
        "ffn_up": "up_proj",
        "ffn_down": "down_proj",
    }
    return hf.split(".")[-2] == pairs[gguf_name.split(".")[2]]


def test_the_bf16_checkpoint_requantizes_to_the_same_codes(gguf_model):
    # models/smollm2-135m is this GGUF dequantized and stored in bf16: int4 G=32 finds the same
    # codes and mins; bf16 rounding of a group's top weight moves a scale by at most one float16 step.
    _, ours = gguf_model
    d = resolve_model("smollm2-135m")
    plain = load_checkpoint_torch(d, load_config(d), None)
    for name, g in ours.items():
        if isinstance(g, Int4Weight):
            q = quantize_int4(plain[name], 32)
            assert torch.equal(q.packed, g.packed) and torch.equal(q.min, g.min), name
            ulp = (torch.nextafter(g.scale, torch.full_like(g.scale, 1.0)) - g.scale).float()
            assert ((q.scale.float() - g.scale.float()).abs() <= ulp).all(), name
        elif isinstance(g, torch.Tensor):
            assert torch.equal(g, plain[name].float()), name  # the F32 norms


def test_the_q8_0_embedding_is_requantized_per_row_within_half_a_step(gguf_model, reader):
    import gguf

    _, ours = gguf_model
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert t.tensor_type.name == "Q8_0"
    q8_0 = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    emb = ours["model.embed_tokens.weight"]
    assert isinstance(emb, Int8Weight)
    err = (emb.dequantize() - q8_0).abs()
    assert (err <= emb.scale[:, None] / 2 * (1 + 1e-5)).all()
    # measured 0.0117: one scale per row of 576 is coarser than Q8_0's one per 32 weights
    assert (err.norm() / q8_0.norm()).item() < 0.015


def test_config_from_gguf_metadata_matches_the_prepared_checkpoint(gguf_model):
    config, _ = gguf_model
    prepared = load_config(resolve_model("smollm2-135m"))
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "tie_word_embeddings",
        "max_position_embeddings",
    ):
        assert config[key] == getattr(prepared, key), key
    assert config["rope_theta"] == prepared.rope_theta and abs(config["rms_norm_eps"] - prepared.rms_norm_eps) < 1e-12


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        read_gguf(bad)


def test_generate_runs_the_gguf_file_directly():
    r = run_python(
        [
            "generate.py",
            "--model",
            str(find_gguf()),
            "--chat",
            "--dtype",
            "float32",
            "--matmul",
            "reference",
            "--prompt",
            "What is the capital of France? Answer in one sentence.",
            "--max-new-tokens",
            "12",
        ],
        cwd=CHAPTER,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "int4 G=32" in r.stderr


def test_quantize_from_gguf_writes_a_loadable_directory(tmp_path):
    out = tmp_path / "q4_1"
    r = run_python(["quantize.py", "--from-gguf", str(find_gguf()), "--out", str(out)], cwd=CHAPTER, timeout=600)
    assert r.returncode == 0, r.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    # read as the loader reads it (every tensor's name, dtype and shape checked against config.json);
    # through weights.py, not model.py, so this file reruns only where the GGUF path changes
    # (generate.py's test above loads a converted file into a model)
    weights, spec = read_weights(out, load_config(out), torch.float32)
    assert spec.bits == 4 and spec.group_size == 32 and spec.head_bits == 8
    assert isinstance(weights["model.layers.0.self_attn.q_proj.weight"], Int4Weight)


def tiny_gguf(path: Path, drop: str = "", tensors: dict | None = None, **values) -> Path:
    """A small GGUF of a Llama's metadata and two F32 tensors (enough for the checks that come
    before any weight is read): `values` replace metadata entries, `drop` leaves one out, `tensors`
    adds F32 ones (numpy's [rows, inputs] order)."""
    import gguf

    meta = {
        "llama.embedding_length": 64,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.feed_forward_length": 128,
        "llama.block_count": 1,
        "llama.context_length": 256,
    } | values
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        if key != drop:
            writer.add_uint32(key, value)
    if drop != "llama.attention.layer_norm_rms_epsilon":
        writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    if drop != "tokenizer.ggml.tokens":
        writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(32)])
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))  # [vocab, hidden]
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    for name, value in (tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def shift_offset(path: Path, tensor: str, by: int) -> None:
    """Moves `tensor`'s data offset in the tensor-info table by `by` bytes (a corrupt header)."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    at += 4 + 8 * n_dims + 4  # the dims, then the type: the offset follows
    offset = int.from_bytes(data[at : at + 8], "little")
    data[at : at + 8] = (offset + by).to_bytes(8, "little")
    path.write_bytes(bytes(data))


def cut_short(path: Path, keep: int) -> None:
    """The file as a download that stopped leaves it: its first `keep` bytes (keep < 0: all but the
    last -keep)."""
    path.write_bytes(path.read_bytes()[:keep])

@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: tiny_gguf(p, drop="llama.attention.head_count"), "llama.attention.head_count is None"),
        (lambda p: tiny_gguf(p, **{"llama.attention.head_count": 0}), "llama.attention.head_count is 0"),
        (lambda p: tiny_gguf(p, drop="tokenizer.ggml.tokens"), r"no tokenizer in its metadata"),
        (lambda p: tiny_gguf(p, **{"llama.embedding_length": 32}), "rows of 64, llama.embedding_length says 32"),
        (lambda p: shift_offset(tiny_gguf(p), "output_norm.weight", -4), "misaligned or overlaps"),
        (
            lambda p: tiny_gguf(p, drop="llama.attention.layer_norm_rms_epsilon"),
            "llama.attention.layer_norm_rms_epsilon is None; a Llama GGUF gives a positive number",
        ),
        (lambda p: tiny_gguf(p, drop="llama.context_length"), "llama.context_length is None"),
        (
            lambda p: tiny_gguf(p, **{"tokenizer.ggml.eos_token_id": 99}),
            "tokenizer.ggml.eos_token_id is 99, outside its vocabulary of 32 tokens",
        ),
        (
            lambda p: tiny_gguf(p, tensors={"blk.0.ffn_down.weight": np.zeros((64, 100), dtype=np.float32)}),
            r"blk.0.ffn_down.weight is \[64, 100\], its metadata's sizes make it \[64, 128\] \(embedding_length 64, feed_forward_length 128",
        ),
        (
            lambda p: tiny_gguf(p, tensors={"blk.0.attn_k.weight": np.zeros((64, 64), dtype=np.float32)}),
            r"blk.0.attn_k.weight is \[64, 64\], its metadata's sizes make it \[32, 64\]",
        ),
        (
            lambda p: tiny_gguf(p, tensors={"blk.3.attn_norm.weight": np.ones(64, dtype=np.float32)}),
            "blk.3.attn_norm.weight is past the 1 layers of llama.block_count",
        ),
        (lambda p: cut_short(tiny_gguf(p), 100), r"\(\d+ bytes\): cut short \(an interrupted download\?\)"),
        (lambda p: cut_short(tiny_gguf(p), -16), r"\(\d+ bytes\): cut short"),
    ],
    ids=[
        "no head count", "head count 0", "no tokenizer", "embedding width", "overlapping tensors",
        "no epsilon", "no context length", "eos past the vocabulary", "feed-forward width", "kv heads",
        "layer past the blocks",
        "cut in the header", "cut in a tensor",
    ],  # fmt: skip
)
def test_bad_metadata_and_layout_are_named_before_any_weight_is_read(tmp_path, make, message):
    # Each was a traceback (a TypeError, a ZeroDivisionError, a KeyError, transformers' own error
    # 12 s later) or, for a shifted offset, a model that loaded with its neighbour's bytes.
    path = tmp_path / "bad.gguf"
    make(path)
    with pytest.raises(CheckpointError, match=message):
        read_gguf(path)

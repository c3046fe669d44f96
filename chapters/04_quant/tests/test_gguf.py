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

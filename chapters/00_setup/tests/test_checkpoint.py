import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as save_torch

from common.checkpoint import CheckpointError, load_checkpoint, load_safetensors_file
from common.config import load_config
from common.models import resolve_model


@pytest.fixture(scope="module")
def tiny():
    d = resolve_model("tiny-llama3")
    return d, load_config(d)


def test_fp32_checkpoint_matches_safetensors_library(tiny):
    d, config = tiny
    ours = load_checkpoint(d, config)
    theirs = load_file(d / "model.safetensors")
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, arr in ours.items():
        np.testing.assert_array_equal(arr, theirs[name])


def test_bf16_is_widened_exactly(tmp_path):
    t = torch.randn(7, 5).to(torch.bfloat16)
    save_torch({"w": t, "h": t.half()}, tmp_path / "x.safetensors")
    loaded = load_safetensors_file(tmp_path / "x.safetensors")
    np.testing.assert_array_equal(loaded["w"], t.float().numpy())
    np.testing.assert_array_equal(loaded["h"], t.half().float().numpy())
    assert loaded["w"].dtype == np.float32


def test_real_checkpoint_is_bf16_and_loads(tiny):
    d = resolve_model("smollm2-135m")
    weights = load_checkpoint(d, load_config(d))
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert len(weights) == 2 + 30 * 9


def _copy_model(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    return dst


def test_truncated_file(tiny, tmp_path):
    d = _copy_model(tiny[0], tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated: tensor"):
        load_checkpoint(d, tiny[1])


def test_corrupt_header(tiny, tmp_path):
    d = _copy_model(tiny[0], tmp_path / "m")
    data = bytearray((d / "model.safetensors").read_bytes())
    data[8:20] = b"garbage!!!!!"
    (d / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_checkpoint(d, tiny[1])
    (d / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short"):
        load_checkpoint(d, tiny[1])


def test_missing_and_misshapen_tensors_are_named(tiny, tmp_path):
    d, config = tiny
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:-1]
    tensors["model.layers.0.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path, config)
    msg = str(e.value)
    assert "missing tensors: model.layers.2.mlp.up_proj.weight" in msg
    assert "unexpected tensors: model.layers.0.extra.weight" in msg
    assert "model.layers.0.self_attn.k_proj.weight: shape (63, 256), config implies (64, 256)" in msg


def test_sharded_checkpoint(tiny, tmp_path):
    d, config = tiny
    tensors = load_file(d / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, tmp_path / shard)
        weight_map |= {n: shard for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_checkpoint(tmp_path, config)
    np.testing.assert_array_equal(loaded["model.norm.weight"], tensors["model.norm.weight"])
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard\\(s\\) named in the index are missing"):
        load_checkpoint(tmp_path, config)


def test_no_weights(tmp_path, tiny):
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights found"):
        load_checkpoint(tmp_path, tiny[1])

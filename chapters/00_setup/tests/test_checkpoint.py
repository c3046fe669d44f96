import dataclasses
import json
import shutil
import struct

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as save_torch

from common.checkpoint import CheckpointError, load_checkpoint, load_checkpoint_torch, load_safetensors_file
from common.config import load_config
from common.models import resolve_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny-llama3 with its vocabulary cut to 512 tokens: the same tensors, names and dtypes in 12 MB
    instead of 62 MB (the embedding is most of it), since most tests here write a corrupted copy of it."""
    src, d = resolve_model("tiny-llama3"), tmp_path_factory.mktemp("tiny-512")
    config = json.loads((src / "config.json").read_text()) | {"vocab_size": 512}
    (d / "config.json").write_text(json.dumps(config))
    weights = load_file(src / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:512].copy()
    save_file(weights, d / "model.safetensors")
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


def test_a_folder_named_like_the_weights_is_not_a_file(tmp_path, tiny):
    # "shard(s) named in the index are missing" where there was no index
    from common.checkpoint import checkpoint_files

    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        checkpoint_files(tmp_path)
    with pytest.raises(CheckpointError, match=": not a file: "):
        checkpoint_files(tmp_path)


def test_no_weights(tmp_path, tiny):
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights found"):
        load_checkpoint(tmp_path, tiny[1])


# --- corrupted copies of tiny-llama3: every one is a CheckpointError naming what is wrong ---------


def _split(path):
    """(header dict, tensor bytes) of a safetensors file."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _write(path, header, body):
    """A safetensors file from a header dict and tensor bytes."""
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header with spaces to 8 bytes
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


@pytest.fixture
def corrupt(tiny, tmp_path):
    """corrupt(edit) -> a copy of tiny-llama3 whose header went through edit(header)."""

    def make(edit, extra=b""):
        d = _copy_model(tiny[0], tmp_path / "m")
        header, body = _split(d / "model.safetensors")
        edit(header)
        _write(d / "model.safetensors", header, body + extra)
        return d

    return make


def _loaders(config):
    """Both readers must reject the same files with the same errors."""
    return [lambda d: load_checkpoint(d, config), lambda d: load_checkpoint_torch(d, config)]


def test_header_length_one_byte_short_is_an_error_not_shifted_weights(tiny, tmp_path):
    # The JSON still parses (the file's space padding absorbs the byte), and every tensor would
    # start one byte early: the embedding became NaN, silently.
    d = _copy_model(tiny[0], tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert data[8 + n - 1 : 8 + n] == b" "
    (d / "model.safetensors").write_bytes(struct.pack("<Q", n - 1) + data[8:])
    for load in _loaders(tiny[1]):
        with pytest.raises(CheckpointError, match="1 bytes after the last tensor are not described by the header"):
            load(d)


def test_extra_bytes_after_the_last_tensor(tiny, corrupt):
    d = corrupt(lambda h: None, extra=b"\0" * 16)
    with pytest.raises(CheckpointError, match="16 bytes after the last tensor"):
        load_checkpoint(d, tiny[1])


def _first_tensor(header):
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def test_negative_offset_is_rejected(tiny, corrupt):
    # begin < 0 read the header's own bytes as weights.
    def edit(h):
        name = _first_tensor(h)
        begin, end = h[name]["data_offsets"]
        h[name]["data_offsets"] = [begin - 16, end - 16]

    d = corrupt(edit)
    for load in _loaders(tiny[1]):
        with pytest.raises(CheckpointError, match=r"tensor 'model\.\S+': data_offsets must be two integers"):
            load(d)


def test_two_tensors_sharing_bytes_are_rejected(tiny, corrupt):
    def edit(h):
        # Two norms of the same size: the second now reads the first's bytes.
        a, b = sorted(
            ["model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"],
            key=lambda k: h[k]["data_offsets"][0],
        )
        h[b]["data_offsets"] = list(h[a]["data_offsets"])

    d = corrupt(edit)
    with pytest.raises(CheckpointError, match="overlap"):
        load_checkpoint(d, tiny[1])


def test_gap_between_tensors_is_rejected(tiny, corrupt):
    def edit(h):
        # The first tensor keeps its size but starts 8 bytes later: 8 unused bytes before it,
        # and it overlaps the next one.
        name = _first_tensor(h)
        begin, end = h[name]["data_offsets"]
        h[name]["data_offsets"] = [begin + 8, end + 8]

    with pytest.raises(CheckpointError, match="8 unused bytes before tensor"):
        load_checkpoint(corrupt(edit), tiny[1])


NORM = "model.norm.weight"
BAD_ENTRIES = [
    ("offsets as strings", lambda e: e.update(data_offsets=["0", "1024"]), "data_offsets must be two integers"),
    ("no offsets", lambda e: e.pop("data_offsets"), "header entry lacks data_offsets"),
    ("offsets as floats", lambda e: e.update(data_offsets=[float(x) for x in e["data_offsets"]]), "data_offsets must"),
    ("reversed offsets", lambda e: e.update(data_offsets=e["data_offsets"][::-1]), "data_offsets must"),
    ("dtype as a list", lambda e: e.update(dtype=["F32"]), "unsupported dtype \\['F32'\\]"),
    ("unknown dtype", lambda e: e.update(dtype="F8_E4M3"), "unsupported dtype 'F8_E4M3'"),
    ("shape not a list", lambda e: e.update(shape=256), "shape must be a list of non-negative integers"),
    ("negative dimension", lambda e: e.update(shape=[-256]), "shape must be a list"),
    ("string dimension", lambda e: e.update(shape=["256"]), "shape must be a list"),
    ("size mismatch", lambda e: e.update(shape=[128]), "holds 1024 bytes, but F32 with shape \\(128,\\) needs 512"),
    (
        "dtype size mismatch",
        lambda e: e.update(dtype="F16"),
        "holds 1024 bytes, but F16 with shape \\(256,\\) needs 512",
    ),
]


@pytest.mark.parametrize("edit,message", [b[1:] for b in BAD_ENTRIES], ids=[b[0] for b in BAD_ENTRIES])
def test_bad_header_entry_is_named(tiny, corrupt, edit, message):
    d = corrupt(lambda h: edit(h[NORM]))
    for load in _loaders(tiny[1]):
        with pytest.raises(CheckpointError, match=f"tensor '{NORM}': {message}"):
            load(d)


def test_entry_that_is_not_an_object(tiny, corrupt):
    d = corrupt(lambda h: h.update({NORM: [1, 2, 3]}))
    with pytest.raises(CheckpointError, match=f"tensor '{NORM}': header entry must be an object"):
        load_checkpoint(d, tiny[1])


def test_duplicate_name_in_header(tiny, tmp_path):
    d = _copy_model(tiny[0], tmp_path / "m")
    header, body = _split(d / "model.safetensors")
    text = json.dumps(header)
    entry = json.dumps({NORM: header[NORM]})[1:-1]
    _write_raw = text[:-1] + ", " + entry + "}"  # the same name a second time
    raw = _write_raw.encode() + b" " * (-len(_write_raw) % 8)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    with pytest.raises(CheckpointError, match=f"the name '{NORM}' appears twice"):
        load_checkpoint(d, tiny[1])


def test_nan_weights_are_rejected_by_both_readers(tiny, tmp_path):
    d, config = tiny
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = np.nan
    bad = _copy_model(d, tmp_path / "m")
    save_file(tensors, bad / "model.safetensors")
    for load in _loaders(config):
        with pytest.raises(CheckpointError, match="'model.layers.1.mlp.down_proj.weight' contains NaN or infinite"):
            load(bad)


def test_inf_in_bf16_is_rejected(tmp_path):
    t = torch.randn(4, 4).to(torch.bfloat16)
    t[1, 2] = float("-inf")
    save_torch({"w": t}, tmp_path / "x.safetensors")
    with pytest.raises(CheckpointError, match="'w' contains NaN or infinite values"):
        load_safetensors_file(tmp_path / "x.safetensors")


def test_overflow_when_cast_to_fp16_is_named(tiny, tmp_path):
    d, config = tiny
    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"][0] = 1e6  # finite in fp32, beyond fp16's 65504
    bad = _copy_model(d, tmp_path / "m")
    save_file(tensors, bad / "model.safetensors")
    load_checkpoint_torch(bad, config, torch.float32)  # fine as stored
    # finite as stored: not "corrupt" (it said so), but past the range of the dtype asked for
    with pytest.raises(
        CheckpointError, match=r"'model.norm.weight' holds values up to 1e\+06, past float16's range .* bfloat16 or float32"
    ):
        load_checkpoint_torch(bad, config, torch.float16)


def test_integer_weight_is_rejected(tiny, tmp_path):
    d, config = tiny
    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = np.ones(256, np.int32)
    bad = _copy_model(d, tmp_path / "m")
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.norm.weight: dtype I32, expected a float type"):
        load_checkpoint(bad, config)


def test_config_with_many_more_layers_fails_fast_and_names_the_range(tiny):
    # Before, the expected names for every layer were built first: 9 million here, tens of
    # seconds and gigabytes for the 10,000,000 layers of the original finding.
    config = dataclasses.replace(tiny[1], num_hidden_layers=1_000_000)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint_torch(tiny[0], config)
    assert (
        "missing tensors: model.layers.4.* ... model.layers.999999.* (config says 1000000 layers, checkpoint has 4)"
        in str(e.value)
    )


def test_torch_reader_keeps_bf16_and_equals_numpy_reader():
    d = resolve_model("smollm2-135m")
    config = load_config(d)
    ours = load_checkpoint_torch(d, config)  # dtype None: as stored
    assert {t.dtype for t in ours.values()} == {torch.bfloat16}
    np_weights = load_checkpoint(d, config)
    assert set(ours) == set(np_weights)
    for name in ["model.embed_tokens.weight", "model.layers.29.mlp.down_proj.weight", "model.norm.weight"]:
        np.testing.assert_array_equal(ours[name].float().numpy(), np_weights[name])


def test_torch_reader_sharded_and_cast(tiny, tmp_path):
    d, config = tiny
    tensors = load_file(d / "model.safetensors")
    names = sorted(tensors)
    weight_map = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    for shard in set(weight_map.values()):
        save_file({n: tensors[n] for n in names if weight_map[n] == shard}, tmp_path / shard)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_checkpoint_torch(tmp_path, config, torch.bfloat16)
    assert loaded["model.norm.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(loaded["model.norm.weight"], torch.from_numpy(tensors["model.norm.weight"]).bfloat16())
    # The same tensor in both shards: which copy would win was an accident of file order.
    save_file(
        {
            NORM: tensors[NORM],
            "model.layers.0.input_layernorm.weight": tensors["model.layers.0.input_layernorm.weight"],
        },
        tmp_path / "model-00003-of-00003.safetensors",
    )
    weight_map[NORM] = "model-00003-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="is stored twice, in model-0000.-of-00002.safetensors and model-00003"):
        load_checkpoint_torch(tmp_path, config)


@pytest.mark.parametrize(
    "index", ["[1, 2]", '{"weight_map": ["a"]}', '{"weight_map": {"x": "../model.safetensors"}}', "{"]
)
def test_bad_shard_index(tiny, tmp_path, index):
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(
        CheckpointError, match="model.safetensors.index.json: (unreadable shard index|weight_map must map)"
    ):
        load_checkpoint(tmp_path, tiny[1])


def test_safetensors_library_errors_name_the_file(tiny, monkeypatch):
    import safetensors

    def refuse(path, **kw):
        raise safetensors.SafetensorError("Error while deserializing header: something it dislikes")

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    with pytest.raises(CheckpointError, match="model.safetensors: the safetensors library cannot read it: Error while"):
        load_checkpoint_torch(tiny[0], tiny[1])


def test_a_tied_checkpoint_may_store_a_copy_of_the_embedding_but_not_another_head(tiny, tmp_path):
    # Another head was dropped without a word: the logits of a model the checkpoint does not hold.
    d, config = tiny
    weights = load_file(d / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    for head, loads in ((embedding.copy(), True), (embedding + 1.0, False)):
        out = _copy_model(d, tmp_path / f"head-{loads}")
        save_file(weights | {"lm_head.weight": head}, out / "model.safetensors")
        if loads:
            assert "lm_head.weight" not in load_checkpoint(out, config)
        else:
            with pytest.raises(CheckpointError, match="stores an lm_head.weight that differs from it"):
                load_checkpoint(out, config)
            with pytest.raises(CheckpointError, match="stores an lm_head.weight that differs from it"):
                load_checkpoint_torch(out, config)

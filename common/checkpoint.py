"""safetensors -> named NumPy arrays, with the checks that turn a bad file into a clear message.

A safetensors file is: 8 bytes little-endian header length N, N bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then raw
little-endian tensor bytes. We parse it ourselves (it is that simple) because NumPy has no
bfloat16 and real Llama checkpoints are stored in bf16.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from common.config import LlamaConfig


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt, or does not match its config."""


_NUMPY_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 is the top 16 bits of a float32: shift them back into place. Exact."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def read_header(path: Path) -> tuple[dict, int]:
    """Returns (header dict without __metadata__, byte offset where tensor data starts)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: file too short to be safetensors ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise CheckpointError(f"{path}: corrupt safetensors header (claims {n} header bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} needs bytes up to {data_start + end}, file has {size}"
            )
    return header, data_start


def load_safetensors_file(path: str | Path, dtype=np.float32) -> dict[str, np.ndarray]:
    """Loads every tensor of one file. Floating tensors are converted to `dtype` (None keeps
    the stored float type, with bf16 widened to fp32 since NumPy cannot hold it)."""
    path = Path(path)
    header, data_start = read_header(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        shape, st_dtype = tuple(info["shape"]), info["dtype"]
        buf = raw[data_start + begin : data_start + end]
        if st_dtype == "BF16":
            arr = bf16_bits_to_f32(buf.view(np.uint16))
        elif st_dtype in _NUMPY_DTYPES:
            arr = buf.view(_NUMPY_DTYPES[st_dtype])
        else:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {st_dtype}")
        if arr.size != int(np.prod(shape, dtype=np.int64)):
            raise CheckpointError(f"{path}: tensor {name!r}: {arr.size} elements stored, shape {shape} needs more")
        arr = arr.reshape(shape)
        if dtype is not None and np.issubdtype(arr.dtype, np.floating):
            arr = arr.astype(dtype, copy=False)
        tensors[name] = np.array(arr, order="C")  # an owned, writable copy: the file can close
    return tensors


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors file(s) of a checkpoint: one model.safetensors, or the shards an index names."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable shard index ({e})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found (.bin/.pth checkpoints are not supported)")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{model_dir}: shard(s) named in the index are missing: {', '.join(missing)}")
    return files


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint holds, with its shape ([out_features, in_features] for linears)."""
    h, hd, i = config.hidden_size, config.head_dim, config.intermediate_size
    q_out, kv_out = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def load_checkpoint(model_dir: str | Path, config: LlamaConfig, dtype=np.float32) -> dict[str, np.ndarray]:
    """All weights of a Llama checkpoint directory, checked against its config by name and shape."""
    tensors: dict[str, np.ndarray] = {}
    for f in checkpoint_files(model_dir):
        tensors |= load_safetensors_file(f, dtype=dtype)
    # Some exports store buffers that are recomputed at load time; a tied checkpoint may still
    # carry a copy of lm_head.weight.
    for name in [n for n in tensors if n.endswith("rotary_emb.inv_freq")]:
        del tensors[name]
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)

    expected = expected_shapes(config)
    problems = []
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
    for name in sorted(set(expected) & set(tensors)):
        if tuple(tensors[name].shape) != expected[name]:
            problems.append(f"{name}: shape {tuple(tensors[name].shape)}, config implies {expected[name]}")
    if problems:
        raise CheckpointError(f"{model_dir}: checkpoint does not match config.json:\n  " + "\n  ".join(problems))
    return tensors

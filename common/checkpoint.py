"""A checkpoint directory -> named weights, checked so that a bad file is a clear error, never
silently wrong weights.

A safetensors file is: 8 bytes little-endian header length N, N bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then raw
little-endian tensor bytes; offsets count from the end of the header.

Two readers share one set of checks:
- `read_header` validates a header as the format requires (every entry an object, known dtype,
  a shape of non-negative ints, integer offsets whose byte ranges tile the data region exactly),
  and `plan_checkpoint` checks names and shapes against config.json, from the headers alone,
  before a byte of weight data is read.
- `load_checkpoint` (chapter 01) reads the data with our own NumPy parser: NumPy has no bfloat16,
  so bf16 is widened to fp32 by a bit shift, and parsing the format by hand is part of the lesson.
- `load_checkpoint_torch` (chapters 02+) lets the `safetensors` library map the file: bf16 stays
  bf16 until cast to the model dtype, with no transient fp32 copy of the model (which matters at
  1B+ parameters).
Both then check that every weight is finite.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import numpy as np

from common.config import LlamaConfig


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt, or does not match its config."""


# Bytes per element of the dtypes both readers can load. Any other dtype (FP8, U16, ...) is
# rejected by name rather than misread.
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")

_NUMPY_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 is the top 16 bits of a float32: shift them back into place. Exact."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


# --- the header: parsed and validated once, for both readers -----------------------------------


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a 1


def _no_duplicate_keys(pairs: list) -> dict:
    # json.loads keeps the last of two equal keys: a second entry for a tensor name would
    # silently replace the first.
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise CheckpointError(f"the name {dup!r} appears twice")
    return dict(pairs)


def _check_entry(path: Path, name: str, info) -> tuple[int, int]:
    """One tensor entry of a header; returns its (begin, end) offsets."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(
            f"{where}: header entry must be an object with dtype, shape and data_offsets, got {info!r:.60}"
        )
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise CheckpointError(f"{where}: header entry lacks {', '.join(missing)}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise CheckpointError(f"{where}: unsupported dtype {dtype!r:.60} (supported: {', '.join(DTYPE_SIZES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {shape!r:.60}")
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets)) and 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(
            f"{where}: data_offsets must be two integers [begin, end], 0 <= begin <= end, got {offsets!r:.60}"
        )
    begin, end = offsets
    needed = DTYPE_SIZES[dtype] * math.prod(shape)
    if end - begin != needed:
        raise CheckpointError(
            f"{where}: holds {end - begin} bytes, but {dtype} with shape {tuple(shape)} needs {needed}"
        )
    return begin, end


def _check_tiling(path: Path, spans: list[tuple[int, int, str]], data_start: int, size: int) -> None:
    """The tensors' byte ranges must cover the data region exactly: no overlap (two tensors
    reading the same bytes), no gap, and the last one ending at the end of the file. A header
    length that is off by even one byte breaks this, instead of shifting every tensor."""
    data_len = size - data_start
    position, previous = 0, None
    for begin, end, name in sorted(spans):
        if end > data_len:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} needs bytes up to {data_start + end}, file has {size}"
            )
        if begin < position:
            raise CheckpointError(f"{path}: tensors {previous!r} and {name!r} overlap (data_offsets share bytes)")
        if begin > position:
            raise CheckpointError(
                f"{path}: {begin - position} unused bytes before tensor {name!r} (data_offsets leave a gap)"
            )
        position, previous = end, name
    if position != data_len:
        raise CheckpointError(
            f"{path}: {data_len - position} bytes after the last tensor are not described by the header "
            f"(wrong header length or data_offsets)"
        )


def read_header(path: str | Path) -> tuple[dict, int]:
    """Returns (header without __metadata__, byte offset where tensor data starts), after
    checking everything the safetensors format requires of it."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: file too short to be safetensors ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: corrupt safetensors header (claims {n} header bytes, file has {size})")
            text = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    if not text.startswith(b"{"):
        raise CheckpointError(f"{path}: corrupt safetensors header (does not start with '{{')")
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    except CheckpointError as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ must map names to strings)")
    data_start = 8 + n
    spans = [(*_check_entry(path, name, info), name) for name, info in header.items()]
    _check_tiling(path, spans, data_start, size)
    return header, data_start


# --- the files of a checkpoint, and what they must hold -----------------------------------------


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors file(s) of a checkpoint: one model.safetensors, or the shards an index names."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable shard index ({type(e).__name__}: {e})") from None
        # A shard is a file beside the index: a name with a directory in it is a broken (or hostile) index.
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and v and Path(v).name == v for v in weight_map.values()
        ):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names in {model_dir}")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found (.bin/.pth checkpoints are not supported)")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:  # with no index, a folder named *.safetensors (glob found it)
        what = "shard(s) named in the index are missing" if index.is_file() else "not a file"
        raise CheckpointError(f"{model_dir}: {what}: {', '.join(missing)}")
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


def _shortlist(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")


def _check_layer_count(config: LlamaConfig, stored: dict) -> str | None:
    """A config claiming more layers than the checkpoint holds, as one line naming the missing
    range. Checked before expected_shapes(config), which for a config saying 10,000,000 layers
    would build 90 million names before reporting them."""
    layers = {int(m.group(1)) for name in stored if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    have = max(layers) + 1 if layers else 0
    if config.num_hidden_layers <= have:
        return None
    missing = f"model.layers.{have}.*" + (
        f" ... model.layers.{config.num_hidden_layers - 1}.*" if config.num_hidden_layers - have > 1 else ""
    )
    return f"missing tensors: {missing} (config says {config.num_hidden_layers} layers, checkpoint has {have})"


def plan_checkpoint(model_dir: str | Path, config: LlamaConfig) -> dict[Path, list[str]]:
    """{file: names of the tensors to load from it}: every tensor the config implies, each
    found exactly once, with the shape the config implies and a floating-point dtype. Reads
    only the headers, so a mismatch is reported before any weight data is read."""
    stored: dict[str, tuple[Path, dict]] = {}  # name -> (file, header entry)
    data_start: dict[Path, int] = {}  # file -> where its tensor data begins
    for f in checkpoint_files(model_dir):
        header, data_start[f] = read_header(f)
        for name, info in header.items():
            if name in stored:
                raise CheckpointError(
                    f"{model_dir}: tensor {name!r} is stored twice, in {stored[name][0].name} and {f.name}"
                )
            stored[name] = (f, info)
    # Some exports store buffers that are recomputed at load time; a tied checkpoint may still
    # carry a copy of lm_head.weight.
    for name in [n for n in stored if n.endswith("rotary_emb.inv_freq")]:
        del stored[name]
    if config.tie_word_embeddings and "lm_head.weight" in stored:
        # A copy of the embedding goes; another head would be a silent choice between two models.
        embedding = stored.get("model.embed_tokens.weight")
        if embedding is not None and not _same_bytes(stored["lm_head.weight"], embedding, data_start):
            raise CheckpointError(
                f"{model_dir}: config.json ties the LM head to the embedding (tie_word_embeddings), but the "
                "checkpoint stores an lm_head.weight that differs from it: set tie_word_embeddings to false to "
                "use that head, or remove it"
            )
        del stored["lm_head.weight"]

    problems = []
    layer_problem = _check_layer_count(config, stored)
    if layer_problem:
        problems.append(layer_problem)
    else:
        expected = expected_shapes(config)
        missing = sorted(set(expected) - set(stored))
        unexpected = sorted(set(stored) - set(expected))
        if missing:
            problems.append(f"missing tensors: {_shortlist(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors: {_shortlist(unexpected)}")
        for name in sorted(set(expected) & set(stored)):
            info = stored[name][1]
            if tuple(info["shape"]) != expected[name]:
                problems.append(f"{name}: shape {tuple(info['shape'])}, config implies {expected[name]}")
            elif info["dtype"] not in FLOAT_DTYPES:
                problems.append(f"{name}: dtype {info['dtype']}, expected a float type ({', '.join(FLOAT_DTYPES)})")
    if problems:
        raise CheckpointError(f"{model_dir}: checkpoint does not match config.json:\n  " + "\n  ".join(problems))
    plan: dict[Path, list[str]] = {}
    for name in sorted(stored):
        plan.setdefault(stored[name][0], []).append(name)
    return plan

def _same_bytes(a: tuple[Path, dict], b: tuple[Path, dict], data_start: dict[Path, int]) -> bool:
    """Whether two stored tensors ((file, header entry)) hold the same dtype, shape and bytes."""
    if (a[1]["dtype"], a[1]["shape"]) != (b[1]["dtype"], b[1]["shape"]):
        return False
    views = []
    for path, info in (a, b):
        begin, end = info["data_offsets"]
        views.append(np.memmap(path, dtype=np.uint8, mode="r", offset=data_start[path] + begin, shape=(end - begin,)))
    return bool(np.array_equal(views[0], views[1]))


def _nonfinite_error(path: Path, name: str) -> CheckpointError:
    return CheckpointError(f"{path}: tensor {name!r} contains NaN or infinite values: the checkpoint is corrupt")


# --- chapter 01: our own NumPy reader -----------------------------------------------------------


def _finite_numpy(arr: np.ndarray) -> bool:
    # min and max propagate NaN and are inf when any element is: two passes, no temporary array.
    return arr.size == 0 or bool(np.isfinite(arr.min()) and np.isfinite(arr.max()))


def load_safetensors_file(path: str | Path, dtype=np.float32, names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Loads the tensors `names` (default: all) of one file with our own parser. Floating
    tensors are converted to `dtype` (None keeps the stored float type, with bf16 widened to
    fp32 since NumPy cannot hold it) and must be finite."""
    path = Path(path)
    header, data_start = read_header(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name in header if names is None else names:
        info = header[name]
        begin, end = info["data_offsets"]
        buf = raw[data_start + begin : data_start + end]
        st_dtype = info["dtype"]
        arr = bf16_bits_to_f32(buf.view(np.uint16)) if st_dtype == "BF16" else buf.view(_NUMPY_DTYPES[st_dtype])
        arr = arr.reshape(info["shape"])
        if st_dtype in FLOAT_DTYPES:
            if dtype is not None:
                arr = arr.astype(dtype, copy=False)
            if not _finite_numpy(arr):
                raise _nonfinite_error(path, name)
        tensors[name] = np.array(arr, order="C")  # an owned, writable copy: the file can close
    return tensors


def load_checkpoint(model_dir: str | Path, config: LlamaConfig, dtype=np.float32) -> dict[str, np.ndarray]:
    """All weights of a Llama checkpoint directory as NumPy arrays, checked against its config."""
    tensors: dict[str, np.ndarray] = {}
    for f, names in plan_checkpoint(model_dir, config).items():
        tensors |= load_safetensors_file(f, dtype=dtype, names=names)
    return tensors


# --- chapters 02+: the safetensors library, into torch ------------------------------------------


def _finite_torch(t) -> bool:
    import torch

    # As above: aminmax is one pass and allocates nothing, where isfinite(t).all() on a bf16
    # CPU tensor is ~100x slower and allocates a bool per weight.
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def load_checkpoint_torch(model_dir: str | Path, config: LlamaConfig, dtype=None, device="cpu") -> dict:
    """All weights of a Llama checkpoint directory as torch tensors on `device`, floating ones
    cast to `dtype` (None keeps the stored dtype), checked against its config like
    `load_checkpoint`. The files are memory-mapped: a weight already in `dtype` on the CPU is
    not even copied."""
    import torch
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path, names in plan_checkpoint(model_dir, config).items():
        # Our read_header already accepted this file; the library's own complaints (it is
        # stricter about some details) still name the file.
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                stored = {name: f.get_tensor(name) for name in names}
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: the safetensors library cannot read it: {e}") from None
        for name, t in stored.items():
            stored_dtype = t.dtype
            t = t.to(device=device, dtype=dtype or t.dtype)
            if not _finite_torch(t):
                stored_t = stored[name]
                if t.dtype != stored_dtype and _finite_torch(stored_t):
                    # finite as stored: a weight beyond the range of the dtype asked for, not corruption
                    top = stored_t.abs().max().item()
                    short = str(t.dtype).removeprefix("torch.")
                    raise CheckpointError(
                        f"{path}: tensor {name!r} holds values up to {top:.4g}, past {short}'s range "
                        f"(its largest is {torch.finfo(t.dtype).max:.4g}): load it as bfloat16 or float32"
                    )
                raise _nonfinite_error(path, name)
            tensors[name] = t
    return tensors

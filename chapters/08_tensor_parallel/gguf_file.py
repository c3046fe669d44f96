"""A llama.cpp GGUF file -> this chapter's quantized checkpoint, copying the integers.

The bundled SmolLM2 is a Q4_1 GGUF. A Q4_1 block is 32 consecutive weights of one row in 20 bytes:

    d: float16 | m: float16 | 16 bytes of 4-bit codes q      weight = m + d * q,  q in 0..15
    byte j holds weight j in its low nibble and weight j + 16 in its high nibble

That is exactly our int4 asymmetric format with G = 32 (scale = d, min = m); only the nibble order
differs (ours: weight 2j low, 2j + 1 high). So the codes and both floats are copied, with no
float detour, and the result is bit for bit what quantize_int4(dequantized weights, 32) gives.

The file's other tensors: norms are F32 (kept), and the tied embedding is Q8_0 (blocks of 32 int8
codes with one float16 scale, symmetric). Our int8 keeps one scale per row, so that one tensor is
dequantized (d * q, exact in float32) and requantized per row: the only float step, measured in
tests/test_gguf.py.

llama.cpp also stores attn_q / attn_k rows in another order (its RoPE rotates adjacent pairs,
HF's rotates the two halves of a head): within each head, row 2i + r of GGUF is row i + r * hd/2
of HF. Rows are output channels with their own scales, so moving them is exact.

The GGUF's metadata gives config.json, and transformers converts its tokenizer.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch

from common.checkpoint import CheckpointError
from common.config import config_from_dict
from quant import Int4Weight, Int8Weight, QuantSpec, pack_int4, quantize_int8
from weights import save_quantized

GGUF_SPEC = QuantSpec(bits=4, group_size=32, symmetric=False, head_bits=8)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")  # blk.{i}.{what}.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    raise CheckpointError(f"GGUF tensor {gguf_name!r} is not part of a Llama model")


def read_q4_1(data: np.ndarray, n_out: int, n_in: int) -> Int4Weight:
    """Raw Q4_1 bytes [n_out, n_in / 32 * 20] -> Int4Weight (G = 32), codes copied."""
    blocks = data.reshape(n_out, n_in // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # [n_out, groups]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., 4:]  # [n_out, groups, 16]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n_out, n_in)  # GGUF order -> weight order
    return Int4Weight(pack_int4(torch.from_numpy(codes)), torch.from_numpy(d.copy()), torch.from_numpy(m.copy()), 32)


def read_q8_0_as_float(data: np.ndarray, n_out: int, n_in: int) -> torch.Tensor:
    """Raw Q8_0 bytes [n_out, n_in / 32 * 34] -> float32 [n_out, n_in] (d * q: exact in float32)."""
    blocks = data.reshape(n_out, n_in // 32, 34)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [n_out, groups, 1]
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)  # [n_out, groups, 32]
    return torch.from_numpy((d * q).reshape(n_out, n_in))


def unpermute_rows(w, n_heads: int):
    """llama.cpp's q/k row order -> HF's (see the module docstring). Works on any per-row tensor."""

    def fix(t):
        rows = t.shape[0]
        return t.reshape(n_heads, rows // n_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

    if isinstance(w, Int4Weight):
        return Int4Weight(fix(w.packed), fix(w.scale), fix(w.min), w.group_size, w.symmetric)
    return fix(w)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _size(reader, path: Path, key: str) -> int:
    """A metadata entry that sizes the model: present, a whole number, at least 1."""
    value = _field(reader, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{path}: metadata {key} is {value!r}; a Llama GGUF gives a whole number of at least 1")
    return value


def _positive(reader, path: Path, key: str, default=None) -> float:
    """A metadata entry that is a positive number (llama.cpp requires the RMS epsilon: without it
    the config said NaN, and the error named a config.json the user never wrote)."""
    value = _field(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise CheckpointError(f"{path}: metadata {key} is {value!r}; a Llama GGUF gives a positive number")
    return float(value)


def _token_id(reader, path: Path, key: str, vocab_size: int) -> int | None:
    value = _field(reader, key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size):
        raise CheckpointError(f"{path}: metadata {key} is {value!r}, outside its vocabulary of {vocab_size} tokens")
    return value


def expected_shapes(config: dict) -> dict[str, list[int]]:
    """Every tensor of a Llama checkpoint with `config`'s sizes: name -> [rows, inputs] (or [n])."""
    hidden, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": [config["vocab_size"], hidden], "model.norm.weight": [hidden]}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = [config["vocab_size"], hidden]
    layer = {
        "input_layernorm": [hidden], "post_attention_layernorm": [hidden],
        "self_attn.q_proj": [q, hidden], "self_attn.k_proj": [kv, hidden], "self_attn.v_proj": [kv, hidden],
        "self_attn.o_proj": [hidden, q],
        "mlp.gate_proj": [inter, hidden], "mlp.up_proj": [inter, hidden], "mlp.down_proj": [hidden, inter],
    }  # fmt: skip
    for i in range(config["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{name}.weight": shape for name, shape in layer.items()}
    return shapes


def _check_layout(reader, path: Path) -> None:
    """Each tensor's bytes start on the file's alignment and overlap no other's: the reader takes
    the offsets as written, so a shifted one would read its neighbour's bytes as its own."""
    alignment = getattr(reader, "alignment", 32)
    end = reader.data_offset
    for t in sorted(reader.tensors, key=lambda t: t.data_offset):
        if (t.data_offset - reader.data_offset) % alignment or t.data_offset < end:
            raise CheckpointError(
                f"{path}: tensor {t.name}'s data at byte {t.data_offset} is misaligned or overlaps the tensor "
                f"before it (alignment {alignment}): a corrupt file"
            )
        end = t.data_offset + t.n_bytes


def read_gguf(path: str | Path) -> tuple[dict, dict]:
    """-> (config.json as a dict, {checkpoint name: tensor or Int4Weight / Int8Weight})."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, IndexError) as e:
        # The reader maps the file and slices its tensors as the header says: a file cut short
        # fails there with numpy's words about shapes and sizes, so say what they mean.
        raise CheckpointError(
            f"{path}: not a readable GGUF file ({path.stat().st_size} bytes): cut short (an interrupted "
            f"download?) or not GGUF at all; the reader said: {e}"
        ) from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: architecture {arch!r}; this engine runs 'llama' GGUF files")
    _check_layout(reader, path)
    heads, hidden = _size(reader, path, "llama.attention.head_count"), _size(reader, path, "llama.embedding_length")
    kv_key = "llama.attention.head_count_kv"  # absent: as many as the query heads (GGUF's convention)
    kv_heads = _size(reader, path, kv_key) if kv_key in reader.fields else heads
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise CheckpointError(f"{path}: no tokenizer in its metadata (tokenizer.ggml.tokens)")
    names = {t.name for t in reader.tensors}
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None or int(embedding.shape[0]) != hidden:
        width = None if embedding is None else int(embedding.shape[0])
        raise CheckpointError(f"{path}: token_embd.weight has rows of {width}, llama.embedding_length says {hidden}")
    rope_key = "llama.rope.dimension_count"  # absent: the hidden size over the heads
    head_dim = _size(reader, path, rope_key) if rope_key in reader.fields else hidden // heads
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _size(reader, path, "llama.feed_forward_length"),
        "num_hidden_layers": _size(reader, path, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(np.float32(_positive(reader, path, "llama.attention.layer_norm_rms_epsilon"))),
        "rope_theta": _positive(reader, path, "llama.rope.freq_base", 10000.0),
        "max_position_embeddings": _size(reader, path, "llama.context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _token_id(reader, path, "tokenizer.ggml.bos_token_id", vocab),
        "eos_token_id": _token_id(reader, path, "tokenizer.ggml.eos_token_id", vocab),
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }
    if _field(reader, "llama.rope.scaling.type") not in (None, "none"):
        raise CheckpointError(f"{path}: RoPE scaling in GGUF metadata is not supported by this loader")
    config_from_dict(config, f"{path} (the config its metadata gives)")  # the checks of any config.json
    # Each tensor against the sizes the metadata gives, before any is read: a wrong head count or
    # feed_forward_length failed in a reshape, or as hundreds of shape errors after the conversion.
    want = expected_shapes(config)
    for t in reader.tensors:
        name, shape = hf_name(t.name), [int(x) for x in reversed(t.shape)]
        if name not in want:
            raise CheckpointError(f"{path}: tensor {t.name} is past the {config['num_hidden_layers']} layers of llama.block_count")
        if shape != want[name]:
            raise CheckpointError(
                f"{path}: tensor {t.name} is {shape}, its metadata's sizes make it {want[name]} (embedding_length "
                f"{hidden}, feed_forward_length {config['intermediate_size']}, head_count {heads} and head_count_kv "
                f"{kv_heads} of {head_dim} dimensions, {vocab} tokens)"
            )

    weights = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        shape = [int(x) for x in reversed(t.shape)]  # GGUF lists dimensions fastest-first
        data = np.asarray(t.data)
        kind = t.tensor_type.name
        if kind == "F32":
            w = torch.from_numpy(data.reshape(shape).copy())
        elif kind == "Q4_1":
            w = read_q4_1(data, *shape)
        elif kind == "Q8_0":
            w = quantize_int8(read_q8_0_as_float(data, *shape))
        else:
            raise CheckpointError(f"{path}: tensor {t.name} is {kind}; this loader reads F32, Q4_1 and Q8_0")
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            w = unpermute_rows(w, heads if "q_proj" in name else kv_heads)
        weights[name] = w
    return config, weights


def convert_gguf(path: str | Path, out: str | Path) -> Path:
    """Writes a quantized checkpoint directory (weights, config.json, tokenizer, generation
    config) from a GGUF file: what `quantize.py --from-gguf` and `--model x.gguf` run."""
    from transformers import AutoTokenizer  # here: importing transformers takes seconds

    path, out = Path(path), Path(out)
    config, weights = read_gguf(path)
    spec = _spec_of(weights, config)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:  # a failure leaves nothing behind: no half-written folder per attempt
        save_quantized(weights, config, spec, tmp)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except Exception as e:  # noqa: BLE001  (transformers' parser of GGUF metadata: any of its errors)
            first = str(e).splitlines()[0] if str(e) else ""
            raise CheckpointError(f"{path}: its tokenizer cannot be read ({type(e).__name__}: {first})") from None
        tokenizer.save_pretrained(tmp)
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2) + "\n"
        )
        if out.is_dir():
            out.rmdir()  # an empty folder only (quantize.py checks --out): never what a user keeps there
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _spec_of(weights: dict, config: dict) -> QuantSpec:
    """The files this chapter reads hold the mix llama.cpp writes for Q4_1: Q4_1 linears, a Q8_0
    (tied) embedding, F32 norms."""
    head = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))
    linears = [w for n, w in weights.items() if n.startswith("model.layers.") and "norm" not in n]
    if not (
        all(isinstance(w, Int4Weight) for w in linears)
        and isinstance(head, Int8Weight)
        and config["tie_word_embeddings"]
    ):
        raise CheckpointError("this chapter reads Q4_1 GGUF files (Q4_1 linears, a tied Q8_0 embedding, F32 norms)")
    return GGUF_SPEC

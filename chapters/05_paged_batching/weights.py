"""Where a model's weights come from, quantized or not, by their checkpoint names.

- A plain checkpoint directory, optionally quantized on load (`QuantSpec`).
- A quantized checkpoint directory written by quantize.py: config.json carries a
  `quantization_config` block, and each quantized linear `X.weight` is stored as
      X.qweight  int8 [out, in] (8 bits) or uint8 [out, in / 2] (4 bits, two codes per byte)
      X.scales   float32 [out] (8 bits) or float16 [out, in / G] (4 bits)
      X.mins     float16 [out, in / G] (4 bits, asymmetric only)
  Norms (and a kept embedding or head) stay as ordinary tensors under their own names.

Which weights: every linear layer of every decoder layer gets `bits`. The LM head gets `head_bits`
(8 by default): at batch 1 it is the largest single matmul (49152 x 576 for SmolLM2, 20% of the
weights), so leaving it in bf16 would read 57 MB of the ~95 a quantized token reads. A tied
embedding is the same matrix as the head, so it is stored once, quantized, and an embedding lookup
dequantizes just the rows of its tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.checkpoint import CheckpointError, checkpoint_files, expected_shapes, load_checkpoint_torch, read_header
from common.config import LlamaConfig
from common.errors import UserError
from quant import Int4Weight, Int8Weight, QuantSpec, group_size_for, nbytes

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
FORMAT = "llama-from-scratch-int"  # quantization_config["quant_method"] of our own format


def head_name(config: LlamaConfig) -> str:
    return "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"


def bits_of(name: str, config: LlamaConfig, spec: QuantSpec) -> int | None:
    """How many bits the checkpoint weight `name` gets under `spec` (None: stays a float tensor)."""
    if name == head_name(config):
        return spec.head_bits
    if name.startswith("model.layers.") and name.removesuffix(".weight").endswith(LINEARS):
        return spec.bits
    return None


def quantize_weights(weights: dict, config: LlamaConfig, spec: QuantSpec) -> dict:
    """{name: tensor} -> the same names, the quantized ones as Int8Weight / Int4Weight."""
    out = {}
    for name, w in weights.items():
        bits = bits_of(name, config, spec)
        out[name] = spec.quantize(w, bits) if bits else w
    return out


# --- quantized checkpoint directories --------------------------------------------------------


def spec_of(model_dir: str | Path) -> QuantSpec | None:
    """The QuantSpec of a quantized checkpoint directory; None for a plain one."""
    path = Path(model_dir) / "config.json"
    try:
        qc = json.loads(path.read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None  # load_config reports an unreadable config.json
    if qc is None:
        return None
    if not isinstance(qc, dict) or qc.get("quant_method") != FORMAT:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise CheckpointError(
            f"{path}: quantization_config quant_method {method!r} is not this chapter's "
            f"format ({FORMAT!r}); quantize the original model with quantize.py"
        )
    try:
        head = qc.get("lm_head_bits")
        return QuantSpec(
            bits=qc["bits"],
            group_size=qc.get("group_size", 32),
            symmetric=qc.get("symmetric", False),  # the string "false" is not False: QuantSpec checks
            head_bits=head,
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: quantization_config has no {e}") from None
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: quantization_config: {e}") from None


def quantization_config(spec: QuantSpec) -> dict:
    return {
        "quant_method": FORMAT,
        "bits": spec.bits,
        "group_size": spec.group_size,
        "symmetric": spec.symmetric,
        "lm_head_bits": spec.head_bits,
        "layout": "X.qweight (int8 [out,in] | uint8 [out,in/2], low nibble first), "
        "X.scales, X.mins (int4 asymmetric); w = mins + scales * q (int4), scales * q (int8)",
    }


def stored_tensors(weights: dict) -> dict[str, torch.Tensor]:
    """{checkpoint name: weight} -> the flat {file name: tensor} a safetensors file holds."""
    flat = {}
    for name, w in weights.items():
        base = name.removesuffix(".weight")
        if isinstance(w, Int8Weight):
            flat |= {base + ".qweight": w.q, base + ".scales": w.scale.float()}
        elif isinstance(w, Int4Weight):
            flat |= {base + ".qweight": w.packed, base + ".scales": w.scale}
            if not w.symmetric:
                flat[base + ".mins"] = w.min
        else:
            flat[name] = w
    return {k: v.contiguous() for k, v in flat.items()}


def _expected_entries(config: LlamaConfig, spec: QuantSpec) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{file name: (safetensors dtype, shape)} a quantized checkpoint of `config` must hold."""
    entries = {}
    for name, (n_out, *rest) in expected_shapes(config).items():
        bits = bits_of(name, config, spec)
        base = name.removesuffix(".weight")
        if bits == 8:
            entries |= {base + ".qweight": ("I8", (n_out, rest[0])), base + ".scales": ("F32", (n_out,))}
        elif bits == 4:
            n_in = rest[0]
            groups = n_in // group_size_for(n_in, spec.group_size)
            entries |= {base + ".qweight": ("U8", (n_out, n_in // 2)), base + ".scales": ("F16", (n_out, groups))}
            if not spec.symmetric:
                entries[base + ".mins"] = ("F16", (n_out, groups))
        else:
            entries[name] = (None, (n_out, *rest))  # a float tensor, any float dtype
    return entries


def load_quantized(model_dir: str | Path, config: LlamaConfig, spec: QuantSpec, dtype) -> dict:
    """A quantized checkpoint directory -> {checkpoint name: tensor or quantized weight}, after
    checking every stored tensor's name, dtype and shape against config.json and its
    quantization_config (so a wrong group size or a missing scale is named, not misread)."""
    from safetensors import SafetensorError, safe_open

    expected = _expected_entries(config, spec)
    stored: dict[str, tuple[Path, dict]] = {}
    problems = []
    for f in checkpoint_files(model_dir):
        header, _ = read_header(f)
        problems += [f"{name}: stored twice ({stored[name][0].name} and {f.name})" for name in header if name in stored]
        stored |= {name: (f, info) for name, info in header.items()}
    for name in sorted(expected.keys() & stored.keys()):
        want_dtype, want_shape = expected[name]
        info = stored[name][1]
        if tuple(info["shape"]) != want_shape:
            problems.append(
                f"{name}: shape {tuple(info['shape'])}, but config.json and its quantization_config "
                f"(bits={spec.bits}, group_size={spec.group_size}) imply {want_shape}"
            )
        elif want_dtype and info["dtype"] != want_dtype:
            problems.append(f"{name}: dtype {info['dtype']}, this format stores {want_dtype}")
        elif want_dtype is None and info["dtype"] not in ("F32", "F16", "BF16"):
            problems.append(f"{name}: dtype {info['dtype']}, expected a float type")
    # Wrong shapes first: they say most (a group size or bit width that does not match the file).
    problems += [f"missing tensor {n}" for n in expected if n not in stored]
    problems += [f"unexpected tensor {n}" for n in stored if n not in expected]
    if problems:
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        raise CheckpointError(
            f"{model_dir}: quantized checkpoint does not match config.json:\n  " + "\n  ".join(problems[:12]) + more
        )

    flat = {}
    for path in sorted({f for f, _ in stored.values()}):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                flat |= {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: the safetensors library cannot read it: {e}") from None
    for name, t in flat.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(f"{model_dir}: tensor {name} holds NaN or infinity")
        # a scale times the largest code must stay a float32 number: a finite 1e38 made every logit NaN
        if name.endswith((".scales", ".mins")) and not torch.isfinite(t.float().abs().amax() * 128):
            raise CheckpointError(f"{model_dir}: tensor {name} holds a scale past float32's range once multiplied out")
        # symmetric int4 rebuilds its float16 mins as -8 x scale: a scale above 8188 makes them -inf
        if spec.symmetric and name.endswith(".scales") and t.dtype == torch.float16:
            if not torch.isfinite((-8 * t.float().abs().amax()).half()):
                raise CheckpointError(f"{model_dir}: tensor {name}: -8 x its largest scale passes float16's range")

    weights = {}
    for name in expected_shapes(config):
        base = name.removesuffix(".weight")
        bits = bits_of(name, config, spec)
        if bits == 8:
            weights[name] = Int8Weight(flat[base + ".qweight"], flat[base + ".scales"])
        elif bits == 4:
            scale = flat[base + ".scales"]
            n_in = flat[base + ".qweight"].shape[1] * 2
            mins = flat[base + ".mins"] if not spec.symmetric else (-8 * scale.float()).half()
            weights[name] = Int4Weight(flat[base + ".qweight"], scale, mins, n_in // scale.shape[1], spec.symmetric)
        else:
            weights[name] = flat[name].to(dtype)
    return weights


def save_quantized(weights: dict, config_dict: dict, spec: QuantSpec, out: str | Path) -> Path:
    """Writes model.safetensors and config.json (with quantization_config) into `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(stored_tensors(weights), out / "model.safetensors", metadata={"format": "pt", "quantization": spec.name})
    config_dict = dict(config_dict, quantization_config=quantization_config(spec))
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    return out


def read_weights(
    model_dir: Path, config: LlamaConfig, dtype, quant: QuantSpec | None = None
) -> tuple[dict, QuantSpec | None]:
    """The weights of a plain or quantized checkpoint directory -> ({name: weight}, the spec in
    effect). A plain checkpoint is quantized when `quant` is given; a quantized one cannot be
    quantized again (its floats are gone)."""
    stored = spec_of(model_dir)
    if stored is not None:
        if quant is not None and quant != stored:
            raise UserError(f"{model_dir} is already quantized ({stored.name}); --quant applies to a plain checkpoint")
        return load_quantized(model_dir, config, stored, dtype), stored
    if quant is None:
        return load_checkpoint_torch(model_dir, config, dtype), None
    # Quantize from the stored floats (bf16 for SmolLM2), not from a cast copy.
    weights = quantize_weights(load_checkpoint_torch(model_dir, config, None), config, quant)
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in weights.items()}, quant


def weight_bytes(weights: dict) -> int:
    return sum(nbytes(w) for w in weights.values())
